"""The loss head's custom backwards are first order: a second derivative is refused, never silently wrong.

Their gradients come from kernels (Triton, C++, the lm_head's block steps) with no autograd graph back to the inputs.
Asked for ``create_graph=True``, autograd would take those gradients as constants, so ``d/dx`` of any function of
them would miss every term through them, without an error (``once_differentiable``'s own error fires only when
autograd reaches its node, which it never does here). Grad mode is on inside a backward exactly when the caller
asked for a graph, so that is the test.
"""

import functools
from typing import Callable

import torch


def first_order(op: str, instead: str) -> Callable:
    """Decorate an ``autograd.Function.backward`` (below ``@staticmethod``, above ``@once_differentiable``): it raises
    ``RuntimeError`` naming ``op`` and what to use ``instead`` when called with ``create_graph=True``."""

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{op}: a second derivative (backward with create_graph=True) is not supported: its kernels' "
                    f"gradients carry no graph, so it would be silently wrong; {instead}"
                )
            return backward(ctx, *grads)

        return checked

    return decorate
