"""The fused Triton policy-loss head: logits -> log-prob -> AR weight -> clipped surrogate -> KL, fwd and bwd.

Forward, one program per row (rows strided over at most ``grid cap`` programs, so any ``N`` works):
an online log-sum-exp over the vocab in ``BLOCK_V`` chunks read in the logits' own dtype, then the
per-token math of :mod:`openrlhf_lopti.algo.policy_loss` in registers. It saves per row only the
log-sum-exp (as its two parts ``max`` and ``log(sum exp(z - max))``, so ``z - lse`` loses no digits when
logits are large), ``dloss/dlogp`` and the entropy, fp32 ``[N]`` each; nothing ``[N, V]`` besides the
caller's logits.

Backward (two passes) recomputes ``p = exp(z / T - lse)`` block by block and writes, per kept row,

    dlogits_j = (g * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)) / T,
    g         = g_logp + g_loss * dloss/dlogp

in the logits' dtype; masked rows are never read and get zeros. With per-token weights given up front (the one-pass
head) the forward itself writes that gradient, ``g = loss_weight * dloss/dlogp`` and ``g_ent = entropy_weight``,
sweeping each row a second time right after its log-sum-exp (last block first: the likeliest still in cache; a
persistent grid keeps the rows in flight within L2), and the backward only scales it by the upstream scalar.

Every output is written by the kernels (buffers come from ``torch.empty``; nothing is zero-filled by other
launches), and the value checks are made in the forward as per-row status bits (``ops/value_status.py``): a label
outside ``[0, V)`` (never read), a non-finite old / ref log-prob or advantage or an old log-prob above 0 (the
``[N]`` vectors are read in their own dtype and rounded to fp32 in the kernel), a row without a finite log-sum-exp
(a NaN or +inf logit, only -inf, or an overflow at T). A flagged row's loss, log-prob and gradient are NaN, and
its bits are OR-ed into one int32 word with an atomic (only flagged rows touch it), read when the check policy
says. -inf logits are exact (probability 0, no entropy term, zero gradient), as the reference defines them.

Gradient of the surrogate w.r.t. ``logp`` (matches torch's autograd of the reference):
``-A' * ratio`` when the log ratio is inside the +-20 clamp, the unclipped branch is active
(``ratio`` in ``[1 - eps_low, 1 + eps_high]`` or ``surr1 < surr2``) and the dual clip does not bind;
0 otherwise. Ties (``ratio == dual_clip`` exactly) have measure zero for real inputs and are not split.
"""

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...algo.policy_loss import KL_CLAMP, LOG_RATIO_CLAMP
from .. import value_status
from ..first_order import first_order
from ..loss_head_output import LossHeadOutput
from ..value_status import ValueStatus

# Kernels defined under TRITON_INTERPRET=1 run on CPU tensors (numpy emulation); the flag is read when
# @triton.jit runs, i.e. at this module's import.
INTERPRETED = bool(triton.knobs.runtime.interpret)

# Rows go on grid dim 0 and at most 65535 programs stride over them, so any N launches: grid dims 1/2 are
# capped at 64K (tokens placed there overflow, https://github.com/SHI-Labs/NATTEN/pull/305), and row
# offsets are int64 (row * V passes 2^31 at N=16384, V=151936; https://github.com/linkedin/Liger-Kernel/issues/803).
DEFAULT_GRID_CAP = 65535
DEFAULT_BLOCK_V = 4096  # untuned: no GPU has run this yet (benchmarks/RESULTS.md)
KL_MODES = {"k1": 1, "k2": 2, "k3": 3}
# The status bits (ops/value_status.py), as the constants a kernel can read.
BAD_LABEL = tl.constexpr(value_status.BAD_LABEL)
BAD_OLD = tl.constexpr(value_status.BAD_OLD)
BAD_ADVANTAGE = tl.constexpr(value_status.BAD_ADVANTAGE)
BAD_REF = tl.constexpr(value_status.BAD_REF)
BAD_LOGITS = tl.constexpr(value_status.BAD_LOGITS)
OLD_LOG_PROB_MAX = tl.constexpr(value_status.OLD_LOG_PROB_MAX)
# The one-pass head runs a persistent grid, this many programs per SM (its rows then fit in L2, so the second
# sweep over a row reads cache, not HBM): untuned, no GPU has run it yet (benchmarks/gpu_session.sh sweeps it).
DEFAULT_PROGRAMS_PER_SM = 2

