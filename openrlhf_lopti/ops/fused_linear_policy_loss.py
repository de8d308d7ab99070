"""``fused_linear_policy_loss`` and ``linear_log_probs``: the lm_head and the loss head together, block by block, so
that the ``[N, V]`` logits of a whole micro-batch never exist.

Only the kept rows (mask 1) are gathered (``[K, H]``): a Lopti phase pays the lm_head only for its own tokens. The
logits are made one ``[R, Vb]`` block at a time (``R`` rows of the kept tokens, ``Vb`` vocabulary columns) by
torch's matmul in the model's dtype (cuBLAS on GPU, the CPU GEMM on CPU), into one reused buffer.

Forward: per block, :mod:`~openrlhf_lopti.ops.vocab_block`'s online log-sum-exp folds the block into four fp32
numbers per row (the Triton kernel on GPU, torch on CPU). After the last block each row's log-prob and entropy are
known; the per-token loss is then :func:`openrlhf_lopti.algo.policy_loss_from_logp` on those ``[K]`` vectors, the
method's own formulas, with autograd over ``[K]`` numbers only.

Backward: autograd hands the gradients w.r.t. the log-probs and entropies (whatever mix of token-mean loss, KL
through ``logp`` and entropy bonus produced them: exact). Per block the logits are recomputed once (one GEMM),
turned into their gradient in place from the saved per-row log-sum-exp and entropy (no second pass of statistics),
then ``grad_hidden[rows] += g @ W[cols]`` (fp32 accumulator ``[R, H]``) and ``grad_W[cols] = g^T @ h[rows]``: with
the default blocks one row chunk holds every kept row, so each block of ``grad_W`` is written once, by one GEMM
that sums all rows in fp32 and rounds once to the weight's dtype, as the unfused lm_head backward does; with
several row chunks it is summed in an fp32 ``[V, H]`` accumulator. Nothing is filtered: every token's gradient,
however small, reaches the weight.

So the four GEMMs of an lm_head step (forward; recompute, grad wrt hidden, grad wrt weight) run on blocks of
``[R, Vb]`` with ``R`` up to every kept row: large enough to be compute-bound on a GPU. Memory beyond the inputs
and the gradients: one ``[R, Vb]`` block (:data:`DEFAULT_BLOCK_BYTES`), the ``[R, H]`` fp32 accumulator, and
``O(K)`` per-row numbers. Input values are checked once for all rows, as status bits (``ops/value_status.py``):
no host sync per block.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from ..algo import policy_loss_from_logp
from . import vocab_block as torch_blocks
from .first_order import first_order
from .fused_policy_loss import BACKENDS, LOGITS_DTYPES, _check_row_inputs, apply_check_policy, check_weights
from .fused_policy_loss import backend_cannot_run, resolve_backend
from .loss_head_output import LossHeadOutput
from .loss_options import LossOptions, resolve_options
from .torch_policy_loss import finish_per_token
from .value_status import BAD_LOGITS, ValueStatus, input_status

# One [R, Vb] block of logits in the model's dtype takes at most this many bytes. The rows come first: every kept
# row in one chunk while a block of MIN_VOCAB_BLOCK columns fits, so the weight-gradient GEMM runs once per block
# over all rows (compute-bound) and is written once.
DEFAULT_BLOCK_BYTES = 256 * 2**20
MIN_VOCAB_BLOCK = 1024


def default_block_shape(kept_rows: int, vocab_size: int, dtype: torch.dtype) -> Tuple[int, int]:
    """``(R, Vb)``: rows per chunk and vocabulary columns per block for ``kept_rows`` rows when neither is given:
    every row while a ``[rows, min(V, MIN_VOCAB_BLOCK)]`` block fits in :data:`DEFAULT_BLOCK_BYTES`, then as many
    columns as fit (at least 1 each)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    narrowest = min(vocab_size, MIN_VOCAB_BLOCK)
    rows = max(1, min(kept_rows, DEFAULT_BLOCK_BYTES // (narrowest * itemsize)))
    return rows, block_columns(rows, vocab_size, dtype)


def block_columns(rows: int, vocab_size: int, dtype: torch.dtype) -> int:
    """Vocabulary columns of a ``[rows, Vb]`` block within :data:`DEFAULT_BLOCK_BYTES` (at least 1, at most V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, min(vocab_size, DEFAULT_BLOCK_BYTES // (max(rows, 1) * itemsize)))


def _check_linear_inputs(hidden, weight, bias, chunk_size, vocab_block, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a [N, H] tensor, got shape {getattr(hidden, 'shape', type(hidden))}")
    if hidden.dtype not in LOGITS_DTYPES:
        raise ValueError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    problem = backend_cannot_run(backend, hidden.device.type, installed_here=False)  # a missing package: ImportError
    if problem:
        raise ValueError(f"backend={backend!r} {problem}; use backend='auto'")
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
    for name, value in (("chunk_size", chunk_size), ("vocab_block", vocab_block)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")


def _block_logits(hidden_rows, weight, bias, cols: slice, buffer: torch.Tensor) -> torch.Tensor:
    """``hidden_rows @ weight[cols].T (+ bias[cols])`` written into ``buffer`` (reused from block to block: a fresh
    ``[R, Vb]`` allocation per block costs page faults on CPU and allocator traffic on GPU)."""
    w = weight[cols]
    out = buffer[: hidden_rows.shape[0] * w.shape[0]].view(hidden_rows.shape[0], w.shape[0])
    if bias is None:
        return torch.mm(hidden_rows, w.t(), out=out)
    return torch.addmm(bias[cols], hidden_rows, w.t(), out=out)


@dataclass(frozen=True)
class _Plan:
    """How one call walks its ``[K, V]`` logits: ``rows`` per chunk, ``cols`` per vocabulary block, the block ops
    (``ops.vocab_block`` or its Triton kernels) and the temperature."""

    rows: int
    cols: int
    triton: bool
    inv_temperature: float
    with_entropy: bool

    @property
    def ops(self):
        if self.triton:
            from .triton import vocab_block as triton_blocks

            return triton_blocks
        return torch_blocks

    def blocks(self, kept: int, vocab: int):
        """Every ``(row slice, column slice)`` block, rows outer: one row chunk's hidden states are reused across V."""
        for r0 in range(0, kept, self.rows):
            for c0 in range(0, vocab, self.cols):
                yield slice(r0, min(r0 + self.rows, kept)), slice(c0, min(c0 + self.cols, vocab))


def _row_stats(hidden_rows, weight, bias, labels, plan: _Plan) -> torch.Tensor:
    """``[4, K]`` fp32 per-row statistics (:mod:`~openrlhf_lopti.ops.vocab_block`) over every vocabulary block."""
    kept, vocab = hidden_rows.shape[0], weight.shape[0]
    stats = torch_blocks.new_stats(kept, hidden_rows.device)
    if kept == 0:
        return stats
    buffer = torch.empty(min(plan.rows, kept) * min(plan.cols, vocab), dtype=hidden_rows.dtype,
                         device=hidden_rows.device)  # fmt: skip
    for rows, cols in plan.blocks(kept, vocab):
        z = _block_logits(hidden_rows[rows], weight, bias, cols, buffer)
        plan.ops.update_block_stats(z, cols.start, labels[rows], stats[:, rows], plan.inv_temperature,
                                    plan.with_entropy)  # fmt: skip
    return stats


def _logp_entropy(stats: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``(logp, entropy, bad, row_max, log_sum)`` ``[K]`` each from the statistics (the kernel's formulas); ``bad``:
    the rows without a finite log-sum-exp (a NaN or +inf logit, only -inf, or an overflow at the temperature)."""
    row_max, s, t, label_z = stats
    log_sum = torch.log(s)
    bad = ~torch.isfinite(row_max + log_sum)
    return (label_z - row_max) - log_sum, log_sum - t / s, bad, row_max, log_sum


class _LinearLogProbs(torch.autograd.Function):
    """``(logp [K], entropy [K], bad [K])`` of the labels under ``softmax((hidden_rows @ W^T + b) / T)``, block by
    block (``bad``: :func:`_logp_entropy`); the backward recomputes each block once and turns it into its gradient
    (module docstring)."""

    @staticmethod
    def forward(ctx, hidden_rows, weight, bias, labels, plan):
        logp, entropy, bad, row_max, log_sum = _logp_entropy(_row_stats(hidden_rows, weight, bias, labels, plan))
        ctx.save_for_backward(hidden_rows, weight, bias, labels, row_max, log_sum, entropy)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(bad)
        return logp, entropy, bad

    @staticmethod
    @first_order("fused_linear_policy_loss", "compute the logits and call fused_policy_loss(backend='torch')")
    @once_differentiable
    def backward(ctx, g_logp, g_entropy, _g_bad):
        hidden_rows, weight, bias, labels, row_max, log_sum, entropy = ctx.saved_tensors
        plan = ctx.plan
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if (g_logp is None and g_entropy is None) or not (need_hidden or need_weight or need_bias):
            return None, None, None, None, None
        kept, vocab = hidden_rows.shape[0], weight.shape[0]
        g_logp = torch.zeros_like(row_max) if g_logp is None else g_logp.float().contiguous()
        g_entropy = None if g_entropy is None else g_entropy.float().contiguous()
        one_chunk = plan.rows >= kept
        grad_hidden = torch.zeros(hidden_rows.shape, dtype=torch.float32, device=weight.device) if need_hidden else None
        grad_weight = None
        if need_weight:  # written block by block when one row chunk covers every row, else summed in fp32
            grad_weight = torch.zeros_like(weight) if one_chunk else torch.zeros(weight.shape, dtype=torch.float32,
                                                                                  device=weight.device)  # fmt: skip
        grad_bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_bias else None
        buffer = torch.empty(min(plan.rows, kept) * min(plan.cols, vocab), dtype=hidden_rows.dtype,
                             device=hidden_rows.device) if kept else None  # fmt: skip
        for rows, cols in plan.blocks(kept, vocab):
            h = hidden_rows[rows]
            z = _block_logits(h, weight, bias, cols, buffer)
            d = plan.ops.block_grad_(z, cols.start, labels[rows], row_max[rows], log_sum[rows], entropy[rows],
                                     g_logp[rows], None if g_entropy is None else g_entropy[rows],
                                     plan.inv_temperature)  # fmt: skip
            if need_hidden:
                if d.dtype == torch.float32:
                    grad_hidden[rows].addmm_(d, weight[cols])
                else:  # the product in the model's dtype (fp32 inside the GEMM), the sum over blocks in fp32
                    grad_hidden[rows] += d @ weight[cols]
            if need_weight:
                if one_chunk:
                    torch.mm(d.t(), h, out=grad_weight[cols])
                elif d.dtype == torch.float32:
                    grad_weight[cols].addmm_(d.t(), h)
                else:
                    grad_weight[cols] += d.t() @ h
            if need_bias:
                grad_bias[cols] += d.sum(0, dtype=torch.float32)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden_rows.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
        )


def _plan(kept: int, weight: torch.Tensor, backend: str, chunk_size, vocab_block, temperature: float,
          with_entropy: bool) -> Tuple[_Plan, str]:  # fmt: skip
    """The call's :class:`_Plan` and the name of the backend its block ops run on (``"triton"`` or ``"torch"``:
    ``"cpp"`` has no block form, so CPU rows run the torch block ops)."""
    chosen = resolve_backend(backend, weight)
    rows, cols = default_block_shape(kept, weight.shape[0], weight.dtype)
    rows = chunk_size or rows
    cols = vocab_block or (cols if chunk_size is None else block_columns(rows, weight.shape[0], weight.dtype))
    triton = chosen == "triton"
    return _Plan(rows, cols, triton, 1.0 / temperature, with_entropy), "triton" if triton else "torch"


def _row_logits(hidden, weight, bias):
    """Row ``i`` -> its ``[V]`` logits, recomputed (only an error message asks for one)."""

    def logits(i: int) -> torch.Tensor:
        with torch.no_grad():
            row = hidden[i].detach() @ weight.detach().t()
            return row if bias is None else row + bias.detach()

    return logits


def _scatter(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """``[N]`` with ``values [K]`` at ``index`` and 0 elsewhere (differentiable)."""
    return values.new_zeros(n).index_copy(0, index, values)


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
    vocab_block: Optional[int] = None,
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
    check: str = "eager",
    loss_weights: Optional[torch.Tensor] = None,
    entropy_weights: Optional[torch.Tensor] = None,
    options: Optional[LossOptions] = None,
) -> LossHeadOutput:
    """:func:`~openrlhf_lopti.ops.fused_policy_loss` of the logits ``hidden @ weight.T + bias``, without ever
    holding those logits for all rows: the lm_head runs block by block, on the kept rows only.

    Args:
        hidden: ``[N, H]`` last hidden states (fp32 / bf16 / fp16), row i predicting ``labels[i]``.
        weight: ``[V, H]`` lm_head weight, same dtype and device as ``hidden`` (may be tied to the input
            embedding: its gradient adds to the embedding's).
        labels, old_log_probs, advantages, mask, ref_log_probs: ``[N]``, as in ``fused_policy_loss``; rows with
            mask 0 are never multiplied by the weight.
        bias: ``[V]`` lm_head bias or None; ``-inf`` entries make those tokens impossible.
        chunk_size: rows of the kept tokens per block; None: every kept row while the block fits
            (:func:`default_block_shape`).
        vocab_block: vocabulary columns per block; None: as many as fit in :data:`DEFAULT_BLOCK_BYTES`.
        alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, temperature, return_entropy, backend, check,
            loss_weights, entropy_weights, options: as in ``fused_policy_loss``. The backend runs the per-block
            statistics and gradients: Triton on a GPU (``"auto"`` after its self-check), torch on CPU (``"cpp"``
            has no block form: its rows run the torch block ops, and ``backend`` on the output says so).

    Returns:
        :class:`~openrlhf_lopti.ops.loss_head_output.LossHeadOutput` of fp32 ``[N]`` fields, equal to
        ``fused_policy_loss`` on the full logits. Gradients from ``loss``, ``logp`` and ``entropy`` (any per-token
        weights) or from ``reduced`` reach ``hidden`` (its dtype), ``weight`` and ``bias`` (in their dtypes).
        A second derivative (``create_graph=True``) raises ``RuntimeError`` at the backward (``ops/first_order.py``).

    Raises:
        ValueError: naming the argument, before any matmul: the checks and messages of ``fused_policy_loss`` for
            the per-token inputs and options, plus shape / dtype / device of ``hidden``, ``weight``, ``bias``,
            ``chunk_size`` and ``vocab_block``. Under ``check="eager"``, after the forward, as
            ``fused_policy_loss``: for the first unmasked row with a bad input, or whose logits hold a NaN or +inf,
            or only -inf (``"logits row i ..."``, ``i`` its row in ``hidden``).
    """
    settings = resolve_options(
        options, alpha=alpha, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, kl_coef=kl_coef,
        kl_estimator=kl_estimator, temperature=temperature, backend=backend, check=check,
    )  # fmt: skip
    _check_linear_inputs(hidden, weight, bias, chunk_size, vocab_block, settings.backend)
    n, v = hidden.shape[0], weight.shape[0]
    _check_row_inputs(n, v, hidden.device, "hidden [N, H]", labels, old_log_probs, advantages, mask, ref_log_probs,
                      settings)  # fmt: skip
    check_weights(n, hidden.device, loss_weights, entropy_weights, False)
    with_entropy = return_entropy or entropy_weights is not None
    index = mask.bool().nonzero().squeeze(1)  # the kept rows: one host sync, to size the blocks
    plan, ran = _plan(index.numel(), weight, settings.backend, chunk_size, vocab_block, settings.temperature,
                      with_entropy)  # fmt: skip
    kept_labels = labels.index_select(0, index).contiguous()
    logp, entropy, bad = _LinearLogProbs.apply(hidden.index_select(0, index), weight, bias, kept_labels, plan)
    # constants of the loss (detached), as on fused_policy_loss's backends: only logp carries a gradient
    kept = lambda x: None if x is None else x.detach().index_select(0, index)  # noqa: E731
    per_token = policy_loss_from_logp(
        logp, kept(old_log_probs), kept(advantages), None, ref_log_probs=kept(ref_log_probs), alpha=settings.alpha,
        eps_low=settings.eps_low, eps_high=settings.eps_high, dual_clip=settings.dual_clip, kl_coef=settings.kl_coef,
        kl_estimator=settings.kl_estimator,
    )  # fmt: skip
    per_token.loss, per_token.logp, per_token.kl = (_scatter(x, index, n) for x in (per_token.loss, logp, per_token.kl))
    per_token.clipped = torch.zeros(n, dtype=torch.bool, device=hidden.device).index_copy(0, index, per_token.clipped)
    per_token.entropy = _scatter(entropy, index, n) if with_entropy else None
    bad_rows = torch.zeros(n, dtype=torch.bool, device=hidden.device).index_copy(0, index, bad)
    out = finish_per_token(
        per_token, bad_rows, v, labels, old_log_probs, advantages, mask, ref_log_probs, settings.temperature,
        loss_weights, entropy_weights, ran, _row_logits(hidden, weight, bias),
    )  # fmt: skip
    if not return_entropy:
        out.entropy = None
    return apply_check_policy(out, settings.check)


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
    vocab_block: Optional[int] = None,
    backend: str = "auto",
) -> tuple:
    """Log-probs (and entropy) of ``softmax((hidden @ weight.T + bias) / temperature)`` for the forward-only
    passes (old-policy and reference log-probs), block by block, with no autograd graph.

    Args:
        hidden: ``[N, H]`` last hidden states; weight ``[V, H]``; bias ``[V]`` or None (as
            :func:`fused_linear_policy_loss`).
        labels: ``[N]`` token ids, in ``[0, V)`` on kept rows.
        mask: ``[N]`` bool or 0/1, or None (all rows); rows with 0 are skipped and give 0.
        temperature: > 0, the sampling temperature.
        return_entropy: also compute the per-row entropy (nats).
        chunk_size, vocab_block, backend: as :func:`fused_linear_policy_loss`.

    Returns:
        ``(logp, entropy)``: fp32 ``[N]`` (nats) and fp32 ``[N]`` or None; detached.

    Raises:
        ValueError: the same checks and messages as :func:`fused_linear_policy_loss` (a label outside ``[0, V)`` or
            a logits row without a finite log-sum-exp on a kept row included: read at once, one host read after the
            blocks, since a forward-only pass has no optimizer step to wait for).
    """
    _check_linear_inputs(hidden, weight, bias, chunk_size, vocab_block, backend)
    n, v = hidden.shape[0], weight.shape[0]
    keep = torch.ones(n, dtype=torch.bool, device=hidden.device) if mask is None else mask
    zeros = torch.zeros(n, dtype=torch.float32, device=hidden.device)  # the loss's inputs are unused here
    _check_row_inputs(n, v, hidden.device, "hidden [N, H]", labels, zeros, zeros, keep, None,
                      LossOptions(temperature=temperature))  # fmt: skip
    index = keep.bool().nonzero().squeeze(1)
    plan, _ = _plan(index.numel(), weight, backend, chunk_size, vocab_block, temperature, return_entropy)
    with torch.no_grad():
        kept_labels = labels.index_select(0, index).contiguous()
        stats = _row_stats(hidden.detach().index_select(0, index), weight.detach(),
                           None if bias is None else bias.detach(), kept_labels, plan)  # fmt: skip
        logp, entropy, bad, _, _ = _logp_entropy(stats)
        rows = input_status(labels, zeros, zeros, keep.bool(), None, v)
        rows[index] |= torch.where(bad, BAD_LOGITS, 0).to(torch.int32)
        # a forward-only pass: read at once
        ValueStatus.of_rows(rows, v, temperature, _row_logits(hidden, weight, bias)).raise_if_bad()
    return _scatter(logp, index, n), _scatter(entropy, index, n) if return_entropy else None
