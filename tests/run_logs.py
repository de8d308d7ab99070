"""The first error of a failed run, for assertion messages: its output and its log files searched for the first line
that reports an error, with a few lines of context (a traceback's whole frame list cut to its last frames and the
exception line).

The tail of a long output (Ray's, vLLM's) often holds only shutdown noise; the cause is earlier. Sources are read in
the order given, so put the run's own output first, then its log files (:func:`ray_log_files` for a Ray session).
"""

import re
from pathlib import Path
from typing import Iterable, List, Optional, Tuple, Union

# A line that reports an error: a traceback, an exception type with its message, a command-line error, a log record
# of level ERROR / CRITICAL, a test failure, a timeout.
ERROR_LINE = re.compile(
    r"Traceback \(most recent call last\)"
    r"|\b[A-Z]\w*(Error|Exception|Interrupt|Exit)\b\s*[:(]"
    r"|(^|\s)(error|fatal):"
    r"|^\s*raise\b"
    r"|\b(ERROR|CRITICAL|FATAL|FAILED)\b"
    r"|\b[Tt]imed out\b|\btimeout expired\b"
)
# Frames of a traceback kept before its exception line.
TRACEBACK_FRAMES = 6

Source = Union[str, Path, Tuple[str, Union[str, Path]]]


def _text(source: Union[str, Path]) -> Optional[str]:
    if isinstance(source, Path):
        try:
            return source.read_text(errors="replace")
        except OSError:
            return None
    return source


# What Ray puts before the lines it forwards from an actor or a worker: "(ActorName pid=123, ip=10.0.0.1) ", maybe
# in color.
RAY_PREFIX = re.compile(r"^(\x1b\[[\d;]*m)?\([^()]*\bpid=\d+[^()]*\)(\x1b\[[\d;]*m)? ?")


def _traceback_end(lines: List[str], start: int) -> int:
    """Index of the exception line that ends the traceback starting at ``lines[start]`` (the header)."""
    for i in range(start + 1, len(lines)):
        line = RAY_PREFIX.sub("", lines[i])
        if not line.strip() or line[:1].isspace() or line.startswith("Traceback") or line.startswith("During handling"):
            continue
        if line.startswith(("The above exception", "[")) and not ERROR_LINE.search(line):
            continue
        return i
    return len(lines) - 1


def first_error_in(text: str, context: int = 2) -> Optional[Tuple[int, str]]:
    """``(line number, excerpt)`` of the first error in ``text``, or None. The excerpt has ``context`` lines before
    it; a traceback is given from its header to its exception line (its last TRACEBACK_FRAMES lines of frames)."""
    lines = [line.rstrip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if not ERROR_LINE.search(line):
            continue
        start = max(0, i - context)
        if "Traceback (most recent call last)" in line:
            end = _traceback_end(lines, i)
            frames = lines[i + 1 : end]
            if len(frames) > 2 * TRACEBACK_FRAMES:
                frames = [f"  ... {len(frames) - 2 * TRACEBACK_FRAMES} lines of frames ..."] + frames[-2 * TRACEBACK_FRAMES :]
            excerpt = lines[start : i + 1] + frames + [lines[end]]
        else:
            excerpt = lines[start : i + context + 1]
        return i + 1, "\n".join(excerpt)
    return None


def _labelled(sources: Iterable[Source]) -> Iterable[Tuple[str, Union[str, Path]]]:
    for n, source in enumerate(sources):
        if isinstance(source, tuple):
            yield source
        elif isinstance(source, Path):
            yield str(source), source
        else:
            yield f"output {n + 1}", source


def first_errors(*sources: Source, most: int = 3, context: int = 2) -> str:
    """The first error of each of the first ``most`` sources that have one, each under its label and line number.

    A source is a text (``"output N"``), a :class:`Path` (a file; unreadable ones are skipped) or a ``(label,
    text or path)`` pair. Returns ``""`` when no source has an error line."""
    found = []
    for label, source in _labelled(sources):
        text = _text(source)
        hit = first_error_in(text, context) if text else None
        if hit is not None:
            found.append(f"--- first error in {label}, line {hit[0]}:\n{hit[1]}")
            if len(found) == most:
                break
    return "\n".join(found)


def failure_report(*sources: Source, tail: int = 2000, most: int = 3) -> str:
    """An assertion message: the first errors of ``sources`` (:func:`first_errors`), then the last ``tail``
    characters of the first source that is not empty."""
    errors = first_errors(*sources, most=most) or "--- no error line found in the output or the logs"
    last = next((t for _, s in _labelled(sources) if (t := _text(s))), "")
    return f"{errors}\n--- last {tail} characters of the output:\n{last[-tail:]}"


# A Ray session's logs, most telling first: the jobs' drivers, the actors' and workers' stderr, then the daemons'.
RAY_LOG_PATTERNS = ("job-driver-*.log", "worker-*.err", "raylet*.err", "raylet*.out", "gcs_server*.err",
                    "gcs_server*.out", "dashboard*.log", "*.err")  # fmt: skip


def ray_log_files(ray_temp_dir: Union[str, Path]) -> List[Path]:
    """Log files of every session under a Ray temp dir (``--temp-dir``), by :data:`RAY_LOG_PATTERNS`, each kind
    oldest first."""
    root = Path(ray_temp_dir)
    seen, out = set(), []
    for pattern in RAY_LOG_PATTERNS:
        files = [p for p in root.glob(f"session_*/logs/{pattern}") if p.is_file() and p not in seen]
        files = [p for p in files if not p.parent.parent.is_symlink()]  # session_latest -> a session already listed
        for path in sorted(files, key=lambda p: p.stat().st_mtime):
            seen.add(path)
            out.append(path)
    return out
