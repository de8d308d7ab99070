"""Prompt datasets for the local trainer, read as OpenRLHF 0.11.2 reads ``--data.prompt_dataset``.

The same files and options mean the same prompts in both trainers (``openrlhf/datasets/prompts_dataset.py``,
``preprocess_data``): with ``apply_chat_template`` the ``input_key`` field (a string, taken as one user
message, or a list of chat messages) goes through the tokenizer's chat template with the generation prompt;
without it the field must be a string, optionally formatted into ``input_template``. The label is the
``label_key`` field as it is (``""`` for every row when ``label_key`` is empty, OpenRLHF's default), and
``datasource`` names the row's group in evaluation metrics (``"default"`` for a dataset without that column,
None for a row without it, as OpenRLHF reads a table).

Batches are deterministic in ``(seed, step)``: the prompts of step ``s`` are positions ``s * P`` to
``(s + 1) * P - 1`` of an endless sequence made of one seeded permutation of the rows per epoch, so a resumed
run sees exactly the prompts it would have seen, and every epoch visits every row once.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from openrlhf_lopti.errors import UserError
from openrlhf_lopti.tasks import load_rows


@dataclass
class PromptSet:
    """The rows of a prompt dataset, ready to sample from.

    Fields (one entry per row):
        prompts: the prompt strings the policy continues (chat template applied when asked).
        labels: the ``label_key`` values, passed to ``reward_func`` unchanged.
        datasources: each row's ``datasource`` field (see the module docstring).
        where: ``"<file> line <L>"`` / ``"<file> row <R>"``, for messages.
    """

    prompts: list
    labels: list
    datasources: list
    where: list

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompt_set(
    paths: str,
    flag: str,
    input_key: str,
    label_key: str,
    apply_chat_template: bool,
    tokenizer,
    input_template: Optional[str] = None,
) -> PromptSet:
    """Read and check a prompt dataset (every row, before any training step).

    Args:
        paths: a file or folder (jsonl, json, parquet, ``save_to_disk`` folder), or several separated by
            commas (concatenated, as OpenRLHF does without ``--data.prompt_probs``).
        flag: the option that named it (``--data``), for messages.
        input_key, label_key, apply_chat_template, input_template: as OpenRLHF's ``--data.*`` options.
        tokenizer: its chat template renders the prompts when ``apply_chat_template``.

    Raises:
        UserError: no rows, a row without ``input_key`` / ``label_key`` (naming the file, line and key),
        a prompt of the wrong type, or ``apply_chat_template`` with a tokenizer that has no chat template.
    """
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{flag}: --apply-chat-template, but the model's tokenizer has no chat template; give "
                        "plain-text prompts (e.g. `data kk --plain-prompt`) without --apply-chat-template")  # fmt: skip
    rows, where = [], []
    for path in [p.strip() for p in paths.split(",") if p.strip()]:
        more, at = load_rows(path, flag)
        rows += more
        where += at
    if not rows:
        raise UserError(f"{flag} {paths}: no rows (an empty dataset)")
    prompts, labels = [], []
    for row, at in zip(rows, where):
        keys = ", ".join(sorted(map(str, row))[:8]) or "none"
        for option, key in (("--input-key", input_key), ("--label-key", label_key)):
            if key and key not in row:
                raise UserError(f"{at}: no {key!r} key (the row has {keys}); pass {option} with the field's name")
        prompts.append(_render(row[input_key], at, input_key, apply_chat_template, tokenizer, input_template))
        labels.append(row[label_key] if label_key else "")
    # Read as a table, as `datasets` does, a row without the column gets None; without the column, "default".
    column = any("datasource" in row for row in rows)
    datasources = [row.get("datasource") if column else "default" for row in rows]
    return PromptSet(prompts, labels, datasources, where)


def _render(value, at: str, key: str, apply_chat_template: bool, tokenizer, template: Optional[str]) -> str:
    """One prompt string, as OpenRLHF's ``preprocess_data`` makes it."""
    if apply_chat_template:
        if isinstance(value, str):
            value = [{"role": "user", "content": value}]
        ok = isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                       for m in value)  # fmt: skip
        if not ok:
            raise UserError(f"{at}: {key!r} must be a string or a list of {{'role', 'content'}} chat messages")
        return tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
    if isinstance(value, list):
        raise UserError(f"{at}: {key!r} is a list of chat messages: pass --apply-chat-template (OpenRLHF's "
                        "--data.apply_chat_template) to render it")  # fmt: skip
    if not isinstance(value, str):
        raise UserError(f"{at}: {key!r} must be a string, got {type(value).__name__}")
    return template.format(value) if template else value


def step_indices(rows: int, seed: int, step: int, count: int) -> list[int]:
    """Row indices of the ``count`` prompts of step ``step`` (0-based): deterministic in ``(seed, step)``.

    Position ``i`` of the endless sequence is row ``perm_e[i mod rows]`` of epoch ``e = i // rows``, where
    ``perm_e`` is a permutation seeded by ``(seed, e)``; a step may span the end of one epoch and the start
    of the next.
    """
    out, perms = [], {}
    for i in range(step * count, (step + 1) * count):
        epoch = i // rows
        if epoch not in perms:
            perms[epoch] = torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][i % rows]))
    return out


def epochs_done(rows: int, steps: int, count: int) -> float:
    """Passes over the dataset after ``steps`` steps of ``count`` prompts."""
    return steps * count / rows
