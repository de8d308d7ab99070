"""Settings of a local run (one dataclass, checked once) and the four method presets.

Defaults follow the paper's K&K column (PAPER_NOTES.md §5) except the sizes and the learning rate, which
are the demo's: a 0.35 M-parameter model on 2 CPU cores wants lr 1e-3-ish, not 1e-6.
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from openrlhf_lopti.algo import KL_ESTIMATORS, check_alpha, check_lopti_args

from .advantages import ESTIMATORS
from .task import PROMPT_STYLES

LOSS_BACKENDS = ("auto", "triton", "cpp", "torch")

# The four methods the demo compares: name -> (alpha, lopti). AR's alpha = 0.3 is the paper's K&K value.
METHODS = {
    "grpo": (0.0, False),
    "ar": (0.3, False),
    "lopti": (0.0, True),
    "ar+lopti": (0.3, True),
}


class ConfigError(ValueError):
    """A bad :class:`TrainConfig` value; ``field`` names it (the CLI reports it as the field's flag)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class TrainConfig:
    """Everything a local run needs; saved as ``config.json`` in the run directory.

    Units: ``lr`` per optimizer step, ``temperature`` of the sampling softmax, sizes in sequences
    (``prompts_per_step * n_samples`` responses per step) or tokens (``max_new_tokens``).
    """

    model: str  # local HF checkpoint directory
    out: str  # run directory (metrics.jsonl, checkpoint.pt, plots, final_model/)
    estimator: str = "grpo"  # "grpo" (group-normalised) or "reinforce++" (batch-whitened, KL in reward)
    alpha: float = 0.0  # AR strength (0 = off)
    lopti: bool = False
    eta: float = 0.5  # Lopti probability threshold
    lopti_order: str = "low_first"
    lopti_quantile: Optional[float] = None
    steps: int = 100
    prompts_per_step: int = 16
    n_samples: int = 8
    max_new_tokens: int = 32
    temperature: float = 0.7
    people: list = field(default_factory=lambda: [2])  # K&K sizes, cycled over prompts
    prompt_style: str = "auto"
    lr: float = 1e-3
    weight_decay: float = 0.0
    mini_batch_size: int = 64  # responses per optimizer step
    micro_batch_size: int = 0  # responses per forward (gradient accumulation); 0 = the mini-batch
    epochs: int = 1  # passes over each batch (per Lopti phase)
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    kl_coef: float = 0.001  # GRPO: k3 KL loss weight; REINFORCE++: k1 KL reward weight
    kl_estimator: str = "k3"
    eps_low: float = 0.2
    eps_high: float = 0.24
    seed: int = 0
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    dtype: str = "float32"  # "float32" or "bfloat16"
    loss_backend: str = "auto"
    fused_lm_head: bool = False  # lm_head + loss chunk by chunk from the last hidden states: no [N, V] logits
    save_every: int = 1  # steps between checkpoints (1: a crash loses at most one step)
    eval_every: int = 0  # steps between greedy held-out evaluations; 0 = only at the end
    eval_prompts: int = 0  # held-out puzzles per evaluation; 0 = no evaluation
    progress: bool = True  # tqdm bar
    track_direction: bool = False  # log direction/* (paper Fig. 3) after each update: one extra forward pass

    def __post_init__(self) -> None:
        self.people = [int(p) for p in self.people]
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` (a ``ValueError``) naming the first bad field."""
        if self.estimator not in ESTIMATORS:
            raise ConfigError("estimator", f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        # algo's own checks, one argument at a time so that the error names the field
        checks = (
            ("alpha", lambda: check_alpha(self.alpha)),
            ("eta", lambda: self.eta == 0 or check_lopti_args(self.eta, "low_first", None)),
            ("lopti_order", lambda: check_lopti_args(0.5, self.lopti_order, None)),
            ("lopti_quantile", lambda: check_lopti_args(0.5, "low_first", self.lopti_quantile)),
        )
        for name, check in checks:
            try:
                check()
            except ValueError as e:
                raise ConfigError(name, f"{name} {str(e).split(' ', 1)[1]}") from None
        if self.lopti and self.eta == 0:  # eta 0 is "Lopti off", as OpenRLHF's --algo.lopti_eta 0
            raise ConfigError("eta", "eta 0 means Lopti off (as --algo.lopti_eta 0 in the OpenRLHF CLI), but lopti "
                              "is on (--lopti or a lopti --method): give eta in (0, 1], or turn Lopti off")  # fmt: skip
        positive_ints = ("steps", "prompts_per_step", "n_samples", "max_new_tokens", "mini_batch_size", "epochs")
        for name in positive_ints + ("save_every",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(name, f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("micro_batch_size", "eval_every", "eval_prompts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(name, f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.estimator == "grpo" and self.n_samples < 2:
            message = f"n_samples must be >= 2 for GRPO's group normalisation, got {self.n_samples}"
            raise ConfigError("n_samples", message)
        if not self.people or any(not 2 <= p <= 8 for p in self.people):
            raise ConfigError("people", f"people must list K&K sizes in [2, 8], got {self.people!r}")
        if self.prompt_style not in PROMPT_STYLES:
            raise ConfigError("prompt_style", f"prompt_style must be one of {PROMPT_STYLES}, got {self.prompt_style!r}")
        for name in ("temperature", "lr"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(name, f"{name} must be a finite number > 0, got {value!r}")
        for name in ("weight_decay", "grad_clip", "kl_coef", "eps_high"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(name, f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 <= self.eps_low < 1:
            raise ConfigError("eps_low", f"eps_low must be in [0, 1), got {self.eps_low!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError("kl_estimator", f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError("dtype", f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.loss_backend not in LOSS_BACKENDS:
            raise ConfigError("loss_backend", f"loss_backend must be one of {LOSS_BACKENDS}, got {self.loss_backend!r}")

    @property
    def method(self) -> str:
        """Short name of the method: grpo / ar / lopti / ar+lopti, or reinforce++ / reinforce++:ar ... ."""
        parts = [n for n, on in (("ar", self.alpha > 0), ("lopti", self.lopti)) if on]
        if self.estimator == "grpo":
            return "+".join(parts) or "grpo"
        return ":".join(["reinforce++", "+".join(parts)]) if parts else "reinforce++"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        """Build from a dict (e.g. a saved ``config.json``); unknown keys raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config fields: {unknown}")
        return cls(**values)


def method_settings(method: str) -> dict:
    """``{"alpha": ..., "lopti": ...}`` of a preset in :data:`METHODS`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    alpha, lopti = METHODS[method]
    return {"alpha": alpha, "lopti": lopti}
