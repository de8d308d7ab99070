"""``openrlhf-lopti tiny-model --out DIR``: a random tiny Llama and tokenizer for dry runs of the real pipeline.

The directory is an ordinary Hugging Face checkpoint (``from_pretrained`` loads it, OpenRLHF and
``--cpu`` take it as ``--actor.model_name_or_path``). Its tokenizer is a byte-level BPE trained here on
Knights-and-Knaves text (chat-templated prompts of 2-8 people, ``<think>``/``<answer>`` responses), so it can
write any string, and every K&K word (names, roles, connectives, tags, list markers) is one or a few tokens.
It has a ChatML chat template (``--data.apply_chat_template``) whose end-of-turn token is the eos. The
weights are random: rewards are near the format floor, which is what a dry run needs.

A dry run checks the pipeline, not the method: a random model samples every token at p of about 1/vocabulary,
below any Lopti eta, so every token is in the low phase and the high phase trains nothing: its metrics are zeros
(half the optimizer steps of a TRL run log zeros). A quantile threshold (OpenRLHF ``--algo.lopti.quantile``, TRL
``lopti_quantile``, verl ``policy_loss.lopti_quantile``) or a warmed-up model puts tokens in both phases.

The builders: :func:`build_tiny_llama` (a random ``LlamaForCausalLM`` sized for any tokenizer),
:func:`build_word_tokenizer` (the demo's word-level vocabulary, one id per compact K&K word: the demo and the
audit warm it up), :func:`build_kk_tokenizer` (the byte-level BPE above) and :func:`build_tiny_model` (both).
"""

import sys
from pathlib import Path
from typing import Optional

import torch

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command
from openrlhf_lopti.local.task import COMPACT_WORDS
from openrlhf_lopti.tasks import kk