# Private knobs for tests and tuning: small blocks make V=257 span several blocks in interpreter mode.
ENV_BLOCK_V = "OPENRLHF_LOPTI_TRITON_BLOCK_V"
ENV_GRID_CAP = "OPENRLHF_LOPTI_TRITON_GRID_CAP"
ENV_NUM_WARPS = "OPENRLHF_LOPTI_TRITON_NUM_WARPS"
ENV_PROGRAMS_PER_SM = "OPENRLHF_LOPTI_TRITON_PROGRAMS_PER_SM"


@triton.jit
def online_lse_step(z, m, s, t, WITH_ENTROPY: tl.constexpr):
    """Fold one block of ``z / T`` (``[BLOCK_V]`` fp32, -inf on padding lanes) into a row's running max ``m``,
    ``s = sum exp(z - m)`` and ``t = sum exp(z - m) * (z - m)`` (the entropy is ``log s - t / s``, shifted so large
    logits lose no precision); returns the new ``(m, s, t)``. Written so that no NaN appears on legal input: ``m`` is
    -inf (and ``s`` 0) before the first finite entry, so the shift is by 0 while every entry so far is -inf, and
    ``e * (z - m_ref)`` is 0, not ``0 * -inf``, where ``z`` is -inf. A NaN or +inf makes ``s`` NaN (or ``m`` +inf)."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
    scale = tl.exp(m - m_ref)
    e = tl.exp(z - m_ref)
    if WITH_ENTROPY:
        shift = tl.where(s > 0.0, m - m_ref, 0.0) * s
        t = scale * (t + shift) + tl.sum(e * tl.where(e > 0.0, z - m_ref, 0.0), axis=0)
    s = s * scale + tl.sum(e, axis=0)
    return m_new, s, t


@triton.jit
def dlogits_block(z, cols, label, g, g_ent, row_max, log_sum, entropy, inv_temperature,
                  WITH_ENTROPY_GRAD: tl.constexpr):  # fmt: skip
    """The gradient w.r.t. one block of a row's logits (fp32), ``z`` being that block's ``z / T``:
    ``(g * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)) / T`` with ``p = exp(z - row_max - log_sum)``. A -inf logit
    has ``p = 0`` and contributes 0, not ``0 * (log p = -inf)``."""
    log_p = (z - row_max) - log_sum
    p = tl.exp(log_p)
    d = tl.where(cols == label, g, 0.0) - g * p
    if WITH_ENTROPY_GRAD:
        d = d - g_ent * p * tl.where(p > 0.0, log_p + entropy, 0.0)
    return d * inv_temperature


@triton.jit
def _policy_loss_fwd_kernel(
    logits_ptr,
    stride_row,
    labels_ptr,
    old_ptr,
    adv_ptr,
    keep_ptr,
    ref_ptr,
    loss_weight_ptr,
    entropy_weight_ptr,
    grad_ptr,
    grad_stride_row,
    loss_ptr,
    logp_ptr,
    kl_ptr,
    clipped_ptr,
    entropy_ptr,
    row_max_ptr,
    log_sum_ptr,
    dloss_dlogp_ptr,
    status_ptr,
    word_ptr,
    n_rows,
    n_cols,
    inv_temperature,  # 1 / T: a multiply per element instead of a (slow, exact) fp32 division
    alpha,
    ratio_low,
    ratio_high,
    dual_clip,
    kl_coef,
    LOG_RATIO_MAX: tl.constexpr,
    KL_MAX: tl.constexpr,
    KL_MODE: tl.constexpr,  # 0: no ref_log_probs, 1/2/3: k1/k2/k3
    HAS_DUAL_CLIP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    GRAD_IN_FORWARD: tl.constexpr,  # the one-pass head: write dlogits now, from per-row weights given up front
    WITH_ENTROPY_WEIGHT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offsets = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        grad_row = grad_ptr + tl.cast(row, tl.int64) * grad_stride_row
        if tl.load(keep_ptr + row) != 0:
            row_ptr = logits_ptr + tl.cast(row, tl.int64) * stride_row
            # Online log-sum-exp with a running scalar max m; s = sum exp(z - m), t = sum exp(z - m) * (z - m)
            # (the entropy is log(s) - t / s, shifted so large logits lose no precision).
            m = -float("inf")
            s = 0.0
            t = 0.0
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offsets
                z = tl.load(row_ptr + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32) * inv_temperature
                m, s, t = online_lse_step(z, m, s, t, WITH_ENTROPY or WITH_ENTROPY_WEIGHT)
            log_s = tl.log(s)
            entropy = log_s - t / s

            # The value checks, as status bits (ops/value_status.py): nothing is read on the host here.
            label = tl.load(labels_ptr + row).to(tl.int64)
            bad_label = (label < 0) | (label >= n_cols)
            label = tl.where(bad_label, 0, label)  # never read outside the row
            old = tl.load(old_ptr + row).to(tl.float32)
            adv = tl.load(adv_ptr + row).to(tl.float32)
            # NaN / +inf anywhere make s NaN (or m +inf); all -inf leaves m + log_s = -inf.
            status = bad_label.to(tl.int32) * BAD_LABEL
            status = status | tl.where((tl.abs(old) < float("inf")) & (old <= OLD_LOG_PROB_MAX), 0, BAD_OLD)
            status = status | tl.where(tl.abs(adv) < float("inf"), 0, BAD_ADVANTAGE)
            status = status | tl.where(tl.abs(m + log_s) < float("inf"), 0, BAD_LOGITS)

            logp = (tl.load(row_ptr + label).to(tl.float32) * inv_temperature - m) - log_s
            weighted_adv = adv * (alpha * tl.exp(old) + (1.0 - alpha))

            raw_log_ratio = logp - old
            ratio = tl.exp(tl.minimum(tl.maximum(raw_log_ratio, -LOG_RATIO_MAX), LOG_RATIO_MAX))
            surr1 = ratio * weighted_adv
            surr2 = tl.minimum(tl.maximum(ratio, ratio_low), ratio_high) * weighted_adv
            surrogate = tl.minimum(surr1, surr2)
            pg_active = (surr1 < surr2) | ((ratio >= ratio_low) & (ratio <= ratio_high))
            pg_active = pg_active & (raw_log_ratio >= -LOG_RATIO_MAX) & (raw_log_ratio <= LOG_RATIO_MAX)
            if HAS_DUAL_CLIP:
                floor = dual_clip * weighted_adv
                dual_binds = (weighted_adv < 0.0) & (floor > surrogate)
                surrogate = tl.where(dual_binds, floor, surrogate)
                pg_active = pg_active & (dual_binds == 0)
            loss = -surrogate
            dloss_dlogp = tl.where(pg_active, -weighted_adv * ratio, 0.0)

            kl = 0.0
            if KL_MODE != 0:
                ref = tl.load(ref_ptr + row).to(tl.float32)
                status = status | tl.where(tl.abs(ref) < float("inf"), 0, BAD_REF)
                x = logp - ref
                if KL_MODE == 1:
                    kl_raw = x
                    dkl = 1.0
                elif KL_MODE == 2:
                    kl_raw = x * x / 2.0
                    dkl = x
                else:
                    # k3 = exp(-x) - 1 + x, x clamped at -10 first (OpenRLHF's order of operations). Below -10
                    # the value (e^10 - 11) is past the cap, so the gate after this block zeroes dkl there.
                    xc = tl.maximum(x, -KL_MAX)
                    kl_raw = tl.exp(-xc) - 1.0 + xc
                    dkl = 1.0 - tl.exp(-xc)
                kl = tl.minimum(tl.maximum(kl_raw, -KL_MAX), KL_MAX)
                dkl = tl.where((kl_raw >= -KL_MAX) & (kl_raw <= KL_MAX), dkl, 0.0)
                loss = loss + kl_coef * kl
                dloss_dlogp = dloss_dlogp + kl_coef * dkl

            # A flagged row never trains silently: NaN in its loss, log-prob, KL and gradient, whatever the policy
            # (the KL's clamp would turn a NaN log-prob into a finite bound).
            poison = tl.where(status == 0, 1.0, float("nan"))
            loss = loss * poison
            logp_out = logp * poison
            kl = kl * poison
            dloss_dlogp = dloss_dlogp * poison
            tl.store(loss_ptr + row, loss)
            tl.store(logp_ptr + row, logp_out)
            tl.store(kl_ptr + row, kl)
            tl.store(clipped_ptr + row, surr2 < surr1)
            tl.store(row_max_ptr + row, m)
            tl.store(log_sum_ptr + row, log_s)
            tl.store(dloss_dlogp_ptr + row, dloss_dlogp)
            tl.store(status_ptr + row, status)
            if status != 0:
                tl.atomic_or(word_ptr, status)
            if WITH_ENTROPY:
                tl.store(entropy_ptr + row, entropy)

            if GRAD_IN_FORWARD:
                # The row's gradient now, swept from its last block back (the blocks just read are the likeliest
                # still in cache): dlogits_j = (g * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)) / T.
                g = tl.load(loss_weight_ptr + row).to(tl.float32) * dloss_dlogp
                g_ent = 0.0
                if WITH_ENTROPY_WEIGHT:
                    g_ent = tl.load(entropy_weight_ptr + row).to(tl.float32) * poison
                n_blocks = tl.cdiv(n_cols, BLOCK_V)
                for i in range(0, n_blocks):
                    cols = (n_blocks - 1 - i) * BLOCK_V + offsets
                    valid = cols < n_cols
                    z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
                    d = dlogits_block(z, cols, label, g, g_ent, m, log_s, entropy, inv_temperature, WITH_ENTROPY_WEIGHT)
                    tl.store(grad_row + cols, d.to(grad_ptr.dtype.element_ty), mask=valid)
        else:
            # Masked rows: never read; every output written here (the buffers come from torch.empty).
            tl.store(loss_ptr + row, 0.0)
            tl.store(logp_ptr + row, 0.0)
            tl.store(kl_ptr + row, 0.0)
            tl.store(clipped_ptr + row, False)
            tl.store(dloss_dlogp_ptr + row, 0.0)
            tl.store(status_ptr + row, 0)
            if WITH_ENTROPY:
                tl.store(entropy_ptr + row, 0.0)
            if GRAD_IN_FORWARD:
                for start in range(0, n_cols, BLOCK_V):
                    cols = start + offsets
                    tl.store(grad_row + cols, tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _policy_loss_bwd_kernel(
    logits_ptr,
    stride_row,
    grad_ptr,
    grad_stride_row,
    labels_ptr,
    keep_ptr,
    row_max_ptr,
    log_sum_ptr,
    dloss_dlogp_ptr,
    g_loss_ptr,
    g_loss_stride,  # 0 for the expanded gradient of a sum
    g_logp_ptr,
    g_logp_stride,
    g_entropy_ptr,
    g_entropy_stride,
    entropy_ptr,
    n_rows,
    n_cols,
    inv_temperature,
    HAS_G_LOSS: tl.constexpr,
    HAS_G_LOGP: tl.constexpr,
    WITH_ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offsets = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        grad_row = grad_ptr + tl.cast(row, tl.int64) * grad_stride_row
        if tl.load(keep_ptr + row) != 0:
            row_ptr = logits_ptr + tl.cast(row, tl.int64) * stride_row
            row_max = tl.load(row_max_ptr + row)
            log_sum = tl.load(log_sum_ptr + row)
            # g = dL/dlogp through the loss and through logp itself; dloss_dlogp is NaN on a flagged row
            dloss_dlogp = tl.load(dloss_dlogp_ptr + row)
            g = dloss_dlogp * 0.0
            if HAS_G_LOSS:
                g = g + tl.load(g_loss_ptr + row * g_loss_stride).to(tl.float32) * dloss_dlogp
            if HAS_G_LOGP:
                g = g + tl.load(g_logp_ptr + row * g_logp_stride).to(tl.float32)
            label = tl.load(labels_ptr + row).to(tl.int64)
            g_ent = 0.0
            entropy = 0.0
            if WITH_ENTROPY_GRAD:
                g_ent = tl.load(g_entropy_ptr + row * g_entropy_stride).to(tl.float32)
                entropy = tl.load(entropy_ptr + row)
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offsets
                valid = cols < n_cols
                z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
                d = dlogits_block(z, cols, label, g, g_ent, row_max, log_sum, entropy, inv_temperature,
                                  WITH_ENTROPY_GRAD)  # fmt: skip
                tl.store(grad_row + cols, d.to(grad_ptr.dtype.element_ty), mask=valid)
        else:
            # The gradient buffer comes from torch.empty: masked rows get explicit zeros, reads skipped.
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offsets
                zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
                tl.store(grad_row + cols, zeros, mask=cols < n_cols)


@triton.jit
def _scale_rows_kernel(grad_ptr, grad_stride_row, scale_ptr, n_rows, n_cols, BLOCK_V: tl.constexpr):
    """``grad *= scale`` with ``scale`` read on the device: a launch that does nothing when it is 1 (no host sync to
    find out), the one-pass head's backward under ``loss.backward()``."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        offsets = tl.arange(0, BLOCK_V)
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            grad_row = grad_ptr + tl.cast(row, tl.int64) * grad_stride_row
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offsets
                valid = cols < n_cols
                value = tl.load(grad_row + cols, mask=valid, other=0.0).to(tl.float32) * scale
                tl.store(grad_row + cols, value.to(grad_ptr.dtype.element_ty), mask=valid)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = int(raw)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


