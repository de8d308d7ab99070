"""benchmarks/gpu_session.sh (issue 34): the dry run lists its steps anywhere, a machine without CUDA is refused in
one line, a failed or timed-out step prints its first error line and the session goes on, and every step's command
parses with the real parser of what it runs. The GPU steps themselves cannot run here (no GPU in CI)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_session.sh"
STEP_NAMES = ["probe", "check-gpu", "loss-head", "lm-head-h896", "lm-head-h4096", "trl-shapes"]


def session(*args, env=None, timeout=300):  # a hang guard: seconds when idle (bash, at most a torch import)
    full = {**os.environ, "WHEELS": "/nonexistent-wheels", **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=timeout,
                          cwd=REPO)  # fmt: skip


def dry_run_steps() -> list:
    """``[(name, budget, command)]`` as the dry run lists them (``$PYTHON`` / ``$LOGS`` left as written)."""
    out = session("--dry-run", env={"PYTHON": "/nonexistent/python"})
    assert out.returncode == 0, out.stderr
    steps = []
    for line in out.stdout.splitlines()[1:]:
        match = re.match(r"^  (\S+)\s+(\d+) s  (.*)$", line)
        if match:
            steps.append((match[1], int(match[2]), match[3]))
    return steps


def test_dry_run_lists_every_step_with_its_budget_without_python_or_a_gpu():
    steps = dry_run_steps()  # PYTHON points nowhere: the dry run is bash only
    assert [name for name, _, _ in steps] == STEP_NAMES
    # one device call is at most 600 s, and a session's device time 15 minutes: the steps' budgets plus the wheels'
    # install fit in 7 minutes, so a failed run can be rerun in the same session
    assert sum(budget for _, budget, _ in steps) <= 420
    assert all(budget >= 15 for _, budget, _ in steps)


def test_without_cuda_it_refuses_in_one_line_and_runs_nothing(tmp_path):
    out = session(env={"PYTHON": sys.executable, "OUT": str(tmp_path / "out")})
    assert out.returncode == 2
    assert out.stdout.splitlines() == [out.stdout.strip()]  # one line
    assert out.stdout.startswith("gpu_session: refusing: no CUDA device visible to torch ")
    assert "--dry-run lists the steps" in out.stdout and out.stderr == ""
    assert not (tmp_path / "out").exists()


def test_without_torch_it_refuses_in_one_line(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    out = session(env={"PYTHON": str(fake)})
    assert out.returncode == 2
    assert out.stdout.strip() == (f"gpu_session: refusing: torch does not import with {fake} (ModuleNotFoundError: "
                                  "No module named 'torch'); --dry-run lists the steps")  # fmt: skip


def test_unknown_argument_is_one_line():
    out = session("--gpu")
    assert out.returncode == 2 and out.stdout.strip().startswith("gpu_session: unknown argument --gpu")


def test_a_failed_or_timed_out_step_prints_its_first_error_line_and_the_session_goes_on(tmp_path):
    # The session's clock is a file the steps advance (GPU_SESSION_CLOCK_FILE), so what the 6-second budget lets
    # run is the same on an idle and on a loaded machine; only "slow" waits in real time, for its 3-second timeout.
    clock = tmp_path / "clock"
    clock.write_text("0\n")
    steps = tmp_path / "steps.txt"
    steps.write_text(
        "ok|5|echo hello\n"
        'fails|5|echo 1 >"$GPU_SESSION_CLOCK_FILE"; echo starting; echo \'ValueError: boom\' >&2; '
        "echo 'RuntimeError: later'; exit 3\n"
        'slow|3|echo 4 >"$GPU_SESSION_CLOCK_FILE"; echo before; echo \'TypeError: late\' ; sleep 30\n'
        'last|5|echo still runs; echo 5 >"$GPU_SESSION_CLOCK_FILE"\n'
        "starved|5|echo never\n"
    )
    env = {"GPU_SESSION_STEPS_FILE": str(steps), "GPU_SESSION_ASSUME_CUDA": "1", "GPU_SESSION_MIN_STEP_S": "2",
           "GPU_SESSION_BUDGET_S": "6", "GPU_SESSION_CLOCK_FILE": str(clock), "OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable}  # fmt: skip
    out = session(env=env)
    lines = out.stdout.splitlines()
    assert out.returncode == 1
    assert "== ok: ok in 0 s" in lines and "hello" in lines
    assert "== fails: FAILED (exit 3) after 1 s; first error line: ValueError: boom" in lines
    assert "== slow: TIMED OUT after 3 s; first error line: TypeError: late" in lines
    assert "== last (budget 2 s): echo still runs; echo 5 >\"$GPU_SESSION_CLOCK_FILE\"" in lines  # what was left
    assert "still runs" in lines  # the steps after a failure still run
    assert "never" not in lines
    # the session's total budget (6 s) is spent by then (1 s left, under the 2 s a step needs): the last step is
    # skipped, not started short
    assert "== starved: SKIPPED (session budget spent: 1 s left)" in lines
    assert lines[-1].startswith("gpu_session: done in 5 s, 3 of 5 steps failed, skipped or timed out")
    # what comes back from $OUT: the report and one bundle of the step logs (the device tool brings back 8 files)
    kept = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert kept == ["gpu_session.log", "step_logs.tgz"]
    assert (tmp_path / "out" / "gpu_session.log").read_text().splitlines() == lines  # the report, as printed


def _argv(command: str) -> list:
    return shlex.split(command.replace("$LOGS", "/tmp/logs").replace("$PYTHON", "python"))


def test_every_python_step_parses_with_the_real_parser(capsys):
    """Each step's flags, as the session passes them, against the parser of the module it runs."""
    import benchmarks.bench_memory as bench_memory
    from benchmarks import gpu_steps
    from openrlhf_lopti.cli import check_gpu

    commands = {name: _argv(command) for name, _, command in dry_run_steps()}
    for name in ("probe", "loss-head", "trl-shapes"):
        argv = commands[name]
        assert argv[:3] == ["python", "-m", "benchmarks.gpu_steps"]
        gpu_steps.build_parser().parse_args(argv[3:])
    assert commands["check-gpu"] == ["python", "-m", "openrlhf_lopti", "check-gpu", "--no-bench", "--quick"]
    if not __import__("torch").cuda.is_available():
        assert check_gpu.main(commands["check-gpu"][4:]) == 0  # parses; on CPU one line
        assert "no CUDA device visible" in capsys.readouterr().out
    for name in ("lm-head-h896", "lm-head-h4096"):
        argv = commands[name]
        assert argv[:2] == ["python", "benchmarks/bench_memory.py"]
        with pytest.raises(SystemExit) as done:  # --help after the flags: exit 0 only if they all parsed
            bench_memory.main(argv[2:] + ["--help"])
        assert done.value.code == 0
        help_text = capsys.readouterr().out
        assert all(flag in help_text for flag in argv[2:] if flag.startswith("--"))


