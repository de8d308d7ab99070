"""Glue to TRL 1.16's ``GRPOTrainer``: AR, Lopti and the fused loss kernels (``pip install -e ".[trl]"``).

Imports ``trl`` (and so transformers / accelerate); nothing of OpenRLHF, Ray, DeepSpeed or vLLM.
"""

from .config import CLIPPED_LOSS_TYPES, LoptiGRPOConfig, refusals
from .trainer import LoptiGRPOTrainer, kk_reward

__all__ = ["CLIPPED_LOSS_TYPES", "LoptiGRPOConfig", "LoptiGRPOTrainer", "kk_reward", "refusals"]
