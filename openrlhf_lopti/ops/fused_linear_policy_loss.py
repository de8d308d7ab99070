"""``fused_linear_policy_loss`` and ``linear_log_probs``: the lm_head and the loss head together, chunk by chunk,
so that the ``[N, V]`` logits of a whole micro-batch never exist.

Rows are taken in chunks of ``chunk_size``. For each chunk the logits ``hidden[rows] @ weight.T (+ bias)`` are made
by torch's matmul in the model's dtype (cuBLAS on GPU, the CPU GEMM on CPU), and then
:func:`~openrlhf_lopti.ops.fused_policy_loss` (whichever backend ``backend`` picks) runs on them. Only rows with
mask 1 are gathered before the matmul, so a Lopti phase pays the lm_head only for its own tokens.

Backward recomputes each chunk's logits (one extra matmul per chunk) and runs the kernel's own forward and
backward on them with the incoming per-token gradients of ``loss``, ``logp`` and ``entropy``; then
``grad_hidden[rows] = g @ W`` and ``grad_W += g.T @ h`` (fp32 accumulator; ``grad_b += g.sum(0)`` likewise),
where ``g`` is the chunk's gradient w.r.t. its logits. Nothing is filtered: every token's gradient, however
small, reaches the weight (Lopti's first phase trains exactly the low-probability tokens).

Why recompute instead of computing ``g`` eagerly in forward (Liger's chunked losses): the eager form only
knows ``d(sum loss)``; with per-token gradients on several outputs (the token-mean loss, a KL term through
``logp``, an entropy bonus) ``grad_W = sum_i c_i g_i h_i^T`` needs the per-token ``c_i`` inside the sum, which
forward cannot know (https://github.com/linkedin/Liger-Kernel/pull/1298 is that bug in Liger's ``reduction="none"``).

Peak extra memory: the ``[chunk, V]`` buffers alive at once (forward: one chunk's logits, reused from chunk to
chunk; backward: the logits and their gradient), within :data:`DEFAULT_CHUNK_BYTES` by default, plus the kernel's
per-row vectors (the ``"torch"`` backend adds its fp32 ``[chunk, V]`` temporaries); the ``[V, H]`` fp32
weight-gradient accumulator (for a bf16/fp16 weight, plus one ``[V_block, H]`` product and the final cast).
"""

from dataclasses import astuple
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..algo import PolicyLossOutput
from ..algo.policy_loss import bad_logit_row_error, first_flagged_row
from .fused_policy_loss import BACKENDS, LOGITS_DTYPES, _check_row_inputs, fused_policy_loss
from .loss_options import LossOptions, resolve_options

# Default chunking: the [chunk, V] buffers alive at once take at most this many bytes (model dtype). Forward
# passes hold one (the chunk's logits), backward two (logits and their gradient), so at V = 151936 the forward
# takes 441 fp32 / 883 bf16 rows per chunk and the backward 220 / 441. Bigger chunks run the lm_head GEMM
# closer to full speed (a 220-row fp32 chunk was ~20% slower per row than 2048 rows on a 2-core Xeon;
# benchmarks/RESULTS.md); a GEMM of a few hundred rows against the whole [V, H] weight stays compute-bound.
DEFAULT_CHUNK_BYTES = 256 * 2**20
# A bf16/fp16 weight's gradient is summed in fp32 from products of this many vocab rows at a time, so the
# low-precision product never needs a whole [V, H] buffer.
_GRAD_WEIGHT_BLOCK = 16384