def test_gpu_steps_refuse_without_cuda_in_one_line(capsys):
    from benchmarks import gpu_steps

    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is visible")
    for step in ("loss-head", "trl", "local"):
        assert gpu_steps.main([step]) == 2
        assert capsys.readouterr().out.strip().startswith(f"gpu_steps {step}: no CUDA device visible to torch")


def test_deepspeed_stand_in_only_when_deepspeed_is_missing(monkeypatch):
    """OpenRLHF's loss module imports DeepSpeed at its top; the GPU image has none (and no wheel exists to carry).
    The stand-in is registered only when the import fails, and any use of it raises."""
    from benchmarks import gpu_steps

    # `import deepspeed` now raises ImportError; both entries are monkeypatch's, so the stand-ins the test makes
    # are gone after it (a stand-in deepspeed.utils left behind broke every later real `import deepspeed`)
    for name in ("deepspeed", "deepspeed.utils"):
        monkeypatch.setitem(sys.modules, name, None)
    assert gpu_steps.deepspeed_stand_in() is True
    import deepspeed

    with pytest.raises(RuntimeError, match="import-only stand-in"):
        deepspeed.utils.set_z3_leaf_modules
    with pytest.raises(AttributeError):
        deepspeed.__version__
    assert gpu_steps.deepspeed_stand_in() is False  # importable now: nothing registered again


def test_the_loss_head_step_runs_our_three_triton_rows(monkeypatch):
    """Issue 44's table needs checks at once, at the step and the one-pass head side by side; the first GPU run asked
    the benchmark for `triton` alone (its backends list), so two of the three rows never ran. The step's flags, read
    where it hands them to the benchmark (the CUDA check and the benchmark itself replaced: no GPU here)."""
    from benchmarks import gpu_steps
    import benchmarks.bench_policy_loss as bench_policy_loss
    from openrlhf_lopti.cli.bench_loss_head import ALL_BACKENDS, OURS

    handed = []
    monkeypatch.setattr(bench_policy_loss, "main", lambda argv: handed.append(argv) or 0)
    monkeypatch.setattr(gpu_steps, "openrlhf_loss_status", lambda: "not installed (test)")
    monkeypatch.setattr(gpu_steps, "liger_status", lambda: "ok")
    args = gpu_steps.build_parser().parse_args(["loss-head", "--json", "/tmp/x.json"])
    assert gpu_steps.loss_head(args) == 0
    (argv,) = handed
    backends = argv[argv.index("--backends") + 1].split(",")
    assert {"triton", "triton-step", "triton-onepass", "liger", "torch"} <= set(backends)
    assert set(backends) <= set(ALL_BACKENDS) and "cpp" not in backends and set(OURS) - {"cpp"} <= set(backends)


