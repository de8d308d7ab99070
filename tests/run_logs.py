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
# Tracebacks that are not the run's error: multiprocessing's resource tracker in every vLLM worker's stderr when its
# shared memory was already released ("KeyError: '/psm_...'").
NOISE = ("multiprocessing/resource_tracker.py",)

Source = Union[str, Path, Tuple[str, Union[str, Path]]]


def _text(source: Union[str, Path]) -> Optional[str]:
    if isinstance(source, Path):
        try:
            return source.read_text(errors="replace")
        except OSError:
            return None
    return source


# What a launcher puts before a process's lines: Ray's "(ActorName pid=123, ip=10.0.0.1) " on the lines it forwards
# from an actor or a worker, maybe in color; torchrun's "[rank1]: " on a rank's uncaught exception.
PROCESS_PREFIX = re.compile(r"^((\x1b\[[\d;]*m)?\([^()]*\bpid=\d+[^()]*\)(\x1b\[[\d;]*m)? ?)?(\[rank\d+\]: ?)?")


# The line that ends a traceback: ``ValueError: ...``, ``ray.exceptions.RayTaskError(ValueError): ...``, ``KeyError``.
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(\([\w.]+\))?(:\s|:?$)")
CHAIN_LINE = ("Traceback (most recent call last)", "During handling of the above exception", "The above exception")


def _bare(line: str) -> str:
    return PROCESS_PREFIX.sub("", line)


def _continues(line: str) -> bool:
    """Whether ``line``, right after an exception line, carries the traceback on: an indented line (the remote
    traceback Ray appends to a ``RayTaskError``, a message's continuation) or a chain's ``During handling ...`` (a new
    ``Traceback`` header alone starts another one)."""
    bare = _bare(line)
    return bare[:1].isspace() or bare.startswith(CHAIN_LINE[1:])


# How far past an exception line a continued traceback may run before that line is taken as its end.
CONTINUATION_LINES = 300


def _traceback_end(lines: List[str], start: int) -> int:
    """Index of the exception line that ends the traceback whose header is ``lines[start]``: the last one of a chain
    (``During handling ...``) or of a remote traceback Ray appends after its ``RayTaskError(...)`` line. Lines of
    other processes interleaved with it (not indented, not an exception line) are passed over."""
    end = None
    i = start + 1
    while i < len(lines):
        if end is not None and i - end > CONTINUATION_LINES:
            return end
        bare = _bare(lines[i])
        if not bare.strip() or bare[:1].isspace() or bare.startswith(CHAIN_LINE) or not EXCEPTION_LINE.match(bare):
            i += 1
            continue
        end = i
        j = i + 1
        while j < len(lines) and not _bare(lines[j]).strip():
            j += 1
        if j < len(lines) and _continues(lines[j]):
            i = j
            continue
        return end
    return end if end is not None else len(lines) - 1


def first_error_in(text: str, context: int = 2) -> Optional[Tuple[int, str]]:
    """``(line number, excerpt)`` of the first error in ``text``, or None. The excerpt has ``context`` lines before
    it; a traceback is given from its header to its (last) exception line, with its last TRACEBACK_FRAMES frames and
    the exception lines of a chain."""
    lines = [line.rstrip() for line in text.splitlines()]
    i = -1
    while i + 1 < len(lines):
        i += 1
        line = lines[i]
        if not ERROR_LINE.search(line):
            continue
        start = max(0, i - context)
        if "Traceback (most recent call last)" in line:
            end = _traceback_end(lines, i)
            if any(noise in "\n".join(lines[i : end + 1]) for noise in NOISE):
                i = end
                continue
            body = lines[i + 1 : end]
            keep = 2 * TRACEBACK_FRAMES
            if len(body) > keep:  # frames cut, the chain's exception and header lines kept
                cut = [line for line in body[:-keep] if not _bare(line)[:1].isspace() and _bare(line).strip()]
                cut = [line for line in cut if EXCEPTION_LINE.match(_bare(line)) or _bare(line).startswith(CHAIN_LINE)]
                body = [f"  ... {len(body) - keep} lines of frames ..."] + cut + body[-keep:]
            excerpt = lines[start : i + 1] + body + [lines[end]]
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
    found, seen = [], set()
    for label, source in _labelled(sources):
        text = _text(source)
        hit = first_error_in(text, context) if text else None
        if hit is not None:
            last = _bare(hit[1].splitlines()[-1]).strip()
            if last in seen:  # the same error again (Ray's job output is also its driver's log file)
                continue
            seen.add(last)
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