def _launch_config(n_rows: int, n_cols: int, persistent: bool = False, device: Optional[torch.device] = None) -> dict:
    """Grid and block size for ``[n_rows, n_cols]`` logits (env overrides for tests and tuning). ``persistent``: the
    one-pass head's grid, a few programs per SM of ``device`` when it is a GPU."""
    block_v = _env_int(ENV_BLOCK_V, max(16, min(DEFAULT_BLOCK_V, triton.next_power_of_2(n_cols))))
    if block_v & (block_v - 1):
        raise ValueError(f"{ENV_BLOCK_V} must be a power of 2, got {block_v}")
    num_warps = _env_int(ENV_NUM_WARPS, 8 if block_v >= 4096 else 4)
    programs = _env_int(ENV_GRID_CAP, DEFAULT_GRID_CAP)
    if persistent and device is not None and device.type == "cuda":
        per_sm = _env_int(ENV_PROGRAMS_PER_SM, DEFAULT_PROGRAMS_PER_SM)
        programs = min(programs, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)
    grid = (min(n_rows, programs),)
    return {"grid": grid, "BLOCK_V": block_v, "num_warps": num_warps}


def _forward_launch(logits, labels, old, adv, keep, ref, options, grad=None, loss_weights=None,
                    entropy_weights=None):
    """The forward kernel over every row: ``(fields [7, N] fp32, clipped [N] bool, status [N] int32, word [1] int32)``;
    ``fields`` rows are loss, logp, kl, entropy, row max, log-sum, dloss/dlogp. With ``grad`` (``[N, V]``, possibly
    the logits themselves) the kernel also writes dlogits from ``loss_weights`` / ``entropy_weights`` (the one-pass
    head). Two launches: the 4-byte status word's zeroing and the kernel."""
    n_rows, n_cols = logits.shape
    device = logits.device
    fields = torch.empty(7, n_rows, dtype=torch.float32, device=device)
    clipped = torch.empty(n_rows, dtype=torch.bool, device=device)
    status = torch.empty(n_rows, dtype=torch.int32, device=device)
    word = torch.zeros(1, dtype=torch.int32, device=device)
    if n_rows == 0:
        return fields, clipped, status, word
    config = _launch_config(n_rows, n_cols, persistent=grad is not None, device=device)
    loss, logp, kl, entropy, row_max, log_sum, dloss_dlogp = fields
    _policy_loss_fwd_kernel[config["grid"]](
        logits, logits.stride(0), labels, old, adv, keep,
        ref if ref is not None else old,  # unread when KL_MODE == 0
        loss_weights if loss_weights is not None else old,  # unread unless GRAD_IN_FORWARD
        entropy_weights if entropy_weights is not None else old,
        grad if grad is not None else logits, grad.stride(0) if grad is not None else 0,
        loss, logp, kl, clipped, entropy, row_max, log_sum, dloss_dlogp, status, word,
        n_rows, n_cols,
        1.0 / options["temperature"], options["alpha"], 1.0 - options["eps_low"], 1.0 + options["eps_high"],
        options["dual_clip"] if options["dual_clip"] is not None else 0.0, options["kl_coef"],
        LOG_RATIO_MAX=LOG_RATIO_CLAMP, KL_MAX=KL_CLAMP,
        KL_MODE=0 if ref is None else KL_MODES[options["kl_estimator"]],
        HAS_DUAL_CLIP=options["dual_clip"] is not None, WITH_ENTROPY=options["return_entropy"],
        GRAD_IN_FORWARD=grad is not None, WITH_ENTROPY_WEIGHT=entropy_weights is not None,
        BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"],
    )  # fmt: skip
    return fields, clipped, status, word