def test_the_cce_row_names_an_implementation_the_pinned_version_has():
    """cut-cross-entropy 25.1.1 (gpu_session.sh's pin) implements `cce` and `torch_compile`; the first GPU run asked
    for `cce_exact` and both lm_head steps died there. Read from the wheel's enum where it is installed, else from
    the pin's source as cited: https://github.com/apple/ml-cross-entropy (linear_cross_entropy.py,
    LinearCrossEntropyImpl)."""
    import inspect

    import benchmarks.bench_memory as bench_memory

    assert "cut-cross-entropy==25.1.1" in SCRIPT.read_text()
    source = inspect.getsource(bench_memory._cce_steps)
    (impl,) = re.findall(r'impl="([a-z_]+)"', source)
    try:
        from cut_cross_entropy.linear_cross_entropy import LinearCrossEntropyImpl

        known = {member.name.lower() for member in LinearCrossEntropyImpl}
    except ImportError:
        known = {"cce", "torch_compile"}
    assert impl in known, (impl, known)
    assert "filter_eps=None" in source  # exact: no gradient entry filtered


def test_trl_shapes_rows_say_which_backend_ran_and_where(tmp_path):
    """``gpu_steps trl-shapes`` (tiny shapes, on CPU): every row records the device and the backend our loss head ran
    on, so that a fallback cannot pass as a kernel figure: ours on the C++ kernel (the fused lm_head's block steps run
    in torch on CPU), none for TRL's own trainer and TRL's loss path."""
    from .run_logs import failure_report

    out = tmp_path / "trl_shapes.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_steps", "trl-shapes", "--cpu", "--shape", "tiny",
                          "--batch", "8", "--completion", "8", "--rounds", "1", "--json", str(out)],
                         capture_output=True, text=True, cwd=REPO, timeout=900)  # fmt: skip  (a hang guard)
    assert run.returncode == 0, failure_report(run.stdout + run.stderr)
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert all(row["status"] == "ok" and row["device"] == "cpu" for row in rows.values())
    assert {name: row["backend_ran"] for name, row in rows.items()} == {
        "trl GRPOTrainer grpo": "none (TRL's loss)",
        "ours grpo (fused)": "cpp",
        "ours grpo (fused lm_head)": "torch",
        "ours ar+lopti (fused)": "cpp",
        "ours ar+lopti (fused lm_head)": "torch",
        "ours ar+lopti (TRL's loss)": "none (TRL's loss)",
    }


def test_step_logs_stay_out_of_out_until_bundled_and_the_report_names_the_commit_given(tmp_path):
    """The device tool brings back at most 8 files from $OUT: the step logs are bundled into one file after every
    step, so a call cut short mid-session (a timeout_s under the session's) still brings back the report and the
    JSON. Before, the logs lay in $OUT until the end (a report, 4 JSON, 6 logs and the wheels' log: 12 files). The
    report names GPU_SESSION_COMMIT: the device's copy of the tree has commits of its own. And a warning torch prints
    on stderr at import does not make the CUDA check refuse."""
    steps = tmp_path / "steps.txt"
    steps.write_text('first|5|echo one\nsecond|5|ls "$OUT"\n')
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho 'UserWarning: something at import' >&2\nexec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    env = {"GPU_SESSION_STEPS_FILE": str(steps), "GPU_SESSION_MIN_STEP_S": "1", "OUT": str(tmp_path / "out"),
           "PYTHON": str(fake), "GPU_SESSION_COMMIT": "abc1234"}  # fmt: skip
    if not __import__("torch").cuda.is_available():
        # the real check, with CUDA answered True on stdout after the warning on stderr
        fake.write_text("#!/bin/sh\necho 'UserWarning: something at import' >&2\necho 'True 2.11.0'\n")
    out = session(env=env)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout
    assert " commit abc1234, budget 420 s" in lines[0]
    begin = lines.index("== second (budget 5 s): ls \"$OUT\"")
    end = next(i for i, line in enumerate(lines) if line.startswith("== second: ok in "))
    listing = lines[begin + 1 : end]
    assert listing == ["gpu_session.log", "step_logs.tgz"]  # while the session runs: no loose step log
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_session.log", "step_logs.tgz"]
