"""Settings of a local run (one dataclass, checked once) and the four method presets.

Defaults follow the paper's K&K column (PAPER_NOTES.md §5) except the sizes and the learning rate, which
are the demo's (``openrlhf-lopti demo``, tests/test_local_config.py holds them equal): a 0.35 M-parameter model on
2 CPU cores wants lr 5e-4, not 1e-6, and 20 new tokens (a 2-person answer is 15). With the older 1e-3 and 32
tokens, 50 AR+Lopti steps on the demo's model lowered its reward (issue 40).
"""

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Optional

from openrlhf_lopti.algo import (
    KL_ESTIMATORS,
    LoptiSettings,
    check_alpha,
    check_lopti_args,
    check_options,
    lopti_on,
    lopti_settings,
)
from openrlhf_lopti.algo.option_checks import in_float32
from openrlhf_lopti.errors import UserError

from .advantages import ESTIMATORS
from .task import PROMPT_STYLES

LOSS_BACKENDS = ("auto", "triton", "cpp", "torch")
OPTIMIZERS = ("adamw", "sgd")
# Whose optimizer state a Lopti phase steps with: "shared" (the paper's code: one optimizer, so phase 2's step
# carries the moments phase 1 just filled) or "per-phase" (phase k keeps its own moments from step to step).
LOPTI_MOMENTS = ("shared", "per-phase")
SEED_LIMIT = 2**40  # the derived seeds (seed * 1_000_003 + step) then fit a torch generator's int64
DEVICE_FORM = re.compile(r"auto|cpu|cuda(:\d+)?")
LOPTI_KEYS = ("eta", "lopti_quantile", "lopti_order")  # the names algo.lopti_settings' refusals give (its keys)

# The four methods the demo compares: name -> (alpha, lopti). AR's alpha = 0.3 is the paper's K&K value.
METHODS = {
    "grpo": (0.0, False),
    "ar": (0.3, False),
    "lopti": (0.0, True),
    "ar+lopti": (0.3, True),
}