class _TritonPolicyLoss(torch.autograd.Function):
    """Two passes: the forward kernel, then the backward kernel from the saved per-row vectors, for any per-token
    upstream gradients of ``loss``, ``logp`` and ``entropy``. Also returns the status bits (non-differentiable)."""

    @staticmethod
    def forward(ctx, logits, labels, old_log_probs, advantages, keep, ref_log_probs, options):
        fields, clipped, status, word = _forward_launch(
            logits, labels, old_log_probs, advantages, keep, ref_log_probs, options
        )
        loss, logp, kl, entropy, row_max, log_sum, dloss_dlogp = fields
        ctx.save_for_backward(logits, labels, keep, row_max, log_sum, dloss_dlogp, entropy)
        ctx.inv_temperature = 1.0 / options["temperature"]
        ctx.with_entropy = options["return_entropy"]
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(kl, clipped, status, word)
        if not options["return_entropy"]:
            ctx.mark_non_differentiable(entropy)
        return loss, logp, kl, clipped, entropy, status, word

    @staticmethod
    @first_order("fused_policy_loss (backend 'triton')", "backend='torch' differentiates twice")
    def backward(ctx, g_loss, g_logp, g_kl, g_clipped, g_entropy, g_status, g_word):
        # Only ``logits`` can need a gradient (every other input is detached or integer), so autograd calls this
        # only when it does. One launch: the chain rule through logp is done per row inside the kernel.
        logits, labels, keep, row_max, log_sum, dloss_dlogp, entropy = ctx.saved_tensors
        n_rows, n_cols = logits.shape
        with_entropy_grad = ctx.with_entropy and g_entropy is not None
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        if n_rows > 0:
            config = _launch_config(n_rows, n_cols)
            unused = (dloss_dlogp, 0)
            g_loss_arg = (g_loss, g_loss.stride(0)) if g_loss is not None else unused
            g_logp_arg = (g_logp, g_logp.stride(0)) if g_logp is not None else unused
            g_entropy_arg = (g_entropy, g_entropy.stride(0)) if with_entropy_grad else unused
            _policy_loss_bwd_kernel[config["grid"]](
                logits, logits.stride(0), grad, grad.stride(0), labels, keep, row_max, log_sum, dloss_dlogp,
                *g_loss_arg, *g_logp_arg, *g_entropy_arg, entropy,
                n_rows, n_cols, ctx.inv_temperature,
                HAS_G_LOSS=g_loss is not None, HAS_G_LOGP=g_logp is not None, WITH_ENTROPY_GRAD=with_entropy_grad,
                BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"],
            )  # fmt: skip
        return grad, None, None, None, None, None, None


