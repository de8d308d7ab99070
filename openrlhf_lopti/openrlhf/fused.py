"""Our kernels inside OpenRLHF's ``Actor``: the logits rows of a batch, and hooks that hand the kernels the model's
logits in their own dtype, or (``--actor.fused_lm_head``) its last hidden states and output layer, instead of the
fp32 ``[N, V]`` copy ``Actor.forward`` makes.

Used by the training step (``trainer.LoptiActorPPOTrainer._fused_policy_loss``) and by the forward-only passes
of experience making (:func:`fused_log_probs`: the old-policy and reference log-probs).
"""

import inspect
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Optional

import torch

from openrlhf_lopti.models import lm_head_parts, output_layer_runs  # noqa: F401 - lm_head_parts: for the trainer
from openrlhf_lopti.ops import fused_policy_loss, linear_log_probs


class ActionRows:
    """The rows of a batch's logits (one per position, or per non-padding position when samples are packed) and
    the maps between them and upstream's ``[B, A]`` action tensors.

    Args:
        sequences: ``[B, S]`` prompt + response token ids; row ``t`` of the logits predicts token ``t + 1``.
        attention_mask: ``[B, S]``; packed rows are its nonzero positions in row-major order (flash-attn's
            ``unpad_input``).
        action_mask: ``[B, A]`` response tokens (the last ``A`` positions).
        packed: whether the actor packs samples (``--ds.packing_samples``).
    """

    def __init__(self, sequences: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor, packed: bool):
        self.batch, self.seqlen = sequences.shape
        self.actions = slice(self.seqlen - action_mask.shape[1] - 1, self.seqlen - 1)  # rows predicting actions
        self.indices = torch.nonzero(attention_mask.flatten()).flatten() if packed else None
        labels = torch.roll(sequences, shifts=-1, dims=1).flatten()
        self.labels = labels if self.indices is None else labels[self.indices]  # [R]
        self.mask = self.rows(action_mask.bool())  # [R]

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, A]`` -> ``[R]``: one value per logits row, zeros on rows that predict no action."""
        full = values.new_zeros(self.batch, self.seqlen)
        full[:, self.actions] = values
        return full.flatten() if self.indices is None else full.flatten()[self.indices]

    def positions(self, values: torch.Tensor) -> torch.Tensor:
        """``[R]`` -> ``[B, S]`` (zeros at padding when packed)."""
        if self.indices is not None:
            values = values.new_zeros(self.batch * self.seqlen).index_put((self.indices,), values)
        return values.reshape(self.batch, self.seqlen)

    def to_actions(self, values: torch.Tensor) -> torch.Tensor:
        """``[R]`` -> ``[B, A]``."""
        return self.positions(values)[:, self.actions]


def hf_model(actor) -> torch.nn.Module:
    """The Hugging Face model of an OpenRLHF ``Actor`` (inside its DeepSpeed engine once prepared)."""
    return actor.model.module if hasattr(actor.model, "module") else actor.model


@contextmanager
def head_to_kernels(
    actor,
    lm_head: bool,
    on_logits: Callable[[torch.Tensor], object],
    on_hidden: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
) -> Iterator[dict]:
    """For the ``actor`` forwards inside: the model's output feeds our kernels, and ``Actor.forward`` gets empty logits.

    Without ``lm_head``, a forward hook on ``actor.model`` (the DeepSpeed engine in training: hooking it keeps the
    gradient hooks the engine puts on its outputs) stores ``on_logits(logits)`` as ``found["result"]``, given the
    model's ``[..., V]`` logits in their own dtype. With ``lm_head``, the output layer's forward becomes
    ``on_hidden(hidden [..., H], weight [V, H], bias)`` (:func:`~openrlhf_lopti.models.output_layer_runs`), which
    returns a ``[..., k]`` tensor of per-position values in place of the logits (so the ``[N, V]`` logits are never
    made); it comes back as ``found["columns"]``. Flowing out of the layer, those values carry DeepSpeed's hooks:
    under ZeRO-3 the weight is gathered for the backward too and its gradient reaches the partitioned parameter.
    Either way ``output.logits`` is then replaced by an empty ``[..., 0]`` tensor, on which ``Actor.forward``'s fp32
    upcast and temperature divide cost nothing.
    """
    found: dict = {}

    def take_logits(module, args, output):
        if lm_head:
            found["columns"] = output["logits"]
        else:
            found["result"] = on_logits(output["logits"])
        logits = output["logits"]
        output["logits"] = logits.new_empty((*logits.shape[:-1], 0))  # survives .to(float32) and .div_
        return output

    layer = output_layer_runs(hf_model(actor), on_hidden, flag="--actor.fused_lm_head") if lm_head else nullcontext()
    with layer:
        handle = actor.model.register_forward_hook(take_logits)
        try:
            yield found
        finally:
            handle.remove()


@contextmanager
def fused_log_probs(actor, backend: str, lm_head: bool) -> Iterator[None]:
    """The forward-only passes (``PolicyModelActor.forward``, ``ReferenceModelActor.forward``) with our kernels.

    Upstream's ``Actor.forward(sequences, action_mask, attention_mask, ...)`` upcasts the ``[N, V]`` logits to
    fp32 for ``log_probs_from_logits``; inside this context it returns the same ``[B, A]`` action log-probs
    (times ``action_mask``), computed by ``fused_policy_loss``'s forward on the logits in their own dtype, or by
    ``linear_log_probs`` from the last hidden states (``lm_head``), divided by ``actor.temperature`` as upstream.
    """
    call: dict = {}

    def logits_only(module, args, kwargs):
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        call["rows"] = ActionRows(
            bound.arguments["sequences"], bound.arguments["attention_mask"], bound.arguments["action_mask"],
            getattr(actor, "packing_samples", False),
        )  # fmt: skip
        call["action_mask"], call["return_output"] = bound.arguments["action_mask"], bound.arguments["return_output"]
        bound.arguments.update(action_mask=None, return_output=True, return_entropy=False)
        return bound.args, bound.kwargs

    def on_logits(logits: torch.Tensor) -> torch.Tensor:
        rows = call["rows"]
        zeros = rows.mask.new_zeros(rows.mask.shape, dtype=torch.float32)
        out = fused_policy_loss(
            logits.reshape(-1, logits.shape[-1]), rows.labels, zeros, zeros, rows.mask,
            temperature=actor.temperature, backend=backend,
        )  # fmt: skip
        return out.logp

    def on_hidden(hidden: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        rows = call["rows"]
        logp, _ = linear_log_probs(
            hidden.reshape(-1, hidden.shape[-1]), weight, rows.labels, bias=bias, mask=rows.mask,
            temperature=actor.temperature, backend=backend,
        )  # fmt: skip
        return logp.reshape(*hidden.shape[:-1], 1)

    def action_log_probs(module, args, kwargs, output):
        rows = call.pop("rows")
        logp = found["result"] if "result" in found else found.pop("columns").reshape(-1)
        found.pop("result", None)
        log_probs = rows.to_actions(logp) * call["action_mask"].float()
        return (log_probs, output) if call["return_output"] else log_probs

    with head_to_kernels(actor, lm_head, on_logits, on_hidden) as found:
        handles = [
            actor.register_forward_pre_hook(logits_only, with_kwargs=True),
            actor.register_forward_hook(action_log_probs, with_kwargs=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
