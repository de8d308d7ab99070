"""Model helpers that more than one front end needs (local/, openrlhf/, trl/): below all of them, above nothing.

Only torch is imported; the model is any Hugging Face causal LM (``get_output_embeddings``, ``config``).
"""

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

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
    _check_no_logit_transform(config, flag)
    return head.weight, head.bias


def _check_no_logit_transform(config: Any, flag: str) -> None:
    """Raise ``ValueError`` naming ``flag`` if ``config`` (a model's config, or its config.json as a dict) transforms
    the logits outside the output layer."""
    for name, neutral in _LOGIT_TRANSFORMS.items():
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None and value != neutral:
            raise ValueError(
                f"{flag} does not support models that transform their logits ({name}={value!r}); "
                f"run without {flag}"
            )


def check_saved_model_fusable(path: str, flag: str) -> None:
    """Raise :func:`lm_head_parts`'s ``ValueError`` before any model is loaded, when ``path`` is a local folder whose
    config.json (its ``text_config``, for a multimodal model) names a logit transform.

    Why: a launcher's parse-time check, so that a run that cannot fuse stops before minutes of start-up. A hub id, or
    a folder without a readable config.json, is left to :func:`lm_head_parts` once the model is loaded; nothing of the
    model's own code is run.
    """
    if not path:  # no model named (upstream's own checks say so); Path("") would read the working folder's file
        return
    try:
        saved = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):  # not a local model folder, or a file transformers' own load will report
        return
    if isinstance(saved, dict):
        text = saved.get("text_config")
        _check_no_logit_transform(text if isinstance(text, dict) else saved, flag)


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
