"""What an example script would run, captured without running it: ``python3`` / ``ray`` replaced by a recorder."""

import os
import stat
import subprocess
from pathlib import Path

from .run_logs import failure_report

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "examples" / "scripts").glob("*.sh"))
MODULE = "openrlhf_lopti.cli.train_ppo_ray"
RECORDER = """#!/usr/bin/env bash
# stands in for python3 / ray: records its arguments, one NUL-terminated file per call
printf '%s\\0' "$@" > "$ARGV_DIR/$(date +%s%N)-$$"
"""


def script_launch(script: Path, tmp_path: Path, *args: str, env: dict = None) -> tuple:
    """``(program, argv)`` the script launches ``openrlhf_lopti.cli.train_ppo_ray`` with: the executable that runs
    ``-m`` (None when the recorder itself ran as ``$PYTHON``; the multi-node job names it) and the trainer's arguments. ``args`` are passed to the script; ``env`` adds to its environment
    (defaults: placeholder data files, ``REWARD_FILE=reward.py``, ``HEAD_IP=127.0.0.1``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    recorder = tmp_path / "record"
    recorder.write_text(RECORDER)
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    argv_dir = tmp_path / "argv"
    argv_dir.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "test.jsonl", "math500.jsonl"):
        (data / name).write_text("{}\n")
    full_env = dict(os.environ)
    full_env.update(
        ARGV_DIR=str(argv_dir),
        PYTHON=str(recorder),
        RAY=str(recorder),
        DATA_DIR=str(data),
        TRAIN_DATA=str(data / "train.jsonl"),
        EVAL_DATA=str(data / "math500.jsonl"),
        REWARD_FILE="reward.py",
        HEAD_IP="127.0.0.1",
        SAVE_DIR=str(tmp_path / "ckpt"),
    )
    full_env.update(env or {})
    role = ["submit"] if script.name.startswith("multinode") else []
    result = subprocess.run(
        ["bash", str(script), *role, *args], env=full_env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, failure_report(("stderr", result.stderr), ("stdout", result.stdout))
    calls = [path.read_bytes().split(b"\0")[:-1] for path in sorted(argv_dir.iterdir())]
    calls = [[arg.decode() for arg in call] for call in calls]
    launches = [call for call in calls if MODULE in call]
    assert len(launches) == 1, calls
    at = launches[0].index(MODULE)
    assert launches[0][at - 1] == "-m", launches[0]
    return launches[0][at - 2] if at >= 2 else None, launches[0][at + 1 :]