def default_chunk_size(vocab_size: int, dtype: torch.dtype, buffers: int = 1) -> int:
    """Rows per chunk when ``chunk_size`` is None: the largest count for which ``buffers`` ``[chunk, V]``
    tensors in ``dtype`` take at most :data:`DEFAULT_CHUNK_BYTES` (at least 1). Forward passes use
    ``buffers=1``, the backward ``buffers=2``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, DEFAULT_CHUNK_BYTES // (buffers * vocab_size * itemsize))


def _check_linear_inputs(hidden, weight, bias, chunk_size, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a [N, H] tensor, got shape {getattr(hidden, 'shape', type(hidden))}")
    if hidden.dtype not in LOGITS_DTYPES:
        raise ValueError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be the lm_head's [V, H] = [V, {hidden.shape[1]}] tensor, "
            f"got shape {getattr(weight, 'shape', type(weight))}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocab dimension V")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"weight must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), "
            f"got {weight.dtype} on {weight.device}"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            got = getattr(bias, "shape", bias)
            raise ValueError(f"bias must be None or a [V] = [{weight.shape[0]}] tensor, got {got}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"bias must have hidden's dtype and device, got {bias.dtype} on {bias.device}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an integer >= 1, got {chunk_size!r}")


def _chunk_logits(hidden_rows, weight, bias, out: torch.Tensor) -> torch.Tensor:
    """``hidden_rows @ weight.T (+ bias)`` written into ``out`` (a buffer reused across chunks: on CPU a fresh
    ``[chunk, V]`` allocation costs page faults on every chunk)."""
    if bias is None:
        return torch.mm(hidden_rows, weight.t(), out=out)
    return torch.addmm(bias, hidden_rows, weight.t(), out=out)


def _logits_buffer(hidden, weight, rows: int) -> torch.Tensor:
    return torch.empty(rows, weight.shape[0], dtype=hidden.dtype, device=hidden.device)


class _Rows:
    """The kept rows and their per-token inputs, gathered once (``[K]`` each, K = kept rows)."""

    def __init__(self, index, labels, old_log_probs, advantages, ref_log_probs):
        self.index, self.labels, self.old, self.adv, self.ref = index, labels, old_log_probs, advantages, ref_log_probs

    def chunk_loss(self, logits, start, options, backend) -> PolicyLossOutput:
        """The kernel on the chunk's logits (rows ``start : start + len(logits)`` of the kept rows)."""
        part = slice(start, start + logits.shape[0])
        try:
            return fused_policy_loss(
                logits,
                self.labels[part],
                self.old[part],
                self.adv[part],
                torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device),
                ref_log_probs=None if self.ref is None else self.ref[part],
                backend=backend,
                **options,
            )
        except ValueError as error:  # a NaN / +inf / all -inf logits row: name it by the caller's row index
            bad = first_flagged_row(~torch.isfinite(torch.logsumexp(logits.float() / options["temperature"], -1)))
            if bad is None:
                raise
            row = int(self.index[start + bad])
            raise bad_logit_row_error(row, logits[bad], options["temperature"]) from error


def _forward(hidden, weight, bias, rows: _Rows, n: int, chunk: int, options: dict, backend: str) -> tuple:
    """Per-token outputs ``(loss, logp, kl, clipped, entropy or None)``, ``[N]`` each, without autograd."""
    zeros = dict(dtype=torch.float32, device=hidden.device)
    loss, logp, kl = (torch.zeros(n, **zeros) for _ in range(3))
    clipped = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    entropy = torch.zeros(n, **zeros) if options["return_entropy"] else None
    kept = rows.index.numel()
    with torch.no_grad():
        buffer = _logits_buffer(hidden, weight, min(chunk, kept)) if kept else None
        for start in range(0, kept, chunk):
            index = rows.index[start : start + chunk]
            logits = _chunk_logits(hidden.index_select(0, index), weight, bias, buffer[: index.numel()])
            out = rows.chunk_loss(logits, start, options, backend)
            loss.index_copy_(0, index, out.loss)
            logp.index_copy_(0, index, out.logp)
            kl.index_copy_(0, index, out.kl)
            clipped.index_copy_(0, index, out.clipped)
            if entropy is not None:
                entropy.index_copy_(0, index, out.entropy)
    return loss, logp, kl, clipped, entropy


