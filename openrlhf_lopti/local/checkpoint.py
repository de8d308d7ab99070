"""Atomic checkpoints of a local run: model, optimizer, RNG states, step and the metrics file offset.

A checkpoint is one file written to a temporary name in the same directory, flushed to disk, then
``os.replace``d over ``checkpoint.pt``: a reader (or a resumed run) sees the old or the new checkpoint,
never half of one, however the writer dies. The metrics offset lets a resumed run cut ``metrics.jsonl``
back to the last checkpointed step, so no step is logged twice.
"""

import os
import pickle
import random
from pathlib import Path
from typing import Optional

import torch

from openrlhf_lopti.errors import UserError

CHECKPOINT_FILE = "checkpoint.pt"
# What every checkpoint holds (``optimizer_phase2`` too for a per-phase Lopti run).
CHECKPOINT_KEYS = ("step", "metrics_offset", "config", "model", "optimizer", "rng")


def rng_state() -> dict:
    """The Python, torch CPU and (if initialised) CUDA RNG states."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: str | os.PathLike, *, model, optimizer, step: int, metrics_offset: int, config: dict
) -> Path:
    """Write ``run_dir/checkpoint.pt`` atomically.

    Args:
        model: its ``state_dict`` is saved (on CPU).
        optimizer: its ``state_dict`` is saved as ``"optimizer"``; or a list of one optimizer per Lopti phase
            (``lopti_moments="per-phase"``): the first as ``"optimizer"``, the second as ``"optimizer_phase2"``.
        step: number of completed steps.
        metrics_offset: size in bytes of ``metrics.jsonl`` once step ``step`` was logged.
        config: the run's settings (``TrainConfig.to_dict()``).
    """
    run_dir = Path(run_dir)
    final = run_dir / CHECKPOINT_FILE
    tmp = run_dir / f".{CHECKPOINT_FILE}.tmp-{os.getpid()}"
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    payload = {
        "step": step,
        "metrics_offset": metrics_offset,
        "config": config,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizers[0].state_dict(),
        "rng": rng_state(),
    }
    if len(optimizers) == 2:
        payload["optimizer_phase2"] = optimizers[1].state_dict()
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(run_dir)
    return final


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable (POSIX); not possible on every platform, hence best effort.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(run_dir: str | os.PathLike) -> Optional[dict]:
    """The payload of ``run_dir/checkpoint.pt``, or None if there is none. Leftover temp files are removed."""
    run_dir = Path(run_dir)
    for leftover in run_dir.glob(f".{CHECKPOINT_FILE}.tmp-*"):
        leftover.unlink(missing_ok=True)  # a writer died before its rename
    path = run_dir / CHECKPOINT_FILE
    if not path.exists():
        return None
    return read_checkpoint(path, "--resume", "start the run again with --overwrite, or in another --out")


def read_checkpoint(path: Path, flag: str, fix: str) -> dict:
    """The payload of the checkpoint file ``path``, read without touching its folder; a one-line
    :class:`UserError` naming ``flag`` (and ``fix``, what to do) when it is not one :func:`save_checkpoint` wrote."""
    try:  # tensors, tuples and plain dicts only, so the safe loader suffices
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:  # damaged, or not a torch file
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise UserError(f"{flag}: {path} cannot be read as a checkpoint ({reason}): {fix}") from None
    missing = [k for k in CHECKPOINT_KEYS if k not in ckpt] if isinstance(ckpt, dict) else list(CHECKPOINT_KEYS)
    if missing:
        raise UserError(f"{flag}: {path} is not a `train` checkpoint (it has no {', '.join(missing)}): {fix}")
    return ckpt


def optimizer_states(ckpt: dict) -> list:
    """The optimizer state dicts of a checkpoint payload, in phase order (one, or two for a per-phase run)."""
    return [ckpt["optimizer"]] + ([ckpt["optimizer_phase2"]] if "optimizer_phase2" in ckpt else [])
