"""Fused loss-head operators; ``fused_policy_loss`` dispatches to the triton / cpp / torch backends, and
``fused_linear_policy_loss`` / ``linear_log_probs`` run the lm_head with it chunk by chunk."""

from .fused_linear_policy_loss import fused_linear_policy_loss, linear_log_probs
from .fused_policy_loss import BACKENDS, fused_policy_loss
from .loss_options import LossOptions

__all__ = ["BACKENDS", "LossOptions", "fused_linear_policy_loss", "fused_policy_loss", "linear_log_probs"]
