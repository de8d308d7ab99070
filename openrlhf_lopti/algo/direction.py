"""Update direction per probability bin (paper Fig. 3): did an update move each token the way its advantage asks?

After a policy update, a positive-advantage token should become more probable and a negative-advantage
token less probable. The paper (Sec. 4, Fig. 3) bins tokens by their sampling probability and finds the
share of positive tokens that went up falling with p, below 50% for p >= 0.75 under GRPO.

Bins are fixed probability ranges of the rollout policy, ``p = exp(old_log_prob)``:
Q1 = [0, .25), Q2 = [.25, .5), Q3 = [.5, .75), Q4 = [.75, 1] (Q4 also takes p slightly above 1 from
rounding). "Rose" means ``new > old`` strictly, "fell" ``new < old``: an unchanged log-prob counts as neither.

Two steps, so that data-parallel ranks can sum before dividing:

- :func:`direction_counts` (or :func:`sum_direction_counts` over micro-batches) returns a ``[5, 4]``
  float64 tensor of token counts: rows :data:`COUNT_ROWS`, columns Q1..Q4. Counts add up across
  micro-batches and ranks (e.g. ``all_reduce(counts, op=SUM)``), shares do not;
- :func:`direction_metrics` turns (summed) counts into the logged metrics.

Both log-probs must be computed the same way (same temperature, dtype and code path), or rounding
differences show up as moves: a one-step change of a p ~ 1 token's log-prob can be as small as 1e-7.
"""

from typing import Iterable, Optional, Sequence

import torch

DIRECTION_EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)
# Rows of the counts tensor: all masked tokens, positive-advantage tokens and those whose log-prob rose,
# negative-advantage tokens and those whose log-prob fell. Advantage-0 tokens count only in "tokens".
COUNT_ROWS = ("tokens", "pos", "pos_up", "neg", "neg_down")
NUM_BINS = len(DIRECTION_EDGES) - 1


def direction_bins(old_log_probs: torch.Tensor) -> torch.Tensor:
    """Bin index 0..3 (Q1..Q4) of each token by ``p = exp(old_log_probs)``; same shape, int64."""
    p = old_log_probs.detach().double().exp()
    inner = torch.tensor(DIRECTION_EDGES[1:-1], dtype=torch.float64, device=p.device)
    return torch.bucketize(p, inner, right=True)  # right=True: p == .25 goes to Q2, p == .75 to Q4


def direction_counts(
    old_log_probs: torch.Tensor,
    new_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Token counts per probability bin for one batch (or micro-batch) of an update.

    Args:
        old_log_probs: ``[N]`` (any shape) log-probs of the sampled tokens under the rollout policy, nats;
            they pick the bin.
        new_log_probs: same shape, the same tokens' log-probs after the update, nats.
        advantages: same shape, the advantages the update used (before AR; only the sign matters).
        mask: same shape, bool or 0/1, the response tokens to count; None counts every entry.

    Returns:
        ``[5, 4]`` float64 tensor on ``old_log_probs``' device: rows :data:`COUNT_ROWS`, columns Q1..Q4.

    Raises:
        ValueError: shapes that differ, or a non-finite value on a counted token.
    """
    named = {"new_log_probs": new_log_probs, "advantages": advantages}
    if mask is not None:
        named["mask"] = mask
    for name, t in named.items():
        if t.shape != old_log_probs.shape:
            raise ValueError(
                f"{name} must have old_log_probs' shape {tuple(old_log_probs.shape)}, got {tuple(t.shape)}"
            )
    keep = torch.ones_like(old_log_probs, dtype=torch.bool) if mask is None else mask.to(old_log_probs.device).bool()
    old = old_log_probs.detach().double()[keep]
    new = new_log_probs.detach().to(old.device).double()[keep]
    adv = advantages.detach().to(old.device).double()[keep]
    for name, t in (("old_log_probs", old), ("new_log_probs", new), ("advantages", adv)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} has non-finite values on counted (masked-in) tokens")
    bins = direction_bins(old)
    rise, fall = new > old, new < old
    everyone = torch.ones_like(old, dtype=torch.bool)
    selections = (everyone, adv > 0, (adv > 0) & rise, adv < 0, (adv < 0) & fall)
    counts = torch.stack([torch.bincount(bins[sel], minlength=NUM_BINS) for sel in selections])
    return counts.double()


def sum_direction_counts(micro_batches: Iterable[Sequence[torch.Tensor]], device=None) -> torch.Tensor:
    """Sum of :func:`direction_counts` over ``(old_log_probs, new_log_probs, advantages, mask)`` tuples.

    An empty iterable gives zeros (on ``device``, default CPU), so a rank with no data can still join an
    all-reduce of the counts.
    """
    total = None
    for batch in micro_batches:
        counts = direction_counts(*batch)
        total = counts if total is None else total + counts.to(total.device)
    if total is None:
        return torch.zeros(len(COUNT_ROWS), NUM_BINS, dtype=torch.float64, device=device)
    return total if device is None else total.to(device)


def direction_metrics(counts: torch.Tensor) -> dict:
    """The logged metrics of (summed) counts, bins Q1..Q4 as suffixes ``_q1``..``_q4``:

    - ``direction/pos_up_qk``: share of the bin's positive-advantage tokens whose log-prob rose;
    - ``direction/neg_down_qk``: share of the bin's negative-advantage tokens whose log-prob fell;
    - ``direction/tokens_qk``, ``direction/pos_tokens_qk``, ``direction/neg_tokens_qk``: the counts
      (all tokens; the denominators of the two shares).

    An empty bin has no share: ``pos_up_qk`` is left out when the bin has no positive-advantage token
    (``neg_down_qk`` likewise), rather than NaN (breaks JSON and averages) or 0 (reads as "all went the
    wrong way"). The counts are always there, so the key set tells which shares exist.

    Args:
        counts: ``[5, 4]`` from :func:`direction_counts`, possibly summed over micro-batches and ranks.
    """
    if tuple(counts.shape) != (len(COUNT_ROWS), NUM_BINS):
        raise ValueError(f"counts must have shape {(len(COUNT_ROWS), NUM_BINS)}, got {tuple(counts.shape)}")
    c = {name: [float(v) for v in row] for name, row in zip(COUNT_ROWS, counts.detach().double().cpu())}
    metrics = {}
    for k in range(NUM_BINS):
        q = f"q{k + 1}"
        metrics[f"direction/tokens_{q}"] = c["tokens"][k]
        metrics[f"direction/pos_tokens_{q}"] = c["pos"][k]
        metrics[f"direction/neg_tokens_{q}"] = c["neg"][k]
        if c["pos"][k] > 0:
            metrics[f"direction/pos_up_{q}"] = c["pos_up"][k] / c["pos"][k]
        if c["neg"][k] > 0:
            metrics[f"direction/neg_down_{q}"] = c["neg_down"][k] / c["neg"][k]
    return metrics
