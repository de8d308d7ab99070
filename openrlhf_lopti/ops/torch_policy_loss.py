"""The ``"torch"`` backend of ``fused_policy_loss``: the reference (``algo.policy_loss_and_bad_rows``) with the value
checks as status bits, and what the backends that compute per-token outputs first share (:func:`finish_per_token`).
"""

from typing import Callable, Optional

import torch

from ..algo import PolicyLossOutput
from ..algo.policy_loss import policy_loss_and_bad_rows
from .loss_head_output import LossHeadOutput
from .value_status import BAD_LOGITS, ValueStatus, input_status


class _NanGradientOnRows(torch.autograd.Function):
    """Zeros ``[N]`` in the forward; in the backward, NaN for the input's flagged rows (0 on the others). Added to the
    loss, it makes a flagged row's gradient NaN whatever the loss does with it: a NaN times the loss would not, since
    autograd's backward of a clamp or a min that binds sends 0, not NaN (a clipped ratio, a NaN old log-prob)."""

    @staticmethod
    def forward(ctx, logp: torch.Tensor, flagged: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(flagged)
        return torch.zeros_like(logp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (flagged,) = ctx.saved_tensors
        return torch.where(flagged, float("nan"), 0.0).to(grad.dtype), None


def finish_per_token(
    out: PolicyLossOutput,
    bad_logit_rows: torch.Tensor,
    vocab_size: int,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_log_probs: Optional[torch.Tensor],
    temperature: float,
    loss_weights: Optional[torch.Tensor],
    entropy_weights: Optional[torch.Tensor],
    backend: str,
    row_logits: Optional[Callable[[int], torch.Tensor]] = None,
    nan_gradient: bool = True,
) -> LossHeadOutput:
    """A per-token backend's output (``out``, ``[N]`` fields with autograd) as a :class:`LossHeadOutput`.

    Adds the status bits (the inputs' and ``bad_logit_rows [N]`` bool, what the backend found in its pass over the
    ``[N, vocab_size]`` logits; ``row_logits`` gives row ``i``'s for the message, when it can), NaN in ``loss``,
    ``logp`` and ``kl`` of every flagged row and in its gradient (:class:`_NanGradientOnRows`, as the Triton
    kernel's; ``nan_gradient=False`` where the backend's own backward writes it), and with ``loss_weights`` the
    reduced scalar, the only field left with a gradient. No host sync.
    """
    keep = mask.bool()
    rows = input_status(labels, old_log_probs, advantages, keep, ref_log_probs, vocab_size)
    rows = rows | torch.where(keep & bad_logit_rows, BAD_LOGITS, 0).to(torch.int32)
    poison = torch.where(rows != 0, float("nan"), 1.0).float()
    loss, logp, kl = out.loss * poison, out.logp * poison, out.kl * poison
    if nan_gradient and out.logp.requires_grad:  # through the log-prob: NaN on flagged rows, even where the loss clamps
        loss = loss + _NanGradientOnRows.apply(out.logp, rows != 0)
    entropy = out.entropy
    reduced = None
    if loss_weights is not None:
        reduced = torch.dot(loss_weights.float(), loss)
        if entropy_weights is not None:
            reduced = reduced + torch.dot(entropy_weights.float(), entropy)
        loss, logp = loss.detach(), logp.detach()
        entropy = None if entropy is None else entropy.detach()
    return LossHeadOutput(
        loss=loss, logp=logp, kl=kl, clipped=out.clipped, entropy=entropy, reduced=reduced, backend=backend,
        status=ValueStatus.of_rows(rows, vocab_size, temperature, row_logits),
    )  # fmt: skip


def torch_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_weights: Optional[torch.Tensor] = None,
    entropy_weights: Optional[torch.Tensor] = None,
    grad_in_logits: bool = False,
    **options,
) -> LossHeadOutput:
    """The ``"torch"`` backend (inputs' shapes and options checked by ``fused_policy_loss``): eager torch with fp32
    ``[N, V]`` temporaries. ``options`` as :func:`openrlhf_lopti.algo.policy_loss_from_logits`; ``grad_in_logits``
    is accepted and ignored (autograd owns the gradient's buffer here)."""
    # old / ref log-probs and advantages are constants of the loss, as on the cpp and triton backends (a gradient
    # through an undetached old_log_probs would cancel the policy gradient's ratio, silently)
    if options.get("ref_log_probs") is not None:
        options["ref_log_probs"] = options["ref_log_probs"].detach()
    out, bad_rows = policy_loss_and_bad_rows(logits, labels.long().clamp(0, max(logits.shape[1] - 1, 0)),
                                             old_log_probs.detach(), advantages.detach(), mask, **options)  # fmt: skip
    return finish_per_token(
        out, bad_rows, logits.shape[1], labels, old_log_probs, advantages, mask, options.get("ref_log_probs"),
        options.get("temperature", 1.0), loss_weights, entropy_weights, "torch", logits.__getitem__,
    )  # fmt: skip
