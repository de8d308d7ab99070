"""``LossHeadOutput``: what a loss-head call returns: the per-token fields, and what ran and what it found."""

from dataclasses import dataclass
from typing import Optional

import torch

from ..algo import PolicyLossOutput
from .value_status import ValueStatus


@dataclass
class LossHeadOutput(PolicyLossOutput):
    """:class:`~openrlhf_lopti.algo.PolicyLossOutput` (``loss``, ``logp``, ``kl``, ``clipped``, ``entropy``, ``[N]``
    each) plus:

    Attributes:
        reduced: with per-token weights given up front (``loss_weights``), the scalar
            ``sum(loss_weights * loss) + sum(entropy_weights * entropy)``, the only field that carries a gradient
            then (the one-pass head); else None.
        backend: the backend that ran: ``"triton"``, ``"cpp"`` or ``"torch"`` (never ``"auto"``).
        status: the call's :class:`~openrlhf_lopti.ops.value_status.ValueStatus` (per-row bits, unread), which a
            trainer under ``check="step"`` adds to its :class:`~openrlhf_lopti.ops.value_status.StepChecks`.
    """

    reduced: Optional[torch.Tensor] = None
    backend: str = ""
    status: Optional[ValueStatus] = None
