"""Our OpenRLHF flags: add them to a parser, read them into a :class:`LoptiConfig`, reject what cannot work.

Flag -> config field (nested like upstream's ``--algo.kl.*`` / ``--algo.advantage.*``, so ``hierarchize`` makes
them ``args.algo.ar.alpha``, ``args.algo.lopti.eta``, ...):

    --algo.ar.alpha            ar_alpha            AR strength in [0, 1]; 0 = off (paper: 0.3 K&K, 0.1 math)
    --algo.lopti.eta           lopti_eta           Lopti probability threshold in (0, 1]; 0 = off (paper: 0.5)
    --algo.lopti.order         lopti_order         low_first (Lopti) | high_first (the paper's ablation)
    --algo.lopti.quantile      lopti_quantile      threshold = this quantile of the batch's token probabilities
                                                   (switches Lopti on by itself; eta is then not used)
    --algo.lopti.denominator   lopti_denominator   all (authors' code) | phase: token-mean denominator per phase
    --actor.fused_loss         fused_loss          auto | triton | cpp | torch | off (upstream's PolicyLoss)
    --actor.fused_lm_head      fused_lm_head       the fused loss from the last hidden states: no [N, V] logits
    --algo.track_direction     track_direction     log direction/* (paper Fig. 3) after each update

Nothing here imports openrlhf, ray, deepspeed or vLLM: the CLI's ``--help`` and parse-time checks run on a
CPU-only install.
"""

import argparse
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from openrlhf_lopti.algo import LOPTI_ORDERS, LoptiSettings, check_alpha, check_lopti_args, lopti_settings
from openrlhf_lopti.ops import clip_range_supported

FUSED_LOSS_CHOICES = ("auto", "triton", "cpp", "torch", "off")
LOPTI_DENOMINATORS = ("all", "phase")
# the names algo.lopti_settings' refusals give: the two thresholds, the order
LOPTI_KEYS = ("--algo.lopti.eta", "--algo.lopti.quantile", "--algo.lopti.order")


@dataclass(frozen=True)
class LoptiConfig:
    """Our settings, read from OpenRLHF's (flat or hierarchized) args by :func:`lopti_config`."""

    ar_alpha: float = 0.0
    lopti_eta: float = 0.0
    lopti_order: str = "low_first"
    lopti_quantile: Optional[float] = None
    lopti_denominator: str = "all"
    fused_loss: str = "auto"
    fused_lm_head: bool = False
    track_direction: bool = False

    @property
    def lopti_enabled(self) -> bool:
        return self.lopti is not None

    @property
    def lopti(self) -> Optional[LoptiSettings]:
        """The round's settings (``algo.lopti_settings``: eta > 0, or a quantile alone, turns Lopti on), or None."""
        return lopti_settings(self.lopti_eta > 0, self.lopti_eta, self.lopti_order, self.lopti_quantile, keys=LOPTI_KEYS)


def _arg(args: Any, dotted: str, default: Any = None) -> Any:
    """``args.a.b`` for hierarchized args, ``getattr(args, "a.b")`` for argparse's flat Namespace."""
    if hasattr(args, dotted):
        return getattr(args, dotted)
    node = args
    for part in dotted.split("."):
        if not hasattr(node, part):
            return default
        node = getattr(node, part)
    return node


def lopti_config(args: Any) -> LoptiConfig:
    """Our flags from ``args`` (flat argparse Namespace or OpenRLHF's hierarchized one); defaults if absent."""
    default = LoptiConfig()
    return LoptiConfig(
        ar_alpha=float(_arg(args, "algo.ar.alpha", default.ar_alpha)),
        lopti_eta=float(_arg(args, "algo.lopti.eta", default.lopti_eta)),
        lopti_order=_arg(args, "algo.lopti.order", default.lopti_order),
        lopti_quantile=_arg(args, "algo.lopti.quantile", default.lopti_quantile),
        lopti_denominator=_arg(args, "algo.lopti.denominator", default.lopti_denominator),
        fused_loss=_arg(args, "actor.fused_loss", default.fused_loss),
        fused_lm_head=bool(_arg(args, "actor.fused_lm_head", default.fused_lm_head)),
        track_direction=bool(_arg(args, "algo.track_direction", default.track_direction)),
    )