class ConfigError(ValueError):
    """A bad :class:`TrainConfig` value; ``field`` names it (the CLI reports it as the field's flag). ``others``:
    further fields the message names as ``name=value`` (the CLI names those by their flags too)."""

    def __init__(self, field: str, message: str, others: tuple = ()):
        super().__init__(message)
        self.field = field
        self.others = tuple(others)

    def as_flag_error(self) -> UserError:
        """The same message as a command's :class:`UserError`, naming the field's flag (``--lopti-order``), and
        those of ``others`` (``--eta=0.3 and --lopti-quantile=0.2 ...``)."""
        text, flag = str(self), "--" + self.field.replace("_", "-")
        text = flag + text[len(self.field) :] if text.startswith(self.field) else text
        for name in self.others:
            text = re.sub(rf"(?<![-\w]){re.escape(name)}(?!\w)", "--" + name.replace("_", "-"), text)
        return UserError(text)


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
    eta: Optional[float] = None  # Lopti probability threshold; None: the paper's 0.5 (not with lopti_quantile)
    lopti_order: str = "low_first"
    lopti_quantile: Optional[float] = None
    lopti_moments: str = "shared"  # "per-phase": each phase its own optimizer state (opt-in; not the paper's)
    lopti_lr_scale: float = 1.0  # Lopti's phases step at lr * this (opt-in below 1; the paper's is 1)
    steps: int = 100
    prompts_per_step: int = 16
    n_samples: int = 8
    max_new_tokens: int = 20
    temperature: float = 0.7
    people: list = field(default_factory=lambda: [2])  # K&K sizes, cycled over prompts
    prompt_style: str = "auto"
    # A prompt dataset and an OpenRLHF reward file instead of generated K&K puzzles (see .dataset, .reward);
    # the names and meanings are OpenRLHF's --data.* / --eval.dataset / --reward.remote_url.
    data: Optional[str] = None  # jsonl / json / parquet / save_to_disk folder (comma-separated: concatenated)
    eval_data: Optional[str] = None  # held-out prompts, scored with reward_file
    input_key: str = "prompt"
    label_key: str = "label"  # "" = no label (every label is "")
    apply_chat_template: bool = False
    input_template: Optional[str] = None  # e.g. "User: {}\nAssistant:" (without apply_chat_template)
    reward_file: Optional[str] = None  # a .py file with reward_func(queries, prompts, labels)
    eval_n_samples: int = 1  # responses per held-out prompt: 1 = greedy, more = sampled at `temperature`
    optimizer: str = "adamw"  # "adamw" or "sgd" (plain gradient steps; momentum below)
    lr: float = 5e-4
    momentum: float = 0.0  # sgd only
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
    eval_every: int = 0  # steps between held-out evaluations; 0 = only at the end
    eval_prompts: int = 0  # held-out puzzles per evaluation (0 = none); with eval_data: its first N rows (0 = all)
    progress: bool = True  # tqdm bar
    track_direction: bool = False  # log direction/* (paper Fig. 3) after each update: one extra forward pass

    def __post_init__(self) -> None:
        self.people = [int(p) for p in self.people]
        self.lopti = lopti_on(self.lopti, self.lopti_quantile)  # a quantile alone turns Lopti on, as everywhere
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` (a ``ValueError``) naming the first bad field."""
        if self.estimator not in ESTIMATORS:
            raise ConfigError("estimator", f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        # algo's own checks, one argument at a time so that the error names the field
        checks = (
            ("alpha", lambda: check_alpha(self.alpha)),
            ("eta", lambda: self.eta in (None, 0) or check_lopti_args(self.eta, "low_first", None)),
            ("lopti_order", lambda: check_lopti_args(0.5, self.lopti_order, None)),
            ("lopti_quantile", lambda: check_lopti_args(0.5, "low_first", self.lopti_quantile)),
        )
        for name, check in checks:
            try:
                check()
            except ValueError as e:
                raise ConfigError(name, f"{name} {str(e).split(' ', 1)[1]}") from None
        if self.lopti_moments not in LOPTI_MOMENTS:
            message = f"lopti_moments must be one of {LOPTI_MOMENTS}, got {self.lopti_moments!r}"
            raise ConfigError("lopti_moments", message)
        # eta 0 is "Lopti off", as OpenRLHF's --algo.lopti.eta 0; with a quantile it is eta unset (algo.lopti_settings)
        if self.lopti and self.eta == 0 and self.lopti_quantile is None:
            raise ConfigError("eta", "eta 0 means Lopti off (as --algo.lopti.eta 0 in the OpenRLHF CLI), but lopti "
                              "is on (--lopti or a lopti --method): give eta in (0, 1], or turn Lopti off")  # fmt: skip
        try:  # algo's rules: eta and lopti_quantile are two thresholds, refused together; no order without Lopti
            self.lopti_settings  # noqa: B018
        except ValueError as e:
            message = str(e)
            name = message.split("=", 1)[0]
            others = [key for key in LOPTI_KEYS if key != name and re.search(rf"\b{key}=", message)]
            raise ConfigError(name, message, others) from None
        positive_ints = ("steps", "prompts_per_step", "n_samples", "max_new_tokens", "mini_batch_size", "epochs")
        for name in positive_ints + ("save_every", "eval_n_samples"):
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
        try:  # the loss's options by algo's one check: float32 must hold them (a float64 1e39 is inf in the loss)
            check_options(self.alpha, self.eps_low, self.eps_high, None, self.kl_coef, self.kl_estimator,
                          self.temperature)  # fmt: skip
        except ValueError as e:
            raise ConfigError(str(e).split(" ", 1)[0], str(e)) from None
        # float32 bounds too: the optimizer multiplies float32 weights by them (lr 1e39 made every weight inf)
        if not (isinstance(self.lr, (int, float)) and in_float32(self.lr) and self.lr > 0):
            raise ConfigError("lr", f"lr must be a finite number > 0, got {self.lr!r}")
        for name in ("weight_decay", "grad_clip", "kl_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and in_float32(value) and value >= 0):
                raise ConfigError(name, f"{name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.lopti_lr_scale, (int, float)) and 0 < self.lopti_lr_scale <= 1):
            message = f"lopti_lr_scale must be a number in (0, 1], got {self.lopti_lr_scale!r}"
            raise ConfigError("lopti_lr_scale", message)
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("optimizer", f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            raise ConfigError("momentum", f"momentum must be a number in [0, 1), got {self.momentum!r}")
        if self.momentum and self.optimizer != "sgd":
            raise ConfigError("momentum", f"momentum is an sgd setting (AdamW's is its beta1), got {self.momentum!r} "
                              f"with optimizer {self.optimizer!r}")  # fmt: skip
        if not 0 <= self.eps_low < 1:
            raise ConfigError("eps_low", f"eps_low must be in [0, 1), got {self.eps_low!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError("kl_estimator", f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not abs(self.seed) < SEED_LIMIT:
            raise ConfigError("seed", f"seed must be an integer with |seed| < 2**40, got {self.seed!r}")
        if not isinstance(self.device, str) or not DEVICE_FORM.fullmatch(self.device):
            raise ConfigError("device", f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError("dtype", f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        self._validate_data()
        if self.loss_backend not in LOSS_BACKENDS:
            raise ConfigError("loss_backend", f"loss_backend must be one of {LOSS_BACKENDS}, got {self.loss_backend!r}")

    def _validate_data(self) -> None:
        for name in ("data", "eval_data", "reward_file", "input_template"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.input_key, str) or not self.input_key:
            raise ConfigError("input_key", f"input_key must name the prompt field, got {self.input_key!r}")
        if (self.data or self.eval_data) and not self.reward_file:
            name = "data" if self.data else "eval_data"
            raise ConfigError("reward_file", f"reward_file is required with {name}: a .py file with OpenRLHF's "
                              "reward_func(queries, prompts, labels), e.g. tasks/reward_math.py")  # fmt: skip
        if self.data and self.eval_prompts and not self.eval_data:
            raise ConfigError("eval_prompts", "eval_prompts counts held-out K&K puzzles, which a data run does not "
                              "use: give eval_data (its rows are the held-out prompts)")  # fmt: skip
        if self.input_template is not None:
            if self.apply_chat_template:
                raise ConfigError("input_template", "input_template is ignored with apply_chat_template (OpenRLHF "
                                  "ignores it then): give one of them")  # fmt: skip
            if "{}" not in self.input_template:
                raise ConfigError("input_template", f"input_template must contain {{}} where the prompt goes, "
                                  f"got {self.input_template!r}")  # fmt: skip
            try:  # filled as OpenRLHF fills it: str.format with the prompt
                self.input_template.format("prompt")
            except (IndexError, KeyError, ValueError) as e:
                raise ConfigError("input_template", f"input_template is a str.format template with one {{}} for the "
                                  f"prompt; write a literal brace as {{{{ or }}}} (\\boxed{{{{}}}}), got "
                                  f"{self.input_template!r} ({type(e).__name__}: {e})") from None  # fmt: skip

    @property
    def step_lr(self) -> float:
        """The learning rate every optimizer step takes: ``lr``, times ``lopti_lr_scale`` with Lopti (its two
        phases each take a step per mini-batch where GRPO takes one)."""
        return self.lr * self.lopti_lr_scale if self.lopti else self.lr

    @property
    def lopti_settings(self) -> Optional[LoptiSettings]:
        """The round's settings (``algo.lopti_settings``), or None without Lopti."""
        return lopti_settings(self.lopti, self.eta, self.lopti_order, self.lopti_quantile, LOPTI_KEYS)

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


def saved_settings(values: dict) -> dict:
    """A run's saved settings (its ``config.json``, its checkpoint's ``config``) as this version reads them: an ``eta``
    that an older version wrote for every run (0.5 by default) but that did nothing is dropped (None)."""
    values = dict(values)
    if values.get("eta") is not None and values.get("lopti_quantile") is not None:
        # saved before eta and a quantile were refused together, when eta was always written (0.5 by default)
        # and the quantile won: the run's threshold was the quantile
        values["eta"] = None
    elif values.get("eta") == 0.5 and not lopti_on(values.get("lopti", False), values.get("lopti_quantile")):
        # the same old default in a run without Lopti: only the logged low-token share read it, and None is 0.5
        values["eta"] = None
    return values


def method_list(text: str) -> list[str]:
    """``--methods grpo,ar`` -> ``["grpo", "ar"]``: a comma-separated subset of :data:`METHODS`, each once (a method
    named twice would train, or be measured, twice and be listed twice in the table)."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        raise UserError(f"--methods must be a comma-separated subset of {','.join(METHODS)}, got {text!r}")
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:
        raise UserError(f"--methods names {', '.join(twice)} twice: give each method once, got {text!r}")
    return methods


def method_settings(method: str) -> dict:
    """``{"alpha": ..., "lopti": ...}`` of a preset in :data:`METHODS`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    alpha, lopti = METHODS[method]
    return {"alpha": alpha, "lopti": lopti}