SPECIALS = {"pad": "<|endoftext|>", "bos": "<|im_start|>", "eos": "<|im_end|>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The word-level tokenizer's special tokens (ids 0-3).
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
        hidden_size: width (``num_heads`` heads of an even size, for the rotary embedding); MLP width is
            ``2 * hidden_size``.
        num_layers, num_heads: depth and attention heads.
        max_positions: longest prompt + response, tokens.
        seed: torch seed of the initialisation.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if (hidden_size // num_heads) % 2:  # the rotary embedding rotates pairs of dimensions
        raise ValueError(f"hidden_size / num_heads ({hidden_size} / {num_heads}) must be an even head size")
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


def kk_corpus(puzzles_per_size: int = 40, seed: int = 0) -> list:
    """Chat-templated K&K prompts and ``<think>..</think> <answer>..</answer>`` solutions, 2 to 8 people."""
    texts = []
    for people in range(2, 9):
        for i in range(puzzles_per_size):
            puzzle = kk.generate(people, seed * 100_003 + people * 1_000 + i)
            for message in kk.make_prompt(puzzle):
                texts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
            texts.append(
                f"<|im_start|>assistant\n<think> {puzzle['quiz']} </think>\n"
                f"<answer>\n{puzzle['solution_text_format']}\n</answer><|im_end|>"
            )
    return texts


def build_kk_tokenizer(vocab_size: Optional[int] = None, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of ``vocab_size`` ids trained on :func:`kk_corpus`
    (``None``: every id BPE learns from that text, 748 for seed 0).

    Byte-level: every string round-trips (``decode(encode(s)) == s``), K&K words as single or few tokens.

    Raises:
        ValueError: ``vocab_size`` is more ids than the text yields (BPE would silently give fewer).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size or 1 << 20,  # None: merge until no pair is left
        special_tokens=list(SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(kk_corpus(seed=seed), trainer=trainer)
    if vocab_size is not None and core.get_vocab_size() < vocab_size:
        raise ValueError(f"the K&K text yields at most {core.get_vocab_size()} BPE ids, not {vocab_size}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIALS["pad"],
        bos_token=SPECIALS["bos"],
        eos_token=SPECIALS["eos"],
        chat_template=CHAT_TEMPLATE,
    )
    return tokenizer


def build_tiny_model(hidden_size: int = 64, num_layers: int = 2, num_heads: int = 2, max_positions: int = 1024,
                     vocab_size: Optional[int] = None, seed: int = 0):  # fmt: skip
    """``(model, tokenizer)``: the demo's random ``LlamaForCausalLM`` (tied embeddings) sized for
    :func:`build_kk_tokenizer`. The default head size, 64 / 2 = 32, is the smallest vLLM's CPU attention takes
    (``--cpu`` rollouts: 32, 64, 80, 96, 112, 128, ...; it refuses 16)."""
    tokenizer = build_kk_tokenizer(vocab_size, seed)
    return build_tiny_llama(tokenizer, hidden_size, num_layers, num_heads, max_positions, seed), tokenizer


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="openrlhf-lopti tiny-model", description=__doc__.split("\n\n")[0],
                       epilog=__doc__.split("\n\n")[2].replace("``", "`"))  # the dry run's warning
    p.add_argument("--out", required=True, help="directory to write (must not exist or be empty)")
    p.add_argument("--hidden-size", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--heads", type=int, default=2,
                   help="attention heads (default 2: head size 32, the smallest vLLM's CPU attention takes)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="BPE vocabulary size, at most what the K&K text yields (default: all of it, 748 ids)")
    p.add_argument("--max-positions", type=int, default=1024, help="context length, tokens (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tokenizer corpus and the weights")
    return p


# The fewest ids a byte-level BPE has: its 256 byte tokens and the special tokens.
MIN_VOCAB_SIZE = 256 + len(SPECIALS)


def check_head_size(hidden_size: int, heads: int, hidden_flag: str = "--hidden-size", heads_flag: str = "--heads") -> None:
    """Refuse a width and head count whose head size (``hidden_size / heads``) Llama's rotary embedding cannot take
    (it rotates pairs of dimensions: the head size must be a whole, even number)."""
    if hidden_size % heads:
        raise UserError(f"{hidden_flag} {hidden_size}: must be divisible by {heads_flag} ({heads})")
    if (hidden_size // heads) % 2:
        raise UserError(f"{hidden_flag} {hidden_size}: with {heads_flag} {heads} the head size is "
                        f"{hidden_size // heads}, which Llama's rotary embedding cannot take: give a head size that "
                        f"is even (e.g. {hidden_flag} {hidden_size + heads})")  # fmt: skip


def main(argv: Optional[list] = None) -> int:
    from openrlhf_lopti.local.config import SEED_LIMIT
    from openrlhf_lopti.runs import check_can_write

    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {str(out)!r} exists and is not an empty folder: choose a new path")
    for flag, value in (("--hidden-size", args.hidden_size), ("--layers", args.layers), ("--heads", args.heads),
                        ("--vocab-size", args.vocab_size), ("--max-positions", args.max_positions)):  # fmt: skip
        if value is not None and value < 1:
            raise UserError(f"{flag} must be an integer >= 1, got {value}")
    check_head_size(args.hidden_size, args.heads)
    if args.vocab_size is not None and args.vocab_size < MIN_VOCAB_SIZE:
        raise UserError(f"--vocab-size {args.vocab_size}: must be at least {MIN_VOCAB_SIZE} (the byte-level BPE's 256 "
                        f"byte tokens and {len(SPECIALS)} special tokens), or leave it out for every id")  # fmt: skip
    if not abs(args.seed) < SEED_LIMIT:
        raise UserError(f"--seed {args.seed}: must be an integer with |seed| < 2**40")
    check_can_write(out)  # before the tokenizer is trained and the model built
    try:
        model, tokenizer = build_tiny_model(
            args.hidden_size, args.layers, args.heads, args.max_positions, args.vocab_size, args.seed
        )
    except ValueError as exc:
        raise UserError(f"--vocab-size {args.vocab_size}: {exc}; ask for at most that many") from None
    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except OSError as e:  # the folder went away or filled up while the model was built
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny-model: {params / 1e6:.2f} M parameters, head size {args.hidden_size // args.heads}, "
          f"vocabulary {len(tokenizer)}, saved to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("openrlhf-lopti tiny-model", main, sys.argv[1:]))
