"""Run folders and metrics files: the helpers more than one command needs (the local trainer, the demo, the
audit, the study, ``eval``, ``data``, the benchmarks), below all of them. Imports nothing of the package but
:mod:`.errors`, and neither torch nor transformers.

Where a command may write: the rules every ``openrlhf-lopti`` command follows for its outputs.

- A command never writes over a file it was given as input, nor into an input's folder, nor removes one.
- Each command knows the names of its outputs (files, folders, glob patterns such as ``people[0-9].jsonl``).
  If any of them already exists in ``--out``, the command refuses to start unless ``--overwrite`` (or, for
  commands that can continue a run, ``--resume``) is given. ``--overwrite`` removes exactly those names;
  anything else the user keeps in the folder stays, and unrelated files never block a run.

What a command reads: :func:`check_model_dir` (a Hugging Face checkpoint folder, with a one-line error naming
what it lacks) and :func:`read_metrics` (a run's ``metrics.jsonl``, one JSON object per step).
"""

import fnmatch
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from .errors import UserError

Inputs = Iterable[tuple]  # (flag, path) pairs, e.g. [("--model", "runs/x/final_model")]


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (both resolved)."""
    return path == folder or folder in path.parents


def _existing(out: Path, names: Sequence[str]) -> list[Path]:
    found: list[Path] = []
    for name in names:
        matches = sorted(out.glob(name)) if any(c in name for c in "*?[") else [out / name]
        found += [m for m in matches if m.exists() or m.is_symlink()]
    return list(dict.fromkeys(found))


def _check_inputs(out: Path, names: Sequence[str], out_flag: str, inputs: Inputs) -> None:
    """Refuse an output folder inside an input folder, and an output name that is (or holds) an input."""
    root = out.resolve()
    for flag, path in inputs:
        if path is None:
            continue
        given = Path(path).resolve()
        if given.is_dir() and _inside(root, given):
            raise UserError(f"{out_flag} {out} lies inside {flag} {path}: choose an {out_flag} outside that folder")
        if not _inside(given, root):
            continue
        rel = given.relative_to(root).parts
        for name in names:
            parts = Path(name).parts
            if len(rel) >= len(parts) and all(fnmatch.fnmatchcase(r, n) for r, n in zip(rel, parts)):
                raise UserError(
                    f"{out_flag} {out} would write over {flag} {path} (the output {name!r} is that input): "
                    f"choose another {out_flag}"
                )


def check_can_write(path: str | Path, out_flag: str = "--out", *, file: bool = False) -> None:
    """Refuse, before any work, a folder ``path`` that cannot be created or written: a folder on the way that is
    a file, or a place that takes no new entry (no permission, a read-only or virtual file system such as /proc).
    ``file``: ``path`` is an output file, whose folder is checked.

    Probes the nearest existing folder of ``path`` (``path`` itself when it exists) by making and removing a
    hidden temporary folder there; nothing is left behind.

    Raises:
        UserError: ``<out_flag> <path>: cannot write there (<why>)``.
    """
    path = Path(path)
    folder = path.parent if file else path
    while not (folder.exists() or folder.is_symlink()):  # exists() is False below a file, too
        if folder.parent == folder:
            break
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{out_flag} {path}: cannot write there ({folder} is a file, not a folder)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".openrlhf-lopti-probe-", dir=folder))
    except OSError as e:
        raise UserError(f"{out_flag} {path}: cannot write there ({e.strerror or e} in {folder})") from None


def _write_error(out_flag: str, path: Path, e: OSError) -> UserError:
    return UserError(f"{out_flag} {path}: cannot write there ({e.strerror or e})")


def check_out_dir(
    out: str | Path,
    names: Sequence[str],
    *,
    overwrite: bool,
    resume: bool = False,
    can_resume: bool = False,
    inputs: Inputs = (),
    out_flag: str = "--out",
) -> list[Path]:
    """The checks of :func:`prepare_out_dir` without changing anything (:func:`check_can_write` probes the folder);
    returns the outputs it would remove."""
    out = Path(out)
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other: --resume keeps the run, --overwrite replaces it")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out_flag} {out}: is a file; {out_flag} takes a folder")
    check_can_write(out, out_flag)
    _check_inputs(out, names, out_flag, inputs)
    found = _existing(out, names) if out.is_dir() and not resume else []
    if found and not overwrite:
        shown = ", ".join(str(p.relative_to(out)) for p in found[:4]) + (", ..." if len(found) > 4 else "")
        options = "--overwrite to replace them (only these are removed)"
        if can_resume:
            options = "--resume to continue that run, " + options
        raise UserError(f"{out_flag} {out} holds outputs of an earlier run ({shown}): pass {options}, "
                        f"or choose another {out_flag}")  # fmt: skip
    return found


def prepare_out_dir(
    out: str | Path,
    names: Sequence[str],
    *,
    overwrite: bool,
    resume: bool = False,
    can_resume: bool = False,
    inputs: Inputs = (),
    out_flag: str = "--out",
) -> Path:
    """Check the output folder ``out`` of a command whose outputs are ``names`` and create it.

    Args:
        out: the folder (created with its parents when missing).
        names: the command's output names relative to ``out``: files, folders, or glob patterns.
        overwrite: remove the existing outputs among ``names`` (only those) first.
        resume: the command continues the run in ``out``: existing outputs are expected, nothing is removed.
        can_resume: the command has ``--resume`` (the refusal message then mentions it).
        inputs: ``(flag, path)`` of every file or folder the command reads, which must stay untouched.
        out_flag: how the folder was given, for messages.

    Raises:
        UserError: ``out`` is a file, an output would replace an input, or outputs exist and neither
        ``overwrite`` nor ``resume`` is set.
    """
    found = check_out_dir(out, names, overwrite=overwrite, resume=resume, can_resume=can_resume, inputs=inputs,
                          out_flag=out_flag)  # fmt: skip
    out = Path(out)
    try:
        for path in found:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a folder on the way that is a file, no permission, a read-only file system
        raise _write_error(out_flag, out, e) from None
    return out


def prepare_out_file(path: str | Path, *, overwrite: bool, inputs: Inputs = (), out_flag: str = "--out") -> Path:
    """Check one output file: never an input, refused when it exists unless ``overwrite``; creates its folder."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{out_flag} {path}: is a folder; {out_flag} takes a file name")
    for flag, given in inputs:
        if given is not None and Path(given).exists() and Path(given).resolve() == path.resolve():
            raise UserError(f"{out_flag} {path} is also {flag}: it would overwrite that input; pick another {out_flag}")
    if path.exists() and not overwrite:
        raise UserError(f"{out_flag} {path} exists: pass --overwrite to replace it, or choose another {out_flag}")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{out_flag} {path}: cannot write there (the file is read-only)")
    check_can_write(path, out_flag, file=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_error(out_flag, path, e) from None
    return path


# Files that make a folder a Hugging Face checkpoint that AutoModelForCausalLM / AutoTokenizer can load.
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_model_dir(path: str, flag: str = "--model") -> Path:
    """``path`` as a ``Path`` if it is a local Hugging Face checkpoint folder, else a :class:`UserError`
    naming ``flag`` and the files it lacks (instead of transformers' advice to install sentencepiece)."""
    folder = Path(path)
    hint = "pass a folder written by save_pretrained (model and tokenizer), e.g. runs/demo-<timestamp>/warmup_model"
    if not folder.exists():
        raise UserError(f"{flag} {path}: no such folder; {hint}")
    if not folder.is_dir():
        raise UserError(f"{flag} {path}: is a file, not a folder; {hint}")
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("tokenizer (tokenizer.json or tokenizer_config.json)")
    if missing:
        raise UserError(f"{flag} {path}: not a Hugging Face checkpoint, it has no {', '.join(missing)}; {hint}")
    return folder


def read_metrics(path: str | os.PathLike) -> list:
    """The rows of a metrics.jsonl file (a torn last line, from a crash mid-write, is ignored)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def window_mean(rows: list, key: str, first: bool, frac: float = 0.2) -> float:
    """Mean of ``key`` over the first / last ``frac`` of metrics ``rows`` (at least one row; rows without
    ``key`` are skipped); NaN when none has it."""
    k = max(1, int(len(rows) * frac))
    part = rows[:k] if first else rows[-k:]
    values = [r[key] for r in part if key in r]
    return sum(values) / len(values) if values else float("nan")