class _TritonPolicyLossOnePass(torch.autograd.Function):
    """One pass: the forward kernel writes dlogits from the per-token weights while it reads each row; the backward
    only scales that buffer by the upstream scalar (a launch that does nothing when it is 1). Returns the reduced
    scalar (differentiable) and the per-token fields and status (not)."""

    @staticmethod
    def forward(ctx, logits, labels, old_log_probs, advantages, keep, ref_log_probs, loss_weights, entropy_weights,
                grad_in_logits, options):  # fmt: skip
        grad = logits if grad_in_logits else torch.empty_like(logits, memory_format=torch.contiguous_format)
        fields, clipped, status, word = _forward_launch(
            logits, labels, old_log_probs, advantages, keep, ref_log_probs, options, grad, loss_weights,
            entropy_weights,
        )  # fmt: skip
        loss, logp, kl, entropy = fields[0], fields[1], fields[2], fields[3]
        # loss is 0 on masked rows and NaN on flagged ones: their weights add nothing / poison it, as they should
        reduced = torch.dot(loss_weights, loss)
        if entropy_weights is not None:
            reduced = reduced + torch.dot(entropy_weights, entropy)
        if grad_in_logits:
            # the logits now hold their gradient: any earlier op that saved them for its backward raises there,
            # never backpropagates through the overwritten values silently
            torch.autograd.graph.increment_version(logits)
        ctx.grad = grad
        ctx.mark_non_differentiable(loss, logp, kl, clipped, entropy, status, word)
        return reduced, loss, logp, kl, clipped, entropy, status, word

    @staticmethod
    @first_order("fused_policy_loss (backend 'triton', loss_weights)", "backend='torch' differentiates twice")
    def backward(ctx, g_reduced, *unused):
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("the one-pass loss head's gradient was already used: it cannot be backpropagated twice "
                               "(retain_graph); pass loss_weights=None for the two-pass head")  # fmt: skip
        n_rows, n_cols = grad.shape
        if n_rows > 0 and g_reduced is not None:
            config = _launch_config(n_rows, n_cols)
            scale = g_reduced.reshape(1).to(torch.float32)
            _scale_rows_kernel[config["grid"]](
                grad, grad.stride(0), scale, n_rows, n_cols, BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"]
            )
        return (grad,) + (None,) * 9


