"""Fused loss-head operators; ``fused_policy_loss`` dispatches to the triton / cpp / torch backends, and
``fused_linear_policy_loss`` / ``linear_log_probs`` run the lm_head with it block by block. Their value checks are
status bits read when ``LossOptions.check`` says (``value_status``: at once, at the optimizer step, or never)."""

from ..algo.option_checks import clip_range_supported  # the kernel's clip range, for the front ends
from .fused_linear_policy_loss import fused_linear_policy_loss, linear_log_probs
from .fused_policy_loss import BACKENDS, backends_ran, fused_policy_loss
from .loss_head_output import LossHeadOutput
from .loss_options import LossOptions
from .value_status import CHECK_POLICIES, StepChecks

__all__ = [
    "BACKENDS",
    "CHECK_POLICIES",
    "LossHeadOutput",
    "LossOptions",
    "StepChecks",
    "backends_ran",
    "clip_range_supported",
    "fused_linear_policy_loss",
    "fused_policy_loss",
    "linear_log_probs",
]
