"""The K&K task as the local trainer sees it: puzzles per step, prompt strings, rewards.

Puzzles and rewards come from :mod:`openrlhf_lopti.tasks.kk` (the paper's rule, the same code the
OpenRLHF reward file calls). This module only decides which puzzles a step sees and how a prompt is
written for a given model:

- ``"compact"``: one line of words for the demo's word-level model, e.g.
  ``Alice says : Bruno is a knave . Bruno says : Alice is a knight and Bruno is a knave .``
  Its target response (used by the warm-up) is
  ``<think> </think> <answer> (1) Alice is a knave (2) Bruno is a knight </answer>``;
- ``"chat"``: ``kk.make_prompt`` through the tokenizer's chat template (instruct models);
- ``"text"``: ``kk.make_prompt`` as plain text (base models without a chat template).
"""

from typing import Sequence

from openrlhf_lopti.errors import UserError
from openrlhf_lopti.tasks import kk, messages_to_text

PROMPT_STYLES = ("auto", "compact", "chat", "text")

# Disjoint seed ranges, so that warm-up, RL and evaluation never share a puzzle seed.
EVAL_SEED_BASE = 0
VALID_SEED_BASE = 5_000_000  # the warm-up's stopping check
WARMUP_SEED_BASE = 10_000_000
TRAIN_SEED_BASE = 100_000_000
SEEDS_PER_RUN = 10_000_000

# Every word a compact prompt or response can contain (checked by tests/test_local_task.py).
COMPACT_WORDS = (
    ("says", ":", ".", "is", "a", "knight", "knave", "it", "false", "that", "and", "or", "if", "then", "only")
    + ("<think>", "</think>", "<answer>", "</answer>")
    + tuple(f"({i})" for i in range(1, 9))
    + tuple(kk.NAMES)
)


def compact_prompt(record: dict) -> str:
    """The demo model's prompt: every statement as ``Name says : <statement> .``, space-separated words."""
    statements = kk.parse_statements(record["statements"])
    names = record["names"]
    return " ".join(f"{name} says : {kk.render_statement(s, names)} ." for name, s in zip(names, statements))


def compact_solution(record: dict) -> str:
    """The ideal compact response: an empty think block, then one ``(i) Name is a knight|knave`` per person.

    The think block stays empty: a 2-layer model gets no better with a chain of thought in a minute of
    warm-up on 2 CPU cores, and a short response keeps each RL step cheap.
    """
    lines = " ".join(
        f"({i + 1}) {name} is a {'knight' if knight else 'knave'}"
        for i, (name, knight) in enumerate(zip(record["names"], record["solution"]))
    )
    return f"<think> </think> <answer> {lines} </answer>"


def puzzles(seed_base: int, start: int, count: int, people: Sequence[int]) -> list[dict]:
    """``count`` K&K records with seeds ``seed_base + start + i``; sizes cycle through ``people``.

    Deterministic in its arguments, so a resumed run sees exactly the puzzles it would have seen.
    """
    if not people:
        raise ValueError("people must list at least one puzzle size")
    return [kk.generate(people[i % len(people)], seed_base + i) for i in range(start, start + count)]


def people_sizes(text: str) -> list[int]:
    """``"3,4,5"`` -> ``[3, 4, 5]``; a trailing comma is allowed, an empty entry inside (``3,,4``: a size lost in
    typing) or a non-integer raises ``ValueError``. The sizes' range is the caller's check."""
    body = str(text).strip().removesuffix(",")
    parts = body.split(",") if body else []
    if any(not p.strip() for p in parts):
        raise ValueError(f"empty entry in {text!r}")
    return [int(p) for p in parts]


def train_puzzles(run_seed: int, step: int, count: int, people: Sequence[int]) -> list[dict]:
    """The ``count`` prompts of RL step ``step`` (0-based) of a run seeded with ``run_seed``."""
    return puzzles(TRAIN_SEED_BASE + run_seed * SEEDS_PER_RUN, step * count, count, people)


def eval_puzzles(count: int, people: Sequence[int]) -> list[dict]:
    """The fixed held-out set: the same ``count`` puzzles for every run and method."""
    return puzzles(EVAL_SEED_BASE, 0, count, people)


def resolve_prompt_style(style: str, tokenizer, model_dir_style: str | None = None) -> str:
    """Concrete prompt style: ``auto`` takes the model's own (demo models record "compact"),
    else ``chat`` when the tokenizer has a chat template, else ``text``."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {style!r}")
    if style == "chat" and not getattr(tokenizer, "chat_template", None):  # as --apply-chat-template is refused
        raise UserError("--prompt-style chat, but the model's tokenizer has no chat template; use --prompt-style "
                        "text (plain prompts) or auto")  # fmt: skip
    if style != "auto":
        return style
    if model_dir_style:
        return model_dir_style
    return "chat" if getattr(tokenizer, "chat_template", None) else "text"


def prompt_for(record: dict, style: str, tokenizer=None) -> str:
    """The prompt string of one record in a concrete style (see the module docstring)."""
    if style == "compact":
        return compact_prompt(record)
    if style == "chat":
        if tokenizer is None:
            raise ValueError("tokenizer is required for prompt style 'chat'")
        return tokenizer.apply_chat_template(kk.make_prompt(record), tokenize=False, add_generation_prompt=True)
    if style == "text":
        return messages_to_text(kk.make_prompt(record))
    raise ValueError(f"prompt style must be 'compact', 'chat' or 'text', got {style!r}")


def score(response: str, record: dict) -> tuple[float, bool, bool]:
    """``(reward, correct, format_ok)`` of one response: the paper's reward in [-3, 3], whether the answer
    score is +2 (every role right, the accuracy metric) and whether the tags are well formed."""
    fmt, ans = kk.reward_parts(response, record["solution_text_format"])
    return fmt + ans, ans == 2.0, fmt > 0
