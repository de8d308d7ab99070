"""docs/TRL.md's launch commands for ``examples/trl/train_kk_grpo_ar_lopti.py``, as a TRL user types them.

- Every fenced command of the page that runs the example parses with its launcher's real parser (torchrun's,
  accelerate's) and with the example's own.
- The CPU ones run as written (from a folder where ``examples/`` is the repository's, so ``runs/...`` lands in
  a temporary folder): one process, then two under ``torchrun``. Each says how many processes it got, its
  rewards spread and both Lopti phases train (a warmed-up model), and it saves the final model.
"""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from .doc_blocks import fenced_lines  # noqa: E402
from .ds_ranks import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "TRL.md"
SCRIPT = "examples/trl/train_kk_grpo_ar_lopti.py"


def example_commands() -> list:
    """``(line, words)`` of each fenced shell command in docs/TRL.md that runs the example."""
    commands = []
    for number, line in fenced_lines(DOC.read_text(encoding="utf-8")):
        words = shlex.split(line, comments=True)
        if SCRIPT in words:
            commands.append((number, words))
    return commands


def example_module():
    spec = importlib.util.spec_from_file_location("train_kk_grpo_ar_lopti", ROOT / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launched(words: list) -> tuple:
    """``(processes, script, script arguments)`` as the command's launcher parses it."""
    if Path(words[0]).name in ("python", "python3"):
        return 1, words[1], words[2:]
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(words[1:])
        return int(args.nproc_per_node), args.training_script, args.training_script_args
    assert words[:2] == ["accelerate", "launch"], f"unknown launcher: {words[:2]}"
    from accelerate.commands.launch import launch_command_parser

    args = launch_command_parser().parse_args(words[2:])
    return args.num_processes, args.training_script, args.training_script_args


COMMANDS = example_commands()


def test_every_launch_command_of_the_doc_parses():
    example = example_module()
    kinds = set()
    for line, words in COMMANDS:
        processes, script, argv = launched(words)
        assert script == SCRIPT, line
        args = example.parse_args(argv)  # exits (fails the test) on a missing --output-dir or an unknown flag
        kinds.add((words[0], args.cpu, processes))
    assert {("python", True, 1), ("torchrun", True, 2), ("accelerate", False, 8), ("torchrun", False, 8)} <= kinds


CPU_COMMANDS = [c for c in COMMANDS if "--cpu" in c[1]]


@pytest.mark.parametrize("line, words", CPU_COMMANDS, ids=[f"{w[0]}-line{n}" for n, w in CPU_COMMANDS])
def test_the_cpu_commands_run_as_written(line, words, tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    processes, _, argv = launched(words)
    launcher = {"python": sys.executable, "torchrun": str(Path(sys.executable).parent / "torchrun")}[words[0]]
    env = {**os.environ, "PET_MASTER_PORT": str(free_port()),  # torchrun's --master-port (another run may hold 29500)
           "OMP_NUM_THREADS": "1",  # torchrun's own default per process; 2 threads on a busy 2-core machine: 4x slower
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    result = subprocess.run([launcher, *words[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"training on {processes} process(es), backend {'gloo' if processes > 1 else None}" in result.stdout

    def logged(key: str) -> list:
        return [float(v) for v in re.findall(rf"'{re.escape(key)}': '([^']*)'", result.stdout)]

    assert logged("reward_std") and all(std > 0 for std in logged("reward_std")), "rewards without spread"
    assert logged("lopti/low/tokens") and all(n > 0 for n in logged("lopti/low/tokens"))
    assert all(n > 0 for n in logged("lopti/high/tokens"))
    out = tmp_path / example_module().parse_args(argv).output_dir
    assert (out / "model.safetensors").exists() and (out / "initial" / "model.safetensors").exists()


def refused(capsys, argv) -> str:
    """Run the example's command line in this process (no training); assert exit code 2 and one line on stderr."""
    from openrlhf_lopti.errors import run_command

    example = example_module()
    assert run_command(example.PROG, example.main, argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--lopti-eta", "nan"], "--lopti-eta nan: expected a number in (0, 1] (a negative value turns Lopti off)"),
    (["--lopti-eta", "inf"], "--lopti-eta inf: expected a number in (0, 1] (a negative value turns Lopti off)"),
    (["--max-steps", "1"], "--max-steps=1 would stop between the two Lopti phases of a round"),
    (["--ar-alpha", "2"], "--ar-alpha: "),
])  # fmt: skip
def test_bad_settings_are_one_line_before_anything_is_written(tmp_path, capsys, flags, message):
    """--lopti-eta nan trained with Lopti silently off; --max-steps 1 and --ar-alpha 2 were tracebacks raised after
    the CPU rehearsal had warmed up and written <output-dir>/initial/."""
    out = tmp_path / "trl"
    line = refused(capsys, ["--cpu", "--output-dir", str(out), *flags])
    assert line.startswith(f"train_kk_grpo_ar_lopti.py: error: {message}"), line
    assert not out.exists()


def test_an_output_dir_with_files_is_refused_unless_overwrite(tmp_path, capsys):
    """A second run into the same --output-dir rewrote initial/ and TRL's model without a word."""
    out = tmp_path / "trl"
    (out / "initial").mkdir(parents=True)
    (out / "initial" / "config.json").write_text("mine")
    assert refused(capsys, ["--cpu", "--output-dir", str(out)]) == (
        f"train_kk_grpo_ar_lopti.py: error: --output-dir {out} holds files already (initial): an earlier run's "
        "initial/ and model would be replaced; pass --overwrite to write there anyway, or choose another --output-dir"
    )
    assert (out / "initial" / "config.json").read_text() == "mine"
    # with --overwrite the folder is taken: the next refusal is the config's, not the folder's
    line = refused(capsys, ["--cpu", "--output-dir", str(out), "--overwrite", "--max-steps", "1"])
    assert "--max-steps=1" in line and (out / "initial" / "config.json").read_text() == "mine"
