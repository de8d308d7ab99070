"""Triton backend of ``fused_policy_loss``: one forward and one backward kernel (``policy_loss.py``).

The kernels module is imported lazily: whether ``@triton.jit`` builds GPU or interpreter kernels is decided
by ``TRITON_INTERPRET`` at that import, and importing ``openrlhf_lopti.ops`` must not fix it early.
"""

import os

import torch


def triton_available() -> bool:
    """Whether the Triton backend can run here: triton is installed and CUDA is available, or
    ``TRITON_INTERPRET=1`` is set (kernels then run on CPU tensors, slowly: tests only)."""
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or a broken install (e.g. no matching driver libs)
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_policy_loss(*args, **kwargs):
    """:func:`openrlhf_lopti.ops.triton.policy_loss.triton_policy_loss`, imported on first use."""
    from .policy_loss import triton_policy_loss as run

    return run(*args, **kwargs)


__all__ = ["triton_available", "triton_policy_loss"]
