"""The method as plain torch: AR weights, the Lopti round, the per-token policy loss (single source of truth).

Nothing here imports ray, deepspeed, vllm or openrlhf.
"""

from .advantage import ar_weight, reweight_advantages
from .direction import DIRECTION_EDGES, direction_counts, direction_metrics, sum_direction_counts
from .lopti import LOPTI_ORDERS, check_lopti_args
from .lopti_round import (
    PHASE_NAMES,
    THRESHOLD_FLOOR,
    LoptiRound,
    LoptiSettings,
    Phase,
    lopti_on,
    lopti_phases,
    lopti_settings,
    phase_gradient,
    plan_round,
    round_threshold,
)
from .option_checks import KL_ESTIMATORS, check_alpha, check_options, clip_range_supported
from .round_schedule import RoundSchedule
from .policy_loss import (
    PolicyLossOutput,
    approx_kl,
    policy_loss_from_logits,
    policy_loss_from_logp,
    token_logprobs,
)

__all__ = [
    "DIRECTION_EDGES",
    "KL_ESTIMATORS",
    "LOPTI_ORDERS",
    "LoptiRound",
    "LoptiSettings",
    "PHASE_NAMES",
    "Phase",
    "THRESHOLD_FLOOR",
    "PolicyLossOutput",
    "RoundSchedule",
    "approx_kl",
    "ar_weight",
    "check_alpha",
    "check_options",
    "clip_range_supported",
    "check_lopti_args",
    "direction_counts",
    "direction_metrics",
    "lopti_phases",
    "lopti_on",
    "lopti_settings",
    "phase_gradient",
    "plan_round",
    "policy_loss_from_logits",
    "policy_loss_from_logp",
    "reweight_advantages",
    "round_threshold",
    "sum_direction_counts",
    "token_logprobs",
]
