"""The fused lm_head's two per-block steps, on one ``[R, Vb]`` block of logits (rows of the kept tokens, a range of
vocabulary columns starting at ``col0``), in torch: the reference of ``ops/triton/vocab_block.py`` and the CPU path.

- :func:`update_block_stats`: the online log-sum-exp carried from block to block. Per row, ``stats`` holds ``m``
  (running max of ``z / T``), ``s = sum exp(z/T - m)``, ``t = sum exp(z/T - m) * (z/T - m)`` (the entropy is
  ``log s - t / s``) and the label's ``z / T`` once its block has passed. The formulas are the Triton policy-loss
  kernel's (``ops/triton/policy_loss.py``), so -inf logits stay exact (probability 0, no entropy term).
- :func:`block_grad_`: the gradient w.r.t. the block's logits, written over them,
  ``d_j = (g * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)) / T`` with ``p_j = exp(z_j / T - lse)``, from the
  per-row log-sum-exp and entropy ``H`` the forward saved and the upstream gradients ``g`` (of logp) and ``g_ent``.

Each works on a few rows at a time, so its fp32 temporaries stay small whatever the block.
"""

from typing import Optional

import torch

STAT_ROWS = 4  # m, s, t, the label's z / T
_ROWS_AT_ONCE = 64  # rows per fp32 temporary of the torch path


def new_stats(rows: int, device: torch.device) -> torch.Tensor:
    """``[4, rows]`` fp32 stats before the first block: ``m = -inf``, ``s = t = 0``, label logit NaN (a label that no
    block holds, an id outside the vocabulary, stays NaN; its row is flagged anyway)."""
    stats = torch.zeros(STAT_ROWS, rows, dtype=torch.float32, device=device)
    stats[0] = float("-inf")
    stats[3] = float("nan")
    return stats


def update_block_stats(
    z: torch.Tensor, col0: int, labels: torch.Tensor, stats: torch.Tensor, inv_temperature: float, with_entropy: bool
) -> None:
    """Fold the block ``z [R, Vb]`` (model dtype, columns ``col0 ..``) into ``stats [4, R]`` in place.

    Args:
        z: the block's logits. labels: ``[R]`` int token ids (global column numbers).
        stats: ``[4, R]`` fp32 from :func:`new_stats` or earlier blocks.
        inv_temperature: ``1 / T``. with_entropy: keep ``t`` up to date (the entropy, or its gradient, is wanted).
    """
    for r0 in range(0, z.shape[0], _ROWS_AT_ONCE):
        rows = slice(r0, r0 + _ROWS_AT_ONCE)
        zf = z[rows].float() * inv_temperature
        m, s, t, label_z = stats[:, rows]
        m_new = torch.maximum(m, zf.amax(-1)) if zf.shape[1] else m
        m_ref = torch.where(m_new == float("-inf"), 0.0, m_new)  # no exp(-inf - -inf) = NaN
        scale = torch.exp(m - m_ref)
        e = torch.exp(zf - m_ref.unsqueeze(-1))
        if with_entropy:
            shift = torch.where(s > 0, m - m_ref, 0.0) * s
            t.copy_(scale * (t + shift) + (e * torch.where(e > 0, zf - m_ref.unsqueeze(-1), 0.0)).sum(-1))
        s.copy_(s * scale + e.sum(-1))
        m.copy_(m_new)
        local = labels[rows].long() - col0
        inside = (local >= 0) & (local < zf.shape[1])
        picked = zf.gather(1, local.clamp(0, max(zf.shape[1] - 1, 0)).unsqueeze(-1)).squeeze(-1)
        label_z.copy_(torch.where(inside, picked, label_z))


def block_grad_(
    z: torch.Tensor,
    col0: int,
    labels: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    entropy: torch.Tensor,
    g_logp: torch.Tensor,
    g_entropy: Optional[torch.Tensor],
    inv_temperature: float,
) -> torch.Tensor:
    """Overwrite the block ``z [R, Vb]`` with the gradient of ``sum(g_logp * logp + g_entropy * entropy)`` w.r.t. it
    (in its dtype) and return it. ``row_max`` and ``log_sum`` (``lse = row_max + log_sum``, kept apart so that
    ``z / T - lse`` loses no digits when logits are large), ``entropy``, ``g_logp``, ``g_entropy`` (or None): fp32
    ``[R]``."""
    for r0 in range(0, z.shape[0], _ROWS_AT_ONCE):
        rows = slice(r0, r0 + _ROWS_AT_ONCE)
        log_p = (z[rows].float() * inv_temperature - row_max[rows].unsqueeze(-1)) - log_sum[rows].unsqueeze(-1)
        p = torch.exp(log_p)
        g = g_logp[rows].unsqueeze(-1)
        d = -g * p
        local = labels[rows].long() - col0
        inside = (local >= 0) & (local < z.shape[1])
        d.scatter_add_(1, local.clamp(0, max(z.shape[1] - 1, 0)).unsqueeze(-1), torch.where(inside, g[:, 0], 0.0)[:, None])
        if g_entropy is not None:
            # p = 0 (a -inf logit) contributes 0, not 0 * (log p = -inf)
            d -= g_entropy[rows].unsqueeze(-1) * p * torch.where(p > 0, log_p + entropy[rows].unsqueeze(-1), 0.0)
        z[rows] = (d * inv_temperature).to(z.dtype)
    return z
