"""The fused lm_head's per-block steps as Triton kernels: the same math as their torch reference,
``ops/vocab_block.py`` (its docstring has the formulas), one program per row of the ``[R, Vb]`` block (rows strided
over at most ``grid cap`` programs, 64-bit row offsets), the block read in the model's dtype.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from .policy_loss import _launch_config, dlogits_block, online_lse_step


@triton.jit
def _block_stats_kernel(
    z_ptr,
    stride_row,
    labels_ptr,
    col0,
    m_ptr,
    s_ptr,
    t_ptr,
    label_z_ptr,
    n_rows,
    n_cols,
    inv_temperature,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, tl.num_programs(0)):
        row_ptr = z_ptr + tl.cast(row, tl.int64) * stride_row
        m = tl.load(m_ptr + row)
        s = tl.load(s_ptr + row)
        t = tl.load(t_ptr + row)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            z = tl.load(row_ptr + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32) * inv_temperature
            m, s, t = online_lse_step(z, m, s, t, WITH_ENTROPY)
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(t_ptr + row, t)
        local = tl.load(labels_ptr + row).to(tl.int64) - col0
        if (local >= 0) & (local < n_cols):
            tl.store(label_z_ptr + row, tl.load(row_ptr + local).to(tl.float32) * inv_temperature)


@triton.jit
def _block_grad_kernel(
    z_ptr,
    stride_row,
    labels_ptr,
    col0,
    row_max_ptr,
    log_sum_ptr,
    entropy_ptr,
    g_ptr,
    g_entropy_ptr,
    n_rows,
    n_cols,
    inv_temperature,
    WITH_ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, tl.num_programs(0)):
        row_ptr = z_ptr + tl.cast(row, tl.int64) * stride_row
        row_max = tl.load(row_max_ptr + row)
        log_sum = tl.load(log_sum_ptr + row)
        g = tl.load(g_ptr + row)
        local = tl.load(labels_ptr + row).to(tl.int64) - col0
        g_ent = 0.0
        entropy = 0.0
        if WITH_ENTROPY_GRAD:
            g_ent = tl.load(g_entropy_ptr + row)
            entropy = tl.load(entropy_ptr + row)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            valid = cols < n_cols
            z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
            d = dlogits_block(z, cols, local, g, g_ent, row_max, log_sum, entropy, inv_temperature, WITH_ENTROPY_GRAD)
            tl.store(row_ptr + cols, d.to(z_ptr.dtype.element_ty), mask=valid)


def update_block_stats(
    z: torch.Tensor, col0: int, labels: torch.Tensor, stats: torch.Tensor, inv_temperature: float, with_entropy: bool
) -> None:
    """:func:`openrlhf_lopti.ops.vocab_block.update_block_stats` as one kernel launch."""
    n_rows, n_cols = z.shape
    if n_rows == 0:
        return
    config = _launch_config(n_rows, n_cols)
    m, s, t, label_z = stats
    _block_stats_kernel[config["grid"]](
        z, z.stride(0), labels, col0, m, s, t, label_z, n_rows, n_cols, inv_temperature,
        WITH_ENTROPY=with_entropy, BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"],
    )  # fmt: skip


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
    """:func:`openrlhf_lopti.ops.vocab_block.block_grad_` as one kernel launch (``z`` overwritten and returned)."""
    n_rows, n_cols = z.shape
    if n_rows == 0:
        return z
    config = _launch_config(n_rows, n_cols)
    _block_grad_kernel[config["grid"]](
        z, z.stride(0), labels, col0, row_max, log_sum, entropy, g_logp,
        g_entropy if g_entropy is not None else g_logp, n_rows, n_cols, inv_temperature,
        WITH_ENTROPY_GRAD=g_entropy is not None, BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"],
    )  # fmt: skip
    return z
