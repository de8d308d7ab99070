"""Fused loss-head operators; ``fused_policy_loss`` dispatches to the triton / cpp / torch backends."""

from .fused_policy_loss import BACKENDS, fused_policy_loss

__all__ = ["BACKENDS", "fused_policy_loss"]
