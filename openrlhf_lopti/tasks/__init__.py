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

__all__ = ["messages_to_text", "read_rows", "response_from_query", "strip_special_tokens", "write_jsonl"]


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a jsonl, json (list of objects) or parquet file."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - pyarrow comes with `datasets`
            raise ImportError("reading parquet needs pyarrow (pip install pyarrow)") from e
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


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
