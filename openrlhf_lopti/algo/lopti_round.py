"""The Lopti round, written once: the threshold, each token's phase, the order, the round's metrics.

Every front end (the local trainer, OpenRLHF's actor, TRL's trainer, verl's worker) calls :func:`plan_round` once
per RL step on the step's whole batch and then only drives the phases it returns: how a pass over a phase runs,
its accumulation windows and its collectives are the framework's; what the phases are is decided here.

The rules (PAPER_NOTES.md section 4 and the authors' code), the same in every front end:

- Lopti is on when ``eta`` or ``quantile`` is given (:func:`lopti_settings`): a quantile alone turns it on. Both
  given is refused (:func:`lopti_settings`): they are two thresholds, and neither may silently win.
- A response token is "low" when its rollout probability ``p = exp(old_log_prob)`` is below the threshold
  (``p < threshold``), "high" otherwise. The threshold is ``eta``, or the ``quantile`` of ``p`` over every response
  token of the batch on EVERY process (``gather``), floored at the smallest normal fp32 and capped at 1: a quantile
  of probabilities that underflow to 0 would otherwise put no token in the low phase, not even those of ``p = 0``.
- Each token's phase is decided here, once per round; a driver never re-derives it (another device may round
  ``exp`` differently and put a token at the threshold in both phases or in neither).
- The phases come in update order (``low_first``: low then high, the paper's; ``high_first``: the ablation), each
  with its token count over every process, so that every process skips an empty phase together.
- NaN log-probs on response tokens fail the round on every process at once (after the one all-reduce), never on
  one process alone: a process raising before a collective would leave the others waiting.

Metrics (the same names in every front end, reduced over processes): ``ar/mean_weight`` (with AR),
``lopti/threshold``, ``lopti/low_token_frac`` and ``lopti/<phase>/tokens`` (with Lopti).
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from .advantage import OLD_LOG_PROB_MAX, ar_weight
from .option_checks import check_alpha
from .lopti import check_lopti_args, quantile_threshold

PHASE_NAMES = {"low_first": ("low", "high"), "high_first": ("high", "low")}
THRESHOLD_FLOOR = torch.finfo(torch.float32).tiny  # a quantile threshold is at least this (see the module doc)

Gather = Callable[[torch.Tensor], torch.Tensor]  # [n] this process's values -> [n_all] every process's, concatenated
AllReduce = Callable[[Dict[str, float]], Dict[str, float]]  # per-key sum over every process


@dataclass(frozen=True)
class LoptiSettings:
    """Lopti's settings, checked once: ``eta`` in (0, 1], ``order`` in :data:`PHASE_NAMES`, ``quantile`` in (0, 1)
    or None (then ``eta`` is the threshold)."""

    eta: float = 0.5
    order: str = "low_first"
    quantile: Optional[float] = None

    def __post_init__(self) -> None:
        check_lopti_args(self.eta, self.order, self.quantile)

    @property
    def phase_names(self) -> tuple:
        """``("low", "high")`` or ``("high", "low")``: the phases in update order."""
        return PHASE_NAMES[self.order]


def lopti_on(on: bool, quantile: Optional[float]) -> bool:
    """The one rule for when Lopti runs: ``on`` (a front end's own switch: ``--lopti``, ``--algo.lopti.eta > 0``,
    ``lopti_eta`` set) or a ``quantile`` given alone."""
    return bool(on) or quantile is not None


def lopti_settings(
    on: bool,
    eta: Optional[float] = None,
    order: str = "low_first",
    quantile: Optional[float] = None,
    keys: tuple = ("eta", "quantile", "order"),
) -> Optional[LoptiSettings]:
    """:class:`LoptiSettings` when :func:`lopti_on`, else None. ``eta`` None or 0 ("unset", as a front end's off
    value) means the paper's 0.5; with a quantile it is only the threshold of a round without response tokens.

    Raises:
        ValueError: ``eta`` and ``quantile`` both given, or ``order`` ``"high_first"`` with Lopti off (the paper's
            ablation asked for, plain GRPO run), in one line naming ``keys`` (the front end's names of the three);
            or a value outside its range.
    """
    if eta and quantile is not None:  # eta None / 0 is "not given"
        raise ValueError(
            f"{keys[0]}={eta} and {keys[1]}={quantile} are two Lopti thresholds: give one "
            f"({keys[1]} alone turns Lopti on)"
        )
    if not lopti_on(on, quantile):
        if order != "low_first":  # every front end's default is low_first: this order was asked for
            raise ValueError(f"{keys[2]}={order} orders Lopti's phases, but Lopti is off, so it would order nothing: "
                             "turn Lopti on, or leave the order low_first")  # fmt: skip
        return None
    return LoptiSettings(eta=eta or 0.5, order=order, quantile=quantile)


@dataclass
class Phase:
    """One update phase of a round. ``mask``: bool, the shape of the round's ``old_log_probs``, the response tokens
    this phase trains (a subset of the response mask); ``tokens``: their count over every process."""

    name: str
    mask: torch.Tensor
    tokens: int


@dataclass
class LoptiRound:
    """What :func:`plan_round` decided. Without Lopti, one phase named ``"all"`` (the response mask) and no
    threshold. ``metrics`` are the round's, reduced over every process."""

    phases: List[Phase]
    threshold: Optional[float]
    metrics: Dict[str, float]

    @property
    def low(self) -> Optional[torch.Tensor]:
        """The low tokens' mask (bool, the shape of ``old_log_probs``), or None without Lopti."""
        return next((phase.mask for phase in self.phases if phase.name == "low"), None)


def round_threshold(probs: torch.Tensor, lopti: LoptiSettings, gather: Optional[Gather] = None) -> float:
    """The round's threshold: ``eta``, or the ``quantile`` of ``probs`` (``[n]``, this process's response tokens'
    rollout probabilities) over every process (``gather``), floored at :data:`THRESHOLD_FLOOR`.

    With a quantile every process must call it (it gathers); ``eta`` when no process has a token."""
    if lopti.quantile is None:
        return float(lopti.eta)
    values = probs.detach().float().flatten().cpu()
    if gather is not None:
        values = gather(values).float().flatten().cpu()
    if values.numel() == 0:
        return float(lopti.eta)
    return min(max(quantile_threshold(values, lopti.quantile), THRESHOLD_FLOOR), 1.0)


def plan_round(
    old_log_probs: torch.Tensor,
    response_mask: Optional[torch.Tensor],
    lopti: Optional[LoptiSettings],
    ar_alpha: float = 0.0,
    gather: Optional[Gather] = None,
    all_reduce: Optional[AllReduce] = None,
) -> LoptiRound:
    """Decide one round: the threshold, each response token's phase, the phases' order, the round's metrics.

    Args:
        old_log_probs: ``[B, T]`` (any shape; a driver may pass its items flattened and concatenated) log-probs of
            the sampled tokens under the rollout policy, nats. Never changes during the round. Also a jagged
            nested tensor ``[B, j]`` (one row per response, its own length: verl's default trainer keeps
            per-response fields so); the phases' masks then come back nested with the same offsets.
        response_mask: same shape (nested with the same offsets), bool or 0/1: the response tokens (None: every
            token).
        lopti: the settings, or None for no Lopti (one phase, the response mask).
        ar_alpha: AR's alpha, for ``ar/mean_weight`` (logged when > 0).
        gather: concatenates a 1-D tensor over every process (the quantile's scope); None: this process only.
        all_reduce: sums a dict of floats over every process (the metrics and phase counts); None: one process.
            Every process must call :func:`plan_round` with the same settings: the collectives it makes are
            the same whatever the data (one gather with a quantile, one all-reduce).

    Returns:
        The :class:`LoptiRound`: phases in update order (empty ones included, ``tokens == 0``), the threshold and
        the metrics.

    Raises:
        ValueError: mismatched shapes (before any collective), or NaN or positive (above
            :data:`~.advantage.OLD_LOG_PROB_MAX`) log-probs on a response token of any process (on every process,
            after the all-reduce).
    """
    if lopti is not None and not isinstance(lopti, LoptiSettings):
        raise ValueError(f"lopti must be a LoptiSettings or None, got {lopti!r} ({type(lopti).__name__})")
    ar_alpha = check_alpha(ar_alpha)
    offsets = None
    if old_log_probs.is_nested or (response_mask is not None and response_mask.is_nested):
        offsets = _jagged_offsets(old_log_probs, response_mask)
        # every token's phase is decided on the rows' real tokens, concatenated (a layout of the same tokens)
        old_log_probs = old_log_probs.values()
        response_mask = None if response_mask is None else response_mask.values()
    if response_mask is None:
        response = torch.ones_like(old_log_probs, dtype=torch.bool)
    elif response_mask.shape != old_log_probs.shape:
        raise ValueError(
            f"response_mask must have the shape of old_log_probs {tuple(old_log_probs.shape)}, "
            f"got {tuple(response_mask.shape)}"
        )
    else:
        response = response_mask.bool()
    old = old_log_probs.detach()
    probs = old.to(torch.promote_types(old.dtype, torch.float32)).exp()
    # Every sum selects the response tokens (``&``, ``where``), never multiplies by the mask: a masked position may
    # hold anything (NaN or inf padding), and NaN * 0 is NaN.
    sums = {"tokens": float(response.sum()), "nan_tokens": float((torch.isnan(probs) & response).sum()),
            "above_0_tokens": float((response & (old > OLD_LOG_PROB_MAX)).sum())}  # fmt: skip
    if ar_alpha > 0:
        sums["ar_weight"] = float(torch.where(response, ar_weight(old, ar_alpha), 0.0).sum())
    threshold, low = None, None
    if lopti is not None:
        threshold = round_threshold(probs[response & ~torch.isnan(probs)], lopti, gather)
        # A quantile is taken over fp32 probabilities (what the processes gather): they are compared in fp32 too, so
        # that the token at the quantile ties with it (high) whatever the log-probs' dtype.
        low = response & ((probs if lopti.quantile is None else probs.float()) < threshold)
        sums["low_tokens"] = float(low.sum())
    if all_reduce is not None:
        sums = {key: float(value) for key, value in all_reduce(sums).items()}
    if sums["nan_tokens"] > 0:  # every process sees the reduced count and raises together
        raise ValueError(f"old_log_probs contains NaN on {int(sums['nan_tokens'])} response token(s)")
    if sums["above_0_tokens"] > 0:  # a probability above 1: AR's weight and Lopti's p would be wrong, or inf
        raise ValueError(f"old_log_probs must be log-probabilities (<= 0, up to {OLD_LOG_PROB_MAX:g} of rounding): "
                         f"{int(sums['above_0_tokens'])} response token(s) hold more")  # fmt: skip

    tokens = sums["tokens"]
    metrics = {}
    if ar_alpha > 0:
        metrics["ar/mean_weight"] = sums["ar_weight"] / max(tokens, 1.0)

    def layout(mask: torch.Tensor) -> torch.Tensor:  # back in the caller's layout
        return mask if offsets is None else torch.nested.nested_tensor_from_jagged(mask, offsets)

    if lopti is None:
        return LoptiRound([Phase("all", layout(response), int(tokens))], None, metrics)
    masks = {"low": layout(low), "high": layout(response & ~low)}
    counts = {"low": int(sums["low_tokens"]), "high": int(tokens - sums["low_tokens"])}
    metrics["lopti/threshold"] = threshold
    metrics["lopti/low_token_frac"] = counts["low"] / max(tokens, 1.0)
    metrics.update({f"lopti/{name}/tokens": float(counts[name]) for name in lopti.phase_names})
    phases = [Phase(name, masks[name], counts[name]) for name in lopti.phase_names]
    return LoptiRound(phases, threshold, metrics)


def _jagged_offsets(old_log_probs: torch.Tensor, response_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The row offsets ``[B + 1]`` shared by nested ``old_log_probs`` and ``response_mask`` (checked before any
    collective)."""
    tensors = [("old_log_probs", old_log_probs)] + ([] if response_mask is None else [("response_mask", response_mask)])
    for name, tensor in tensors:
        if not tensor.is_nested or tensor.layout != torch.jagged or tensor.dim() != 2:
            kind = f"nested ({tensor.layout})" if tensor.is_nested else "padded"
            raise ValueError(
                f"{name}: a nested round needs old_log_probs and response_mask both as jagged nested tensors [B, j] "
                f"(torch.nested, layout=torch.jagged), got a {kind} tensor of {tensor.dim()} dims"
            )
        if tensor.lengths() is not None:  # its values() hold the gaps between rows too: they would count as tokens
            raise ValueError(
                f"{name}: a nested round needs contiguous jagged rows (values() holding exactly the rows' tokens), "
                "got a non-contiguous jagged tensor (with lengths(), e.g. from narrow()): pass it .contiguous()"
            )
    offsets = old_log_probs.offsets()
    if response_mask is not None and not torch.equal(response_mask.offsets().to(offsets.device), offsets):
        raise ValueError("response_mask must have the rows of old_log_probs: their nested offsets differ")
    return offsets


def lopti_phases(
    old_log_probs: torch.Tensor,
    response_mask: Optional[torch.Tensor],
    eta: float = 0.5,
    order: str = "low_first",
    quantile: Optional[float] = None,
) -> List[torch.Tensor]:
    """The two phase masks of a one-process round, in update order: ``[low, high]`` or ``[high, low]``.

    :func:`plan_round` with :class:`LoptiSettings` ``(eta, order, quantile)`` and no collectives, for callers that
    need only the masks. Each mask is a bool tensor of ``old_log_probs``' shape (``[B, T]``), a subset of
    ``response_mask``; they are disjoint and cover it; an empty phase is returned all False.

    Raises:
        ValueError: eta outside (0, 1], unknown order, quantile outside (0, 1), mismatched shapes, NaN
            log-probs on masked tokens, or log-probs above 0 there (by more than the 1e-3 of rounding,
            :data:`~.advantage.OLD_LOG_PROB_MAX`: not log-probabilities).
    """
    return [phase.mask for phase in plan_round(old_log_probs, response_mask, LoptiSettings(eta, order, quantile)).phases]


def phase_gradient(values: torch.Tensor, phase_mask: torch.Tensor) -> torch.Tensor:
    """``values`` whose gradient flows only at the phase's tokens: what a phase trains when a loss term of one token
    reads other tokens' values (a sequence-level importance ratio, TRL's loss options; docs/LOPTI_ROUND.md).

    The other tokens keep their values (a sequence ratio stays the whole sequence's) but are constants of the
    phase, so the two phases' gradients at the same weights add up to one plain pass's gradient. For a loss whose
    token terms read only their own token it is the phase's masking, as far as gradients go.

    Args:
        values: ``[B, T]`` per-token values of the current policy (log-probs, entropies), with gradient.
        phase_mask: ``[B, T]`` bool, the phase's tokens (:attr:`Phase.mask`).

    Returns:
        ``[B, T]``: ``values``, with gradient where ``phase_mask`` is True only.
    """
    return torch.where(phase_mask.to(values.device), values, values.detach())