class _FusedLinearPolicyLoss(torch.autograd.Function):
    """Saves only the inputs; backward recomputes each chunk's logits and runs the kernel's backward on them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, chunks, options, backend):
        n = hidden.shape[0]
        loss, logp, kl, clipped, entropy = _forward(hidden, weight, bias, rows, n, chunks[0], options, backend)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.rows, ctx.chunk, ctx.options, ctx.backend = rows, chunks[1], options, backend
        ctx.mark_non_differentiable(kl, clipped)
        ctx.set_materialize_grads(False)  # unused outputs give None: their terms are skipped
        return loss, logp, kl, clipped, entropy if entropy is not None else hidden.new_empty(0, dtype=torch.float32)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_logp, _grad_kl, _grad_clipped, grad_entropy):
        hidden, weight, bias = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_outputs = [(name, g) for name, g in (("loss", grad_loss), ("logp", grad_logp), ("entropy", grad_entropy))
                        if g is not None]  # fmt: skip
        none = (None,) * 4
        if not grad_outputs or not (need_hidden or need_weight or need_bias):
            return (None, None, None) + none
        rows = ctx.rows
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        kept = rows.index.numel()
        buffer = _logits_buffer(hidden, weight, min(ctx.chunk, kept)) if kept else None
        for start in range(0, kept, ctx.chunk):
            index = rows.index[start : start + ctx.chunk]
            hidden_rows = hidden.index_select(0, index)
            logits = _chunk_logits(hidden_rows, weight, bias, buffer[: index.numel()]).detach().requires_grad_(True)
            with torch.enable_grad():
                out = rows.chunk_loss(logits, start, ctx.options, ctx.backend)
                outputs = [getattr(out, name) for name, _ in grad_outputs]
                (grad_logits,) = torch.autograd.grad(outputs, logits, [g[index] for _, g in grad_outputs])
            del logits, out, outputs
            if need_hidden:
                grad_hidden.index_copy_(0, index, grad_logits @ weight)
            if need_weight:
                _accumulate_grad_weight(grad_weight, grad_logits, hidden_rows)
            if need_bias:
                grad_bias.add_(grad_logits.sum(0, dtype=torch.float32))
            del grad_logits
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        ) + none


def _accumulate_grad_weight(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden_rows: torch.Tensor) -> None:
    """``grad_weight [V, H] fp32 += grad_logits.T @ hidden_rows``, nothing filtered."""
    if grad_logits.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.t(), hidden_rows)
        return
    # Low precision: the GEMM sums the chunk's rows in fp32 and rounds once to the model dtype (as the unfused
    # lm_head backward does for all rows); chunks are then summed in fp32, V-block by V-block.
    for v0 in range(0, grad_weight.shape[0], _GRAD_WEIGHT_BLOCK):
        block = slice(v0, v0 + _GRAD_WEIGHT_BLOCK)
        grad_weight[block].add_(grad_logits[:, block].t() @ hidden_rows)


def _kept_rows(mask, labels, old_log_probs, advantages, ref_log_probs) -> _Rows:
    index = mask.bool().nonzero().squeeze(1)  # one host sync, like the input checks'
    return _Rows(
        index,
        labels.index_select(0, index),
        old_log_probs.index_select(0, index),
        advantages.index_select(0, index),
        None if ref_log_probs is None else ref_log_probs.index_select(0, index),
    )


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    alpha: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    options: Optional[LossOptions] = None,
) -> PolicyLossOutput:
    """:func:`~openrlhf_lopti.ops.fused_policy_loss` of the logits ``hidden @ weight.T + bias``, without ever
    holding those logits for all rows: the lm_head runs chunk by chunk, on the kept rows only.

    Args:
        hidden: ``[N, H]`` last hidden states (fp32 / bf16 / fp16), row i predicting ``labels[i]``.
        weight: ``[V, H]`` lm_head weight, same dtype and device as ``hidden`` (may be tied to the input
            embedding: its gradient adds to the embedding's).
        labels, old_log_probs, advantages, mask, ref_log_probs: ``[N]``, as in ``fused_policy_loss``; rows with
            mask 0 are never multiplied by the weight.
        bias: ``[V]`` lm_head bias or None; ``-inf`` entries make those tokens impossible.
        chunk_size: rows per lm_head chunk, in forward and backward; None: :func:`default_chunk_size` for
            each (the buffers of a chunk within :data:`DEFAULT_CHUNK_BYTES`).
        alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, temperature, return_entropy, backend, options:
            as in ``fused_policy_loss`` (the backend runs on each chunk's logits).

    Returns:
        :class:`~openrlhf_lopti.algo.PolicyLossOutput` of fp32 ``[N]`` fields, equal to ``fused_policy_loss``
        on the full logits. Gradients from ``loss``, ``logp`` and ``entropy`` (any per-token weights) reach
        ``hidden`` (its dtype), ``weight`` and ``bias`` (summed over chunks in fp32, returned in their dtype).
        Double backward is not supported.

    Raises:
        ValueError: naming the argument, before any matmul: the checks and messages of ``fused_policy_loss``
            for the per-token inputs and options, plus shape / dtype / device of ``hidden``, ``weight``,
            ``bias`` and ``chunk_size``. And, as ``fused_policy_loss``, for the first unmasked row whose logits
            hold a NaN or +inf, or only -inf: ``"logits row i ..."`` with ``i`` its row in ``hidden``.
    """
    alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, temperature, backend = astuple(resolve_options(
        options, alpha=alpha, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, kl_coef=kl_coef,
        kl_estimator=kl_estimator, temperature=temperature, backend=backend,
    ))  # fmt: skip
    _check_linear_inputs(hidden, weight, bias, chunk_size, backend)
    n, v = hidden.shape[0], weight.shape[0]
    _check_row_inputs(
        n, v, hidden.device, "hidden [N, H]", labels, old_log_probs, advantages, mask, ref_log_probs,
        alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, temperature,
    )  # fmt: skip
    options = dict(alpha=float(alpha), eps_low=float(eps_low), eps_high=float(eps_high),
                   dual_clip=None if dual_clip is None else float(dual_clip), kl_coef=float(kl_coef),
                   kl_estimator=kl_estimator, temperature=float(temperature),
                   return_entropy=bool(return_entropy))  # fmt: skip
    rows = _kept_rows(mask, labels, old_log_probs, advantages, ref_log_probs)
    chunks = [chunk_size or default_chunk_size(v, hidden.dtype, buffers) for buffers in (1, 2)]  # forward, backward
    outputs = _FusedLinearPolicyLoss.apply(hidden, weight, bias, rows, chunks, options, backend)
    loss, logp, kl, clipped, entropy = outputs
    return PolicyLossOutput(loss=loss, logp=logp, kl=kl, clipped=clipped, entropy=entropy if return_entropy else None)


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
) -> tuple:
    """Log-probs (and entropy) of ``softmax((hidden @ weight.T + bias) / temperature)`` for the forward-only
    passes (old-policy and reference log-probs), chunk by chunk, with no autograd graph.

    Args:
        hidden: ``[N, H]`` last hidden states; weight ``[V, H]``; bias ``[V]`` or None (as
            :func:`fused_linear_policy_loss`).
        labels: ``[N]`` token ids, in ``[0, V)`` on kept rows.
        mask: ``[N]`` bool or 0/1, or None (all rows); rows with 0 are skipped and give 0.
        temperature: > 0, the sampling temperature.
        return_entropy: also compute the per-row entropy (nats).
        chunk_size, backend: as :func:`fused_linear_policy_loss`.

    Returns:
        ``(logp, entropy)``: fp32 ``[N]`` (nats) and fp32 ``[N]`` or None; detached.

    Raises:
        ValueError: the same checks and messages as :func:`fused_linear_policy_loss` (non-finite logits rows
            included).
    """
    _check_linear_inputs(hidden, weight, bias, chunk_size, backend)
    n, v = hidden.shape[0], weight.shape[0]
    keep = torch.ones(n, dtype=torch.bool, device=hidden.device) if mask is None else mask
    zeros = torch.zeros(n, dtype=torch.float32, device=hidden.device)  # the loss's inputs are unused here
    _check_row_inputs(
        n, v, hidden.device, "hidden [N, H]", labels, zeros, zeros, keep, None,
        0.0, 0.2, 0.2, None, 0.0, "k3", temperature,
    )  # fmt: skip
    options = dict(alpha=0.0, eps_low=0.2, eps_high=0.2, dual_clip=None, kl_coef=0.0, kl_estimator="k3",
                   temperature=float(temperature), return_entropy=bool(return_entropy))  # fmt: skip
    rows = _kept_rows(keep, labels, zeros, zeros, None)
    chunk = chunk_size or default_chunk_size(v, hidden.dtype)
    with torch.no_grad():
        _, logp, _, _, entropy = _forward(hidden.detach(), weight.detach(), None if bias is None else bias.detach(),
                                          rows, n, chunk, options, backend)  # fmt: skip
    return logp, entropy
