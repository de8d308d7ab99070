"""``LoptiGRPOConfig``: TRL's ``GRPOConfig`` plus the options of AR, Lopti, our fused loss kernels and the vLLM engine.

Every check is here, so a bad configuration fails when the config is built, with one line naming the option.
:func:`trl_loss_reason` says which loss path runs (the fused kernel where it computes exactly the requested loss,
else TRL's own loss with AR's weights and the Lopti phase); :func:`refusals` lists the combinations
``LoptiGRPOTrainer`` refuses; the trainer runs both again with what only it knows (the model, the processes).
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from trl import GRPOConfig

from openrlhf_lopti.algo import LoptiSettings, check_alpha, check_lopti_args, lopti_on, lopti_settings
from openrlhf_lopti.algo.option_checks import in_float32, number_option
from openrlhf_lopti.ops import BACKENDS, clip_range_supported
from openrlhf_lopti.ops.fused_policy_loss import backend_cannot_run

from . import cpu_colocate

# TRL loss types whose per-token term is the PPO clipped surrogate ``fused_policy_loss`` computes; they differ
# only in how the per-token losses are normalised, and those normalisations are kept. The others run TRL's loss.
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
LOPTI_KEYS = ("lopti_eta", "lopti_quantile", "lopti_order")  # the names algo.lopti_settings' refusals give


@dataclass
class LoptiGRPOConfig(GRPOConfig):
    """TRL's ``GRPOConfig`` with nine more fields (see ``openrlhf_lopti.trl.trainer`` for what each changes).

    Args:
        ar_alpha: Advantage Reweighting strength in [0, 1] (paper Eq. 4; 0 = off, the paper's K&K value 0.3).
        lopti_eta: Lopti's probability threshold in (0, 1] (paper: 0.5), or None for no Lopti (0 with a
            ``lopti_quantile``: unset, as None).
        lopti_order: ``"low_first"`` (Lopti) or ``"high_first"`` (the paper's ablation, which collapses).
        lopti_quantile: if set, in (0, 1): the threshold is this quantile of the generation batch's token
            probabilities over every process; it turns Lopti on by itself. Not with ``lopti_eta`` (refused).
        fused_loss: compute the per-token loss with ``openrlhf_lopti.ops.fused_policy_loss`` where it computes
            exactly the loss TRL's options ask for (:func:`trl_loss_reason`); elsewhere, and with False, TRL's own
            loss runs, with AR's weights and the Lopti phase when they are on (untouched when they are off).
        fused_lm_head: with ``fused_loss``: ``fused_linear_policy_loss`` on the last hidden states and the
            output layer, so the ``[N, V]`` logits are never made (on any number of processes).
        loss_backend: the kernels' backend, one of ``openrlhf_lopti.ops.BACKENDS`` (``"auto"``: triton on CUDA,
            the C++ kernel on CPU when built, else torch).
        track_direction: log ``direction/*`` (paper Fig. 3) after each round (one forward-only pass over it).
        vllm_dtype: dtype of the colocated vLLM engine (``"auto"``: vLLM's choice, which makes an fp32 checkpoint
            a bf16 engine; ``"float32"``: sampled log-probs equal to an fp32 training model's). See ``cpu_colocate``.
    """

    ar_alpha: float = field(default=0.0, metadata={"help": "Advantage Reweighting alpha in [0, 1]; 0 is off."})
    lopti_eta: Optional[float] = field(
        default=None, metadata={"help": "Lopti threshold eta in (0, 1] on the old probability; None is off."}
    )
    lopti_order: str = field(default="low_first", metadata={"help": "'low_first' (Lopti) or 'high_first'."})
    lopti_quantile: Optional[float] = field(
        default=None, metadata={"help": "Threshold = this quantile of the batch's token probabilities."}
    )
    fused_loss: bool = field(
        default=True, metadata={"help": "Loss through fused_policy_loss where it computes the requested loss."}
    )
    fused_lm_head: bool = field(default=False, metadata={"help": "Loss through fused_linear_policy_loss."})
    loss_backend: str = field(default="auto", metadata={"help": "Kernel backend: auto, triton, cpp or torch."})
    track_direction: bool = field(
        default=False, metadata={"help": "Log direction/* (paper Fig. 3) after each round: one forward pass."}
    )
    vllm_dtype: str = field(
        default="auto", metadata={"help": "dtype of the colocated vLLM engine: auto (vLLM's), float32, bfloat16."}
    )

    @property
    def lopti(self) -> bool:
        """Whether Lopti's two phases run (``algo.lopti_on``: ``lopti_eta`` set, or ``lopti_quantile`` alone)."""
        return lopti_on(self.lopti_eta is not None, self.lopti_quantile)

    @property
    def lopti_settings(self) -> Optional[LoptiSettings]:
        """The round's settings (``algo.lopti_settings``), or None without Lopti."""
        return lopti_settings(self.lopti, self.lopti_eta, self.lopti_order, self.lopti_quantile, keys=LOPTI_KEYS)

    def __post_init__(self):
        super().__post_init__()
        try:
            self.ar_alpha = check_alpha(self.ar_alpha)
        except ValueError as error:
            raise ValueError(f"ar_alpha: {error}") from None
        if self.lopti:
            # lopti_eta None, or 0 with a quantile, is eta unset (algo.lopti_settings; OpenRLHF's --algo.lopti.eta 0)
            zero = self.lopti_eta == 0 and not isinstance(self.lopti_eta, bool)
            unset = self.lopti_eta is None or (zero and self.lopti_quantile is not None)
            eta = 0.5 if unset else self.lopti_eta
            try:
                check_lopti_args(eta, self.lopti_order, self.lopti_quantile)
            except ValueError as error:
                raise ValueError(f"lopti_{str(error).split()[0]}: {error}") from None
        elif self.lopti_order not in ("low_first", "high_first"):
            raise ValueError(f"lopti_order must be 'low_first' or 'high_first', got {self.lopti_order!r}")
        self.lopti_settings  # noqa: B018 - raises on algo's rule: the two thresholds together are refused
        if self.loss_backend not in BACKENDS:
            raise ValueError(f"loss_backend must be one of {BACKENDS}, got {self.loss_backend!r}")
        device_type = "cpu" if self.use_cpu or not torch.cuda.is_available() else "cuda"  # the trainer's device
        problem = backend_cannot_run(self.loss_backend, device_type)  # else found after the model and a generation
        if self.fused_loss and problem:
            raise ValueError(f"loss_backend={self.loss_backend!r} {problem}; use loss_backend='auto'")
        # TRL takes NaN / inf here and trains the weights to NaN with a logged loss of 0 (TRL's NaN filter); an
        # infinite clip range is TRL's "no clip" (TRL's loss runs it), NaN is nothing
        for name in ("beta", "entropy_coef"):
            value = getattr(self, name)
            if not in_float32(number_option(name, value)):
                raise ValueError(f"{name} must be a finite number (as float32, the precision of the loss), got {value!r}")
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self, name)
            if value is not None and math.isnan(number_option(name, value)):
                raise ValueError(f"{name} must be a number (inf: no clip on that side), got nan")
        problems = refusals(self) + cpu_colocate.refusals(self)
        if problems:
            raise ValueError(problems[0])


def trl_loss_reason(args: LoptiGRPOConfig, multimodal: bool = False) -> Optional[str]:
    """The first option of ``args`` that ``fused_policy_loss`` does not compute exactly, as ``"name=value"``, or None
    when the fused kernel computes the requested loss. Where it is not None, TRL's own loss runs (with AR's weights
    and the Lopti phase: ``LoptiGRPOTrainer._compute_loss``).

    Args:
        args: the configuration.
        multimodal: the processing class is a multimodal processor (the fused path passes text tokens only).
    """
    if not args.fused_loss:
        return "fused_loss=False"
    if args.loss_type not in CLIPPED_LOSS_TYPES:
        return f"loss_type={args.loss_type!r}"  # not the PPO clipped surrogate
    if args.importance_sampling_level != "token":
        return f"importance_sampling_level={args.importance_sampling_level!r}"  # the kernel's ratio is per token
    for name in ("delta", "off_policy_mask_threshold"):  # two-sided clipping; a mask over each sequence's tokens
        if getattr(args, name) is not None:
            return f"{name}={getattr(args, name)!r}"
    if args.use_adaptive_entropy:
        return "use_adaptive_entropy=True"  # TRL's controller, kept where it is
    if not clip_range_supported(args.epsilon, 0.0):  # e.g. epsilon=1.0: no lower clip, which TRL takes
        return f"epsilon={args.epsilon!r}"
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high  # TRL's rule
    if not clip_range_supported(0.0, eps_high):
        return f"epsilon_high={eps_high!r}"
    if multimodal:
        return "a multimodal processing class"
    return None


def refusals(args: LoptiGRPOConfig, multimodal: bool = False) -> list:
    """One line per combination in ``args`` that ``LoptiGRPOTrainer`` refuses (empty: all fine). Every option TRL
    takes runs, on the fused path or on TRL's loss (:func:`trl_loss_reason`); refused are combinations without a
    meaning and what the fused lm_head cannot do.

    Args:
        args: the configuration.
        multimodal: the processing class is a multimodal processor.
    """
    out = []
    method = args.ar_alpha != 0 or args.lopti
    if args.fused_lm_head:
        reason = trl_loss_reason(args, multimodal)
        if not args.fused_loss:
            out.append("fused_lm_head=True needs fused_loss=True")
        elif reason is not None:
            out.append(
                f"fused_lm_head=True with {reason}: the fused lm_head computes the token-level clipped surrogate only "
                "(this option runs TRL's loss); set fused_lm_head=False"
            )
    if multimodal and method:
        out.append(
            "ar_alpha / lopti_eta / lopti_quantile with a multimodal model: the rollout log-probs AR and Lopti read "
            "are computed from text tokens only here"
        )
    if args.top_entropy_quantile < 1.0 and args.lopti:
        out.append(
            f"top_entropy_quantile={args.top_entropy_quantile} with lopti_eta / lopti_quantile: two token selections "
            "on top of each other (Lopti's phases and TRL's entropy mask); use one"
        )
    if args.lopti and args.num_iterations < 1:
        out.append(f"num_iterations={args.num_iterations}: Lopti trains each phase num_iterations times; use 1 or more")
    elif args.lopti and (args.steps_per_generation * args.num_iterations) % args.gradient_accumulation_steps:
        out.append(
            f"Lopti needs steps_per_generation x num_iterations ({args.steps_per_generation} x {args.num_iterations})"
            f" to be a multiple of gradient_accumulation_steps ({args.gradient_accumulation_steps}), so that each "
            "phase ends on an optimizer step"
        )
    elif args.lopti and args.max_steps > 0:
        per_round = optimizer_steps_per_round(args)
        if args.max_steps % per_round:
            out.append(
                f"max_steps={args.max_steps} would stop between the two Lopti phases of a round: a round is {per_round} "
                f"optimizer steps (2 phases x steps_per_generation x num_iterations / gradient_accumulation_steps); "
                f"use a multiple of {per_round}"
            )
    return out


def optimizer_steps_per_round(args: LoptiGRPOConfig) -> int:
    """Optimizer steps of one Lopti round: 2 phases x ``steps_per_generation x num_iterations`` micro-steps /
    ``gradient_accumulation_steps`` (a whole number: :func:`refusals` refuses the rest)."""
    return 2 * args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
