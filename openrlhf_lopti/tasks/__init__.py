"""Tasks of the paper: Knights and Knaves puzzles (`kk`) and math (`math`), their rewards and evaluation.

Modules: `kk` (statements, solver, generator, prompt, reward), `math` (final-answer extraction and
equivalence), `reward_kk.py` / `reward_math.py` (OpenRLHF reward files for `--reward.remote_url`),
`data` (dataset script), `evaluate` (accuracy tables). Nothing here imports openrlhf, ray, deepspeed
or vllm; torch is only imported by the reward files and transformers only by local generation.

This file holds the small helpers the modules above share: prompt/response text and jsonl I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from openrlhf_lopti.errors import UserError

__all__ = [
    "load_rows", "messages_to_text", "read_rows", "response_from_query", "strip_special_tokens", "write_jsonl",
]  # fmt: skip


def read_rows(path: str | Path, flag: str = "") -> list[dict]:
    """Rows of a jsonl, json, parquet file or saved Hugging Face datasets folder (see :func:`load_rows`)."""
    return load_rows(path, flag)[0]


def load_rows(path: str | Path, flag: str = "") -> tuple[list[dict], list[str]]:
    """Rows of a prompt / generations file, and where each one is, for error messages.

    Reads what OpenRLHF's ``--data.prompt_dataset`` reads from a local path: a ``.jsonl`` file (one JSON
    object per line, blank lines skipped), a ``.json`` file (a list of objects, or JSON lines), a
    ``.parquet`` file, or a folder written by ``datasets``' ``save_to_disk`` (its ``train`` split when it
    holds several).

    Args:
        path: the file or folder.
        flag: the command-line flag that named it (``"--data"``), used in messages.

    Returns:
        ``(rows, where)``: the rows as dicts, and ``where[i]`` = ``"<path> line <L>"`` (jsonl, 1-based line
        of the file) or ``"<path> row <R>"`` (1-based) for row ``i``.

    Raises:
        UserError: a missing file, an unreadable or malformed one (naming the 1-based line), a row that
        is not an object.
    """
    path = Path(path)
    name = f"{flag} {path}" if flag else str(path)
    if not path.exists():
        raise UserError(f"{name}: no such file or folder")
    if path.is_dir():
        rows = _read_saved_dataset(path, name)
        return rows, [f"{path} row {i + 1}" for i in range(len(rows))]
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a file that is not parquet
            raise UserError(f"{name}: not a readable parquet file ({e})") from None
        return rows, [f"{path} row {i + 1}" for i in range(len(rows))]
    if suffix not in (".jsonl", ".json"):
        raise UserError(
            f"{name}: unsupported file type {suffix or '(none)'!r}; use .jsonl, .json, .parquet or a folder "
            "written by datasets' save_to_disk"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{name} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
        where = [f"{path} row {i + 1}" for i in range(len(items))]
    else:
        items, where = [], []
        # "\n" only: str.splitlines also breaks at U+2028 / U+2029 / U+0085, which JSON strings may hold unescaped
        # (write_jsonl writes them so), and would cut such a row in two
        for lineno, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{name} line {lineno}: not valid JSON ({e.msg}, column {e.colno}); "
                    "each line must be one JSON object"
                ) from None
            where.append(f"{path} line {lineno}")
    for item, at in zip(items, where):
        if not isinstance(item, dict):
            raise UserError(f"{at}: a JSON {type(item).__name__}, not an object; each row must be a JSON object")
    return items, where


def _read_saved_dataset(path: Path, name: str) -> list[dict]:
    """Rows of a ``save_to_disk`` folder (a Dataset, or a DatasetDict's ``train`` split)."""
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if not any((path / m).exists() for m in markers):
        raise UserError(
            f"{name}: a folder without a saved Hugging Face dataset (no {' / '.join(markers)}); pass a .jsonl, "
            ".json or .parquet file, or a folder written by datasets' save_to_disk"
        )
    from datasets import Dataset, load_from_disk

    data = load_from_disk(str(path))
    if not isinstance(data, Dataset):  # a DatasetDict: OpenRLHF's default split is "train"
        if "train" not in data:
            raise UserError(f"{name}: a saved DatasetDict without a 'train' split (it has {sorted(data)})")
        data = data["train"]
    return data.to_list()


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    """Write rows as JSON lines (parent folders created); returns the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def messages_to_text(messages: list[dict]) -> str:
    """Plain-text rendering of chat messages, for models without a chat template.

    The text ends with "Assistant:" so the model's continuation is the response.
    """
    parts = []
    for m in messages:
        role, content = m["role"], m["content"]
        parts.append(content if role == "system" else f"{role.capitalize()}: {content}")
    return "\n\n".join(parts) + "\n\nAssistant:"


# Markers that open the assistant turn in common chat templates (ChatML/Qwen, Llama 3, Gemma, plain).
_ASSISTANT_MARKERS = (
    "<|im_start|>assistant",
    "<|start_header_id|>assistant<|end_header_id|>",
    "<start_of_turn>model",
    "<|assistant|>",
    "Assistant:",
)
# End-of-turn / end-of-text tokens a decode with skip_special_tokens=False leaves at the end.
_TRAILING_SPECIAL = re.compile(r"(?:\s*(?:<\|[A-Za-z0-9_]{1,40}\|>|</s>|<eos>|<end_of_turn>))+\s*\Z")


def strip_special_tokens(text: str) -> str:
    """Remove trailing end-of-turn tokens such as <|im_end|>, <|endoftext|>, <|eot_id|>, </s>."""
    # Only look at the tail: the regex is anchored at the end, so bound its input for linear time.
    tail_start = max(0, len(text) - 512)
    m = _TRAILING_SPECIAL.search(text, tail_start)
    return text[: m.start()] if m else text


def response_from_query(query: str, prompt: str) -> str:
    """The model's response inside an OpenRLHF `query` (the decoded prompt + response).

    OpenRLHF decodes prompt and response tokens together, so the query normally starts with the prompt
    string. If it does not (a tokenizer that does not round-trip, a BOS token in front), use the text
    after the prompt's first occurrence, then after the last assistant-turn marker, then the whole
    query. Trailing special tokens are removed.
    """
    if prompt and query.startswith(prompt):
        response = query[len(prompt) :]
    elif prompt and (i := query.find(prompt)) >= 0:
        response = query[i + len(prompt) :]
    else:
        cut = -1
        for marker in _ASSISTANT_MARKERS:
            j = query.rfind(marker)
            if j >= 0:
                cut = max(cut, j + len(marker))
        response = query[cut:].lstrip("\n") if cut >= 0 else query
    return strip_special_tokens(response)
