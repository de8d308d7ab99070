"""Loading and saving any local Hugging Face causal LM for the trainer (the demo's tiny models are built in
:mod:`openrlhf_lopti.demo.tiny_model`).

A model directory written by :func:`save_model` is an ordinary Hugging Face checkpoint (``save_pretrained`` of
both the model and the tokenizer) plus ``lopti_local.json``, which records the prompt style it was trained on,
so that ``--model PATH`` gives it compact prompts and any other model gets chat/text prompts.
"""

import json
import os
from pathlib import Path
from typing import Optional

import torch

from openrlhf_lopti.runs import check_model_dir

MARKER_FILE = "lopti_local.json"


def quiet_transformers() -> None:
    """Hide transformers' per-file progress bars ("Loading weights", "Writing model shards") in our CLIs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def save_model(model, tokenizer, path: str | os.PathLike, prompt_style: Optional[str] = None) -> None:
    """``save_pretrained`` model and tokenizer into ``path`` atomically (a sibling temp dir, then rename).

    ``prompt_style`` is recorded in ``lopti_local.json`` for :func:`load_model`.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        _rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if prompt_style is not None:
        (tmp / MARKER_FILE).write_text(json.dumps({"prompt_style": prompt_style}) + "\n")
    if path.exists():  # rename cannot replace a non-empty directory: move the old one aside first
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        _rmtree(old)
    else:
        os.replace(tmp, path)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def load_model(path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Load any local HF causal LM and its tokenizer for generation and training.

    Returns:
        ``(model, tokenizer, prompt_style)``: the model on ``device`` in ``dtype`` (eval mode, as loaded),
        the tokenizer padded on the left (its pad token is the eos token if it had none), and the
        prompt style recorded by :func:`save_model` or None.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = check_model_dir(str(path))  # a clear error instead of transformers' advice to install sentencepiece
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    marker = path / MARKER_FILE
    style = json.loads(marker.read_text()).get("prompt_style") if marker.exists() else None
    return model, tokenizer, style
