"""The fused Triton policy-loss head: logits -> log-prob -> AR weight -> clipped surrogate -> KL, fwd and bwd.

Forward, one program per row (rows strided over at most ``grid cap`` programs, so any ``N`` works):
an online log-sum-exp over the vocab in ``BLOCK_V`` chunks read in the logits' own dtype, then the
per-token math of :mod:`openrlhf_lopti.algo.policy_loss` in registers. It saves per row only the
log-sum-exp (as its two parts ``max`` and ``log(sum exp(z - max))``, so ``z - lse`` loses no digits when
logits are large), ``dloss/dlogp`` and the entropy, fp32 ``[N]`` each; nothing ``[N, V]`` besides the
caller's logits.

Backward recomputes ``p = exp(z / T - lse)`` block by block and writes, per kept row,

    dlogits_j = (g * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)) / T,
    g         = g_logp + g_loss * dloss/dlogp

in the logits' dtype; masked rows are never read and get zeros.

-inf logits are exact (probability 0, no entropy term, zero gradient), as the reference defines them; the
forward also writes an int8 ``bad_rows`` flag per row, set on kept rows whose log-sum-exp is not finite (a NaN
or +inf logit, or only -inf), from the same online pass, for the caller to raise on.

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

from ...algo import PolicyLossOutput
from ...algo.policy_loss import KL_CLAMP, LOG_RATIO_CLAMP

# Kernels defined under TRITON_INTERPRET=1 run on CPU tensors (numpy emulation); the flag is read when
# @triton.jit runs, i.e. at this module's import.
INTERPRETED = bool(triton.knobs.runtime.interpret)

# Rows go on grid dim 0 and at most 65535 programs stride over them, so any N launches: grid dims 1/2 are
# capped at 64K (tokens placed there overflow, https://github.com/SHI-Labs/NATTEN/pull/305), and row
# offsets are int64 (row * V passes 2^31 at N=16384, V=151936; https://github.com/linkedin/Liger-Kernel/issues/803).
DEFAULT_GRID_CAP = 65535
DEFAULT_BLOCK_V = 4096  # untuned: no GPU has run this yet (benchmarks/RESULTS.md)
KL_MODES = {"k1": 1, "k2": 2, "k3": 3}

# Private knobs for tests and tuning: small blocks make V=257 span several blocks in interpreter mode.
ENV_BLOCK_V = "OPENRLHF_LOPTI_TRITON_BLOCK_V"
ENV_GRID_CAP = "OPENRLHF_LOPTI_TRITON_GRID_CAP"
ENV_NUM_WARPS = "OPENRLHF_LOPTI_TRITON_NUM_WARPS"


@triton.jit
def _policy_loss_fwd_kernel(
    logits_ptr,
    stride_row,
    labels_ptr,
    old_ptr,
    adv_ptr,
    keep_ptr,
    ref_ptr,
    loss_ptr,
    logp_ptr,
    kl_ptr,
    clipped_ptr,
    entropy_ptr,
    row_max_ptr,
    log_sum_ptr,
    dloss_dlogp_ptr,
    bad_rows_ptr,
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
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offsets = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        # Masked rows: outputs stay at their preallocated 0 and the logits are never read.
        if tl.load(keep_ptr + row) != 0:
            row_ptr = logits_ptr + tl.cast(row, tl.int64) * stride_row
            # Online log-sum-exp with a running scalar max m; s = sum exp(z - m), t = sum exp(z - m) * (z - m)
            # (the entropy is log(s) - t / s, shifted so large logits lose no precision).
            m = -float("inf")
            s = 0.0
            t = 0.0
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offsets
                valid = cols < n_cols
                z = tl.load(row_ptr + cols, mask=valid, other=-float("inf")).to(tl.float32) * inv_temperature
                m_new = tl.maximum(m, tl.max(z, axis=0))
                # Shift by 0 while every entry so far is -inf (padding, or -inf logits), so that no
                # exp(-inf - -inf) = NaN appears: those entries add exp(-inf) = 0.
                m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
                scale = tl.exp(m - m_ref)
                e = tl.exp(z - m_ref)
                if WITH_ENTROPY:
                    # Written so that no NaN appears: m is -inf (and s 0) before the first finite entry, and
                    # e * (z - m_ref) is 0, not 0 * -inf, where z = -inf (a -inf logit or a padding lane).
                    shift = tl.where(s > 0.0, m - m_ref, 0.0) * s
                    t = scale * (t + shift) + tl.sum(e * tl.where(e > 0.0, z - m_ref, 0.0), axis=0)
                s = s * scale + tl.sum(e, axis=0)
                m = m_new
            log_s = tl.log(s)
            # NaN / +inf anywhere make s NaN (or m +inf); all -inf leaves m + log_s = -inf.
            lse_finite = tl.abs(m + log_s) < float("inf")
            tl.store(bad_rows_ptr + row, (lse_finite == 0).to(tl.int8))

            label = tl.load(labels_ptr + row).to(tl.int64)
            logp = (tl.load(row_ptr + label).to(tl.float32) * inv_temperature - m) - log_s
            old = tl.load(old_ptr + row)
            weighted_adv = tl.load(adv_ptr + row) * (alpha * tl.exp(old) + (1.0 - alpha))

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

            if KL_MODE != 0:
                x = logp - tl.load(ref_ptr + row)
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
                tl.store(kl_ptr + row, kl)

            tl.store(loss_ptr + row, loss)
            tl.store(logp_ptr + row, logp)
            tl.store(clipped_ptr + row, (surr2 < surr1).to(tl.int8))
            tl.store(row_max_ptr + row, m)
            tl.store(log_sum_ptr + row, log_s)
            tl.store(dloss_dlogp_ptr + row, dloss_dlogp)
            if WITH_ENTROPY:
                tl.store(entropy_ptr + row, log_s - t / s)


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
    g_logp_ptr,
    g_entropy_ptr,
    entropy_ptr,
    n_rows,
    n_cols,
    inv_temperature,
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
            g = tl.load(g_logp_ptr + row)
            label = tl.load(labels_ptr + row).to(tl.int64)
            if WITH_ENTROPY_GRAD:
                g_ent = tl.load(g_entropy_ptr + row)
                entropy = tl.load(entropy_ptr + row)
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offsets
                valid = cols < n_cols
                z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_temperature
                log_p = (z - row_max) - log_sum
                p = tl.exp(log_p)
                d = tl.where(cols == label, g, 0.0) - g * p
                if WITH_ENTROPY_GRAD:
                    # p = 0 (a -inf logit) contributes 0, not 0 * (log_p = -inf)
                    d = d - g_ent * p * tl.where(p > 0.0, log_p + entropy, 0.0)
                tl.store(grad_row + cols, (d * inv_temperature).to(grad_ptr.dtype.element_ty), mask=valid)
        else:
            # The gradient buffer comes from torch.empty: masked rows get explicit zeros, reads skipped.
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offsets
                zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
                tl.store(grad_row + cols, zeros, mask=cols < n_cols)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = int(raw)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


def _launch_config(n_rows: int, n_cols: int) -> dict:
    """Grid and block size for ``[n_rows, n_cols]`` logits (env overrides for tests and tuning)."""
    block_v = _env_int(ENV_BLOCK_V, max(16, min(DEFAULT_BLOCK_V, triton.next_power_of_2(n_cols))))
    if block_v & (block_v - 1):
        raise ValueError(f"{ENV_BLOCK_V} must be a power of 2, got {block_v}")
    num_warps = _env_int(ENV_NUM_WARPS, 8 if block_v >= 4096 else 4)
    grid = (min(n_rows, _env_int(ENV_GRID_CAP, DEFAULT_GRID_CAP)),)
    return {"grid": grid, "BLOCK_V": block_v, "num_warps": num_warps}


class _TritonPolicyLoss(torch.autograd.Function):
    """Autograd wrapper: forward kernel, then the backward kernel from the saved per-row vectors. Also returns
    the forward's ``bad_rows`` flags (non-differentiable) for the caller to check."""

    @staticmethod
    def forward(ctx, logits, labels, old_log_probs, advantages, keep, ref_log_probs, options):
        n_rows, n_cols = logits.shape
        config = _launch_config(n_rows, n_cols)
        device = logits.device
        zeros = lambda: torch.zeros(n_rows, dtype=torch.float32, device=device)  # noqa: E731
        loss, logp, kl, entropy, row_max, log_sum, dloss_dlogp = (zeros() for _ in range(7))
        clipped = torch.zeros(n_rows, dtype=torch.int8, device=device)
        bad_rows = torch.zeros(n_rows, dtype=torch.int8, device=device)
        kl_mode = 0 if ref_log_probs is None else KL_MODES[options["kl_estimator"]]
        if n_rows > 0:
            _policy_loss_fwd_kernel[config["grid"]](
                logits, logits.stride(0), labels, old_log_probs, advantages, keep,
                ref_log_probs if ref_log_probs is not None else old_log_probs,  # unread when KL_MODE == 0
                loss, logp, kl, clipped, entropy, row_max, log_sum, dloss_dlogp, bad_rows,
                n_rows, n_cols,
                1.0 / options["temperature"], options["alpha"], 1.0 - options["eps_low"], 1.0 + options["eps_high"],
                options["dual_clip"] if options["dual_clip"] is not None else 0.0, options["kl_coef"],
                LOG_RATIO_MAX=LOG_RATIO_CLAMP, KL_MAX=KL_CLAMP, KL_MODE=kl_mode,
                HAS_DUAL_CLIP=options["dual_clip"] is not None, WITH_ENTROPY=options["return_entropy"],
                BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"],
            )  # fmt: skip
        ctx.save_for_backward(logits, labels, keep, row_max, log_sum, dloss_dlogp, entropy)
        ctx.inv_temperature = 1.0 / options["temperature"]
        ctx.with_entropy = options["return_entropy"]
        ctx.set_materialize_grads(False)
        clipped, bad_rows = clipped.bool(), bad_rows.bool()
        ctx.mark_non_differentiable(kl, clipped, bad_rows)
        if not options["return_entropy"]:
            ctx.mark_non_differentiable(entropy)
        return loss, logp, kl, clipped, entropy, bad_rows

    @staticmethod
    def backward(ctx, g_loss, g_logp, g_kl, g_clipped, g_entropy, g_bad_rows):
        # Only ``logits`` can need a gradient (every other input is detached or integer), so autograd calls this
        # only when it does.
        logits, labels, keep, row_max, log_sum, dloss_dlogp, entropy = ctx.saved_tensors
        n_rows, n_cols = logits.shape
        # Chain rule through logp, in fp32 [N]: cheap, so done in torch rather than in the kernel.
        g_total = torch.zeros_like(log_sum)
        if g_loss is not None:
            g_total += g_loss.float() * dloss_dlogp
        if g_logp is not None:
            g_total += g_logp.float()
        with_entropy_grad = ctx.with_entropy and g_entropy is not None
        g_ent = g_entropy.float().contiguous() if with_entropy_grad else g_total
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        if n_rows > 0:
            config = _launch_config(n_rows, n_cols)
            _policy_loss_bwd_kernel[config["grid"]](
                logits, logits.stride(0), grad, grad.stride(0), labels, keep, row_max, log_sum, g_total, g_ent,
                entropy,
                n_rows, n_cols, ctx.inv_temperature,
                WITH_ENTROPY_GRAD=with_entropy_grad, BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"],
            )  # fmt: skip
        return grad, None, None, None, None, None, None


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
) -> Tuple[PolicyLossOutput, torch.Tensor]:
    """The Triton backend of :func:`openrlhf_lopti.ops.fused_policy_loss` (inputs already validated there).

    Args:
        logits: ``[N, V]`` fp32/bf16/fp16 on CUDA (or CPU when kernels run under ``TRITON_INTERPRET=1``);
            read in its own dtype. A last dimension with stride != 1 is made contiguous first (a copy in
            the same dtype, never fp32).
        labels: ``[N]`` integer token ids, in ``[0, V)`` on kept rows.
        old_log_probs, advantages, ref_log_probs: ``[N]`` floats (nats; advantages unitless).
        mask: ``[N]`` bool or 0/1; rows with 0 are neither read nor differentiated.
        Other options as in :func:`openrlhf_lopti.algo.policy_loss_from_logits`.

    Returns:
        ``(out, bad_rows)``: ``out`` a :class:`PolicyLossOutput` with fp32 ``[N]`` ``loss``, ``logp``, ``kl``,
        bool ``clipped`` and ``entropy`` (or None); gradients reach ``logits`` through ``loss``, ``logp`` and
        ``entropy`` and come back in the logits' dtype. ``bad_rows`` is ``[N]`` bool on the logits' device,
        True on kept rows without a finite log-sum-exp (NaN / +inf, or all -inf), whose outputs are
        meaningless: pass it to :func:`openrlhf_lopti.algo.policy_loss.check_logit_rows` before using
        ``out`` (``fused_policy_loss`` does).

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
    fp32 = lambda x: x.detach().to(torch.float32).contiguous()  # noqa: E731  ([N] vectors only)
    options = dict(
        alpha=alpha, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, kl_coef=kl_coef,
        kl_estimator=kl_estimator, temperature=temperature, return_entropy=return_entropy,
    )  # fmt: skip
    loss, logp, kl, clipped, entropy, bad_rows = _TritonPolicyLoss.apply(
        logits,
        labels.contiguous(),
        fp32(old_log_probs),
        fp32(advantages),
        mask.detach().bool().to(torch.int8).contiguous(),
        None if ref_log_probs is None else fp32(ref_log_probs),
        options,
    )
    out = PolicyLossOutput(loss=loss, logp=logp, kl=kl, clipped=clipped, entropy=entropy if return_entropy else None)
    return out, bad_rows