def triton_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_log_probs: Optional[torch.Tensor] = None,
    alpha: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    temperature: float = 1.0,
    return_entropy: bool = False,
    loss_weights: Optional[torch.Tensor] = None,
    entropy_weights: Optional[torch.Tensor] = None,
    grad_in_logits: bool = False,
) -> LossHeadOutput:
    """The Triton backend of :func:`openrlhf_lopti.ops.fused_policy_loss` (shapes and options already checked there;
    the values are checked here, in the kernel, as status bits).

    Args:
        logits: ``[N, V]`` fp32/bf16/fp16 on CUDA (or CPU when kernels run under ``TRITON_INTERPRET=1``);
            read in its own dtype. A last dimension with stride != 1 is made contiguous first (a copy in
            the same dtype, never fp32).
        labels: ``[N]`` integer token ids; one outside ``[0, V)`` on a kept row is flagged, never read.
        old_log_probs, advantages, ref_log_probs: ``[N]`` floats (nats; advantages unitless), read in their dtype.
        mask: ``[N]`` bool or 0/1; rows with 0 are neither read nor differentiated.
        loss_weights, entropy_weights: ``[N]`` fp32 per-token weights of the reduced loss (the one-pass head), or
            None (the two-pass head: per-token outputs with gradients).
        grad_in_logits: with ``loss_weights``, write the gradient into the logits' own buffer (saves one ``[N, V]``;
            the logits are overwritten: only for a caller that does not need them afterwards).
        Other options as in :func:`openrlhf_lopti.algo.policy_loss_from_logits`.

    Returns:
        :class:`~openrlhf_lopti.ops.loss_head_output.LossHeadOutput`: fp32 ``[N]`` ``loss``, ``logp``, ``kl``, bool
        ``clipped`` and ``entropy`` (or None); ``reduced`` with ``loss_weights``; ``status`` (unread). Gradients
        reach ``logits`` (in its dtype) through ``loss``, ``logp`` and ``entropy``, or through ``reduced`` alone.

    Raises:
        RuntimeError: CPU tensors while the kernels were not defined in interpreter mode.
    """
    if not logits.is_cuda and not INTERPRETED:
        raise RuntimeError(
            "the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            "openrlhf_lopti.ops.triton.policy_loss is first imported to run on CPU"
        )
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    vector = lambda x: x.detach().contiguous()  # noqa: E731  ([N] vectors, read in their own dtype by the kernel)
    options = dict(
        alpha=alpha, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, kl_coef=kl_coef,
        kl_estimator=kl_estimator, temperature=temperature, return_entropy=return_entropy,
    )  # fmt: skip
    rows = (vector(labels), vector(old_log_probs), vector(advantages), vector(mask),
            None if ref_log_probs is None else vector(ref_log_probs))  # fmt: skip
    if loss_weights is None:
        loss, logp, kl, clipped, entropy, status, word = _TritonPolicyLoss.apply(logits, *rows, options)
        reduced = None
    else:
        # Under no_grad (or logits that need no gradient) nothing [N, V] is written: the two-pass forward alone
        one_pass = torch.is_grad_enabled() and logits.requires_grad
        if one_pass:
            weights = (vector(loss_weights.float()), None if entropy_weights is None else vector(entropy_weights.float()))
            outputs = _TritonPolicyLossOnePass.apply(logits, *rows, *weights, grad_in_logits, options)
            reduced, loss, logp, kl, clipped, entropy, status, word = outputs
        else:
            loss, logp, kl, clipped, entropy, status, word = _TritonPolicyLoss.apply(logits.detach(), *rows, options)
            reduced = torch.dot(loss_weights.float(), loss)
            if entropy_weights is not None:
                reduced = reduced + torch.dot(entropy_weights.float(), entropy)
    return LossHeadOutput(
        loss=loss, logp=logp, kl=kl, clipped=clipped, entropy=entropy if return_entropy else None, reduced=reduced,
        backend="triton",
        status=ValueStatus(status, word, logits.shape[1], temperature, None if grad_in_logits else logits.__getitem__),
    )  # fmt: skip
