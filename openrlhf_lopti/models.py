"""Model helpers that more than one front end needs (local/, openrlhf/, trl/): below all of them, above nothing.

Only torch is imported; the model is any Hugging Face causal LM (``get_output_embeddings``, ``config``).
"""

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

# config attributes by which a model transforms its logits (or the hidden states the head reads) outside the output
# layer, with the value that means "no transform": Gemma / nanochat's, RecurrentGemma's and xLSTM's soft caps,
# Cohere's scale, Granite's divisor, Falcon-H1's and MuseGlimmer's multipliers, Inkling's muP divisor
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,
    "logits_soft_cap": None,
    "output_logit_soft_cap": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "lm_head_multiplier": 1.0,
    "output_multiplier": 1.0,
    "logits_mup_width_multiplier": 1.0,
}


def lm_head_parts(model, flag: str = "--fused-lm-head") -> tuple:
    """``(weight [V, H], bias [V] or None)`` of a causal LM's output layer, for the fused lm_head (``flag``: how the
    user switched it on, named in the error: the local trainer's ``--fused-lm-head`` by default).

    With tied embeddings the weight IS the input embedding (the same parameter), so the loss's gradient
    reaches it exactly as through the model's own lm_head.

    Raises:
        ValueError: the output layer is not a linear layer, or the model transforms its logits after it.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{flag} needs a torch.nn.Linear output layer, got {type(head).__name__}")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise ValueError(
                f"{flag} does not support models that transform their logits ({name}={value!r}); "
                f"run without {flag}"
            )
    return head.weight, head.bias


@contextmanager
def output_layer_runs(
    model, on_hidden: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor], flag: str
) -> Iterator[None]:
    """Inside: ``model``'s output layer returns ``on_hidden(hidden [..., H], weight [V, H], bias [V] or None)`` in
    place of its ``[..., V]`` logits, so a forward of the model (or of the DDP / FSDP / DeepSpeed engine around it)
    never makes them.

    The call runs inside the layer, where a wrapper has the weight ready (ZeRO-3 and FSDP gather it for the layer;
    the weight is read at each call, since FSDP2 swaps the parameter in for it), and what it returns flows out of the
    model as its logits, so the wrapper's backward hooks on the outputs see the loss's gradient. ``flag``: how the
    user asked for it, named by :func:`lm_head_parts`'s errors (raised on entry).
    """
    lm_head_parts(model, flag=flag)
    layer = model.get_output_embeddings()
    own_forward = layer.__dict__.get("forward")  # an instance-level forward someone else set, kept
    layer.forward = lambda hidden: on_hidden(hidden, layer.weight, layer.bias)
    try:
        yield
    finally:
        if own_forward is None:
            del layer.forward  # back to the class's forward
        else:
            layer.forward = own_forward
