"""Models without downloads: the demo's word-level tokenizer and tiny Llama, and loading any local HF model.

A demo model directory is an ordinary Hugging Face checkpoint (``save_pretrained`` of both the model and
the tokenizer) plus ``lopti_local.json``, which records the prompt style it was trained on, so that
``--model PATH`` gives it compact prompts and any other model gets chat/text prompts.
"""

import json
import os
from pathlib import Path
from typing import Optional

import torch

from openrlhf_lopti.errors import check_model_dir
from openrlhf_lopti.models import lm_head_parts  # noqa: F401 - moved below local/, openrlhf/ and trl/

from .task import COMPACT_WORDS

MARKER_FILE = "lopti_local.json"
SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def build_word_tokenizer(words: tuple = COMPACT_WORDS):
    """A ``PreTrainedTokenizerFast`` with one id per whitespace-separated word (ids 0-3 are special).

    Text is split on whitespace only, so prompts and responses must separate every word with a space;
    decoding joins words with single spaces. Unknown words map to ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(dict.fromkeys([*SPECIAL_TOKENS.values(), *words]))}
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder with an unused prefix just joins tokens with spaces, without cleanup rules.
    core.decoder = decoders.WordPiece(prefix="\x00", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        unk_token=SPECIAL_TOKENS["unk"],
    )
    tokenizer.padding_side = "left"  # generation needs prompts aligned on the right
    return tokenizer


def build_tiny_llama(
    tokenizer, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4, max_positions: int = 256, seed: int = 0
):
    """A randomly initialised ``LlamaForCausalLM`` sized for the tokenizer (about 0.35 M parameters by default).

    Args:
        tokenizer: supplies ``len(tokenizer)`` and the pad/bos/eos ids.
        hidden_size: width (must be divisible by ``num_heads``); MLP width is ``2 * hidden_size``.
        num_layers, num_heads: depth and attention heads.
        max_positions: longest prompt + response, tokens.
        seed: torch seed of the initialisation.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# Config fields of HF models whose logits are not just lm_head(hidden) (Gemma 2's soft cap, Cohere's and
# Granite's scales): the fused lm_head would silently compute other logits, so it refuses them.
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