def _checked(check: Callable[[float], Any]) -> Callable[[str], float]:
    """An argparse ``type=`` that parses a float and runs ``check`` on it, so bad values fail at parse time."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        try:
            check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return parse


def _check_eta(value: float) -> None:
    if value != 0:  # 0 switches Lopti off
        check_lopti_args(value, "low_first", None)


def _check_quantile(value: float) -> None:
    check_lopti_args(0.5, "low_first", value)


def add_lopti_flags(parser: argparse.ArgumentParser) -> None:
    """Add our flags to ``parser`` (upstream's train_ppo_ray parser) in their own help group."""
    group = parser.add_argument_group(
        "openrlhf-lopti",
        "Advantage Reweighting (AR) and Low-Probability Token Isolation (Lopti), arXiv 2505.12929",
    )
    group.add_argument(
        "--algo.ar.alpha",
        type=_checked(check_alpha),
        default=0.0,
        help="AR: scale each token's advantage by alpha*p_old + 1 - alpha, alpha in [0, 1]; 0 = off "
        "(paper: 0.3 on K&K, 0.1 on math)",
    )
    group.add_argument(
        "--algo.lopti.eta",
        type=_checked(_check_eta),
        default=0.0,
        help="Lopti: update tokens with p_old < eta first, then the rest, each phase a full pass of the "
        "micro-batch/optimizer-step loop; eta in (0, 1], 0 = off (paper: 0.5)",
    )
    group.add_argument(
        "--algo.lopti.order",
        choices=LOPTI_ORDERS,
        default="low_first",
        help="Lopti phase order: low_first (the method) or high_first (the paper's ablation, which collapses)",
    )
    group.add_argument(
        "--algo.lopti.quantile",
        type=_checked(_check_quantile),
        default=None,
        help="Lopti with, instead of eta, this quantile in (0, 1) of the batch's token probabilities as the "
        "threshold (about this fraction of tokens is 'low'); switches Lopti on by itself",
    )
    group.add_argument(
        "--algo.lopti.denominator",
        choices=LOPTI_DENOMINATORS,
        default="all",
        help="token-mean denominator of each Lopti phase: all response tokens of the batch (the authors' "
        "code) or the phase's own tokens",
    )
    group.add_argument(
        "--actor.fused_loss",
        choices=FUSED_LOSS_CHOICES,
        default="auto",
        help="policy loss through openrlhf-lopti's fused_policy_loss: auto (triton on GPU once its self-check on "
        "that GPU passes, the C++ kernel on CPU when built, else torch; upstream's PolicyLoss for settings the "
        "fused loss does not cover), triton, cpp (CPU), torch (the reference), or off (upstream's PolicyLoss, AR "
        "applied to the advantages)",
    )
    group.add_argument(
        "--actor.fused_lm_head",
        action="store_true",
        default=False,
        help="with the fused loss, compute the output layer (lm_head) and the loss together, chunk by chunk, in "
        "training and in the old-policy / reference log-prob passes, so the [tokens, vocab] logits never exist "
        "(models whose logits are lm_head(hidden): no soft-capping or logit scale)",
    )
    group.add_argument(
        "--algo.track_direction",
        action="store_true",
        default=False,
        help="after each RL step's update, one forward-only pass over its experience logs, per probability "
        "quartile of the rollout policy, the share of positive-advantage tokens whose log-prob rose and of "
        "negative-advantage tokens whose log-prob fell (direction/pos_up_q1..q4, direction/neg_down_q1..q4, "
        "direction/tokens_q1..q4: the paper's Fig. 3 inside training)",
    )


def _clip_range(args: Any) -> tuple:
    """``(low, high)``: upstream's PPO clip range (``--actor.eps_clip_low_high``, else ``--actor.eps_clip`` twice)."""
    both = _arg(args, "actor.eps_clip_low_high", None)
    if both is None:
        eps = _arg(args, "actor.eps_clip", 0.2)
        return float(eps), float(eps)
    low, high = both
    return float(low), float(high)


def fused_loss_blockers(args: Any) -> list[str]:
    """Upstream settings under which ``fused_policy_loss`` cannot stand in for upstream's ``PolicyLoss``."""
    blockers = []
    low, high = _clip_range(args)
    if not clip_range_supported(low, high):  # upstream clamps the ratio to [1 - low, 1 + high] as given
        blockers.append(f"--actor.eps_clip_low_high {low:g} {high:g} (the fused loss clips with low in [0, 1), "
                        "high >= 0)")  # fmt: skip
    if _arg(args, "actor.policy_loss_type", "ppo") != "ppo":
        blockers.append("--actor.policy_loss_type gspo (sequence-level ratio)")
    if _arg(args, "algo.advantage.is_correction_level", "off") != "off":
        blockers.append("--algo.advantage.is_correction_level (train/rollout importance-sampling correction)")
    if (_arg(args, "ds.ring_attn_size", 1) or 1) > 1:
        blockers.append("--ds.ring_attn_size > 1 (logits sharded across ranks)")
    return blockers


def fused_backend(args: Any) -> Optional[str]:
    """The ``fused_policy_loss`` backend the actor uses, or None for upstream's PolicyLoss.

    ``auto`` becomes None when :func:`fused_loss_blockers` lists anything; an explicit backend with blockers
    is rejected by :func:`check_config` instead.
    """
    choice = lopti_config(args).fused_loss
    if choice == "off" or (choice == "auto" and fused_loss_blockers(args)):
        return None
    return choice


def check_config(args: Any) -> None:
    """Raise ``ValueError`` (naming the flags) for values or combinations that cannot work.

    Called at parse time by ``openrlhf_lopti.cli.train_ppo_ray`` and again by the trainer at start-up.
    """
    cfg = lopti_config(args)
    # algo's own checks, one flag at a time so that the error names it (args built by hand skip argparse's types)
    checks = (
        ("--algo.ar.alpha", lambda: check_alpha(cfg.ar_alpha)),
        ("--algo.lopti.order", lambda: check_lopti_args(0.5, cfg.lopti_order, None)),
        ("--algo.lopti.quantile", lambda: check_lopti_args(0.5, "low_first", cfg.lopti_quantile)),
    )
    for flag, check in checks:
        try:
            check()
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    low, high = _clip_range(args)
    if math.isnan(low) or math.isnan(high):  # upstream's clamp would make every ratio NaN
        if _arg(args, "actor.eps_clip_low_high", None) is None:  # the range came from --actor.eps_clip
            raise ValueError(f"--actor.eps_clip must be a number, got {low:g}")
        raise ValueError(f"--actor.eps_clip_low_high must be two numbers, got {low:g} {high:g}")
    if not (cfg.lopti_eta == 0 or 0 < cfg.lopti_eta <= 1):  # NaN fails both
        raise ValueError(f"--algo.lopti.eta must be 0 (off) or in (0, 1], got {cfg.lopti_eta}")
    cfg.lopti  # noqa: B018 - raises on algo's rule: the two thresholds together are refused
    if cfg.lopti_denominator not in LOPTI_DENOMINATORS:
        raise ValueError(f"--algo.lopti.denominator must be one of {LOPTI_DENOMINATORS}, got {cfg.lopti_denominator!r}")
    if cfg.lopti_denominator != "all" and not cfg.lopti_enabled:  # as --algo.lopti.order: a setting of Lopti's phases
        raise ValueError(f"--algo.lopti.denominator {cfg.lopti_denominator} without Lopti has nothing to divide: "
                         "give --algo.lopti.eta or --algo.lopti.quantile, or drop it")  # fmt: skip
    if cfg.fused_loss not in FUSED_LOSS_CHOICES:
        raise ValueError(f"--actor.fused_loss must be one of {FUSED_LOSS_CHOICES}, got {cfg.fused_loss!r}")

    blockers = fused_loss_blockers(args)
    if cfg.fused_lm_head and (cfg.fused_loss == "off" or blockers):
        reason = "--actor.fused_loss off" if cfg.fused_loss == "off" else "; ".join(blockers)
        raise ValueError(f"--actor.fused_lm_head needs the fused loss, which does not run with {reason}")
    if cfg.fused_loss not in ("auto", "off") and blockers:
        raise ValueError(
            f"--actor.fused_loss {cfg.fused_loss} does not support {'; '.join(blockers)}: "
            "use --actor.fused_loss off (upstream's PolicyLoss) or auto"
        )
    if cfg.lopti_enabled and _arg(args, "actor.policy_loss_type", "ppo") == "gspo":
        threshold = "--algo.lopti.quantile" if cfg.lopti_quantile is not None else "--algo.lopti.eta"
        raise ValueError(
            f"{threshold} with --actor.policy_loss_type gspo: GSPO's ratio is one per sequence, so a "
            "token phase cannot be isolated; use --actor.policy_loss_type ppo"
        )
    # --algo.track_direction's forward-only pass after the update is a plain actor forward over the round's experience
    if cfg.track_direction and (_arg(args, "ds.ring_attn_size", 1) or 1) > 1:
        raise ValueError(
            "--algo.track_direction with --ds.ring_attn_size > 1: its forward-only pass after the update runs "
            "without the ring-attention group; drop --algo.track_direction or use --ds.ring_attn_size 1"
        )
    if cfg.track_direction and (_arg(args, "data.max_images_per_prompt", 0) or 0) > 0:
        raise ValueError(
            "--algo.track_direction with --data.max_images_per_prompt > 0: its forward-only pass after the update "
            "has no image inputs; drop --algo.track_direction for multimodal runs"
        )
    best = _arg(args, "ckpt.best_metric_key", "") or ""
    if _arg(args, "train.async_enable", False) and re.fullmatch(r"eval(_.+)?_score", best):
        raise ValueError(
            f"--ckpt.best_metric_key {best} with --train.async_enable: {best} comes from our evaluator, and the async "
            "trainer is upstream's, which never logs it, so no best checkpoint would be saved; name an upstream "
            "metric (e.g. eval_<datasource>_pass1) or drop --train.async_enable"
        )
    agg_mode = _arg(args, "actor.loss_agg_mode", "token-mean")
    if cfg.lopti_enabled and _arg(args, "algo.advantage.is_correction_level", "off") == "seq" and agg_mode != "token-mean":
        raise ValueError(
            f"Lopti with --algo.advantage.is_correction_level seq and --actor.loss_agg_mode {agg_mode}: the sequence "
            "gate reads the whole response while each phase's per-sequence means count the phase's tokens; use "
            "--actor.loss_agg_mode token-mean"
        )
    if cfg.lopti_enabled and cfg.lopti_denominator == "all" and agg_mode != "token-mean":
        raise ValueError(
            f"--algo.lopti.denominator all with --actor.loss_agg_mode {agg_mode}: the per-sequence means would "
            "count only the phase's tokens; use --actor.loss_agg_mode token-mean or --algo.lopti.denominator phase"
        )
