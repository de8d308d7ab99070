"""`openrlhf-lopti bench` (the loss-head benchmark) lives in the package, so it and `check-gpu` run from an installed
package; `bench-step` stays in benchmarks/ and says in one line that it needs a source checkout."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import openrlhf_lopti
from openrlhf_lopti.__main__ import COMMANDS

INSTALLED_RUN = """
import sys
sys.modules["openrlhf"] = sys.modules["triton"] = None  # installed without the [openrlhf] extra, nor triton
import openrlhf_lopti
from openrlhf_lopti.__main__ import main
print("package:", openrlhf_lopti.__file__)
print("bench:", main(["bench", "--device", "cpu", "--n", "16", "--v", "96", "--seq-len", "8", "--repeats", "1",
                      "--warmup", "0", "--backends", "openrlhf,torch,triton", "--ar-alpha", "0",
                      "--json", "bench.json"]))
print("bench-step:", main(["bench-step"]))
print("benchmarks imported:", any(name.split(".")[0] == "benchmarks" for name in sys.modules))
"""


def test_the_package_commands_import_nothing_from_benchmarks():
    assert COMMANDS["bench"][0] == "openrlhf_lopti.cli.bench_loss_head"
    assert COMMANDS["check-gpu"][0] == "openrlhf_lopti.cli.check_gpu"
    package = Path(openrlhf_lopti.__file__).parent
    assert not [path for path in package.rglob("*.py") if "from benchmarks" in path.read_text(encoding="utf-8")]


def test_bench_runs_from_an_installed_package_and_bench_step_says_it_needs_a_checkout(tmp_path):
    """The package copied alone into a site folder (no benchmarks/ beside it), as `pip install` leaves it; the
    rows whose packages are missing say so and the others run."""
    site = tmp_path / "site"
    shutil.copytree(Path(openrlhf_lopti.__file__).parent, site / "openrlhf_lopti",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(site), TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", INSTALLED_RUN], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"package: {site / 'openrlhf_lopti' / '__init__.py'}" in out
    assert "bench: 0" in out and "bench-step: 2" in out and "benchmarks imported: False" in out
    report = json.loads((tmp_path / "bench.json").read_text())
    statuses = [(row["backend"], row["status"]) for row in report["rows"]]
    assert statuses == [("openrlhf", "not installed (openrlhf)"), ("torch", "ok"), ("triton", "not installed (triton)")]
    assert report["versions"]["triton"] is None
    errors = [line for line in result.stderr.splitlines() if "bench-step" in line]
    assert errors == [
        "openrlhf-lopti bench-step: error: `bench-step` needs a source checkout "
        "(benchmarks/bench_train_step.py beside the package); this install has none"
    ]


def test_the_benchmarks_script_is_the_package_program(tmp_path, capsys):
    from benchmarks import bench_policy_loss
    from openrlhf_lopti.cli import bench_loss_head

    # in a source checkout the JSON still goes to benchmarks/results/ by default
    assert bench_loss_head.RESULTS_DIR == Path(bench_policy_loss.__file__).resolve().parent / "results"
    assert bench_policy_loss.make_inputs is bench_loss_head.make_inputs
    path = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--n", "8", "--v", "40", "--seq-len", "8", "--repeats", "1", "--warmup", "0",
            "--backends", "torch", "--ar-alpha", "0", "--json", str(path)]  # fmt: skip
    assert bench_policy_loss.main(argv) == 0 and json.loads(path.read_text())["benchmark"] == "bench_policy_loss"
    with pytest.raises(SystemExit, match="2"):
        bench_policy_loss.main(argv)  # the JSON exists: refused, under the script's own name
    assert "bench_policy_loss: error: " in capsys.readouterr().err


def test_a_row_whose_op_ran_another_backend_is_refused_and_the_run_fails(tmp_path, monkeypatch, capsys):
    """Every figure says what ran: a row labelled ``cpp`` whose op ran the torch reference (as ``auto`` once did
    on a GPU) is not written as that backend's figure; its status says what ran and the run exits 1. The other
    rows record the backend they ran."""
    from openrlhf_lopti.cli import bench_loss_head
    from openrlhf_lopti.ops import cpp_policy_loss, torch_policy_loss

    monkeypatch.setattr(cpp_policy_loss, "cpp_policy_loss", torch_policy_loss.torch_policy_loss)  # a silent fallback
    path = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--n", "16", "--v", "96", "--seq-len", "8", "--repeats", "1", "--warmup", "0",
            "--backends", "torch,cpp", "--ar-alpha", "0", "--json", str(path)]  # fmt: skip
    assert bench_loss_head.main(argv) == 1
    rows = {r["backend"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["torch"]["status"] == "ok" and rows["torch"]["backend_ran"] == ["torch"]
    assert rows["cpp"]["status"] == "refused: the op ran ['torch'], this row is labelled cpp"
    assert "refused rows (the op ran another backend than their label): cpp" in capsys.readouterr().err


def test_every_row_that_ran_says_what_ran_peers_too(tmp_path):
    """A peer's row (OpenRLHF's loss here; Liger's on a GPU) records its backend as ours do, so a JSON reader can
    check every figure the same way (before: only our rows had ``backend_ran``)."""
    from openrlhf_lopti.cli import bench_loss_head

    path = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--n", "16", "--v", "96", "--seq-len", "8", "--repeats", "1", "--warmup", "0",
            "--backends", "openrlhf,torch", "--ar-alpha", "0", "--json", str(path)]  # fmt: skip
    assert bench_loss_head.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    assert all(r["backend_ran"] == [r["backend"]] for r in rows), rows


def test_a_step_policy_call_is_sync_free_its_checks_read_at_the_step(tmp_path):
    """The ``syncs_free`` figure (goal: 0 host syncs per call, step policy) counts the loss call, forward and
    backward, not the one read a trainer makes before its optimizer step. Before, the measured step ended in
    ``raise_if_bad()`` (an ``.item()``): on a GPU both step-policy rows said HOST SYNC whatever the kernel did. On CPU
    the host reads are counted as ATen ops (the Triton kernel runs under the interpreter, as conftest sets)."""
    from openrlhf_lopti.cli import bench_loss_head

    path = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--n", "16", "--v", "96", "--seq-len", "8", "--repeats", "1", "--warmup", "0",
            "--backends", "triton,triton-step,triton-onepass", "--ar-alpha", "0", "--json", str(path)]  # fmt: skip
    assert bench_loss_head.main(argv) == 0
    rows = {r["backend"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["triton-step"]["syncs_free"] is True and rows["triton-onepass"]["syncs_free"] is True, rows
    assert "syncs_free" not in rows["triton"]  # the eager policy reads its word in the call, by design
    # the counter sees a host read where there is one: the same step with its checks read
    cfg = bench_loss_head.Config(n=16, v=96, dtype=bench_loss_head.torch.float32, device="cpu", seq_len=8,
                                 keep_fraction=1.0, alpha=0.0, ar_alpha=0.0, kl_coef=0.001, eps_low=0.2,
                                 eps_high=0.28, temperature=1.0, seed=0)  # fmt: skip
    data = bench_loss_head.make_inputs(cfg)
    leaf = data["logits"].detach().requires_grad_(True)
    with_read = bench_loss_head._step_ours(cfg, data, "triton-step", 0.0, [])
    assert bench_loss_head.sync_free(with_read, leaf) is False


def test_the_openrlhf_row_runs_without_ray_as_on_the_gpu_image(tmp_path):
    """The GPU image has OpenRLHF's wheel but no Ray: gpu_steps registers the flash-attn stand-ins from their file,
    and the openrlhf row must then run. Before, it imported ``openrlhf_lopti.openrlhf`` (which needs Ray) and the H100
    session's row read "not installed (ray)"."""
    path = tmp_path / "bench.json"
    code = (
        "import sys; sys.modules['ray'] = None\n"  # Ray not installed, as on the image
        "from benchmarks import gpu_steps\n"
        "print(gpu_steps.openrlhf_loss_status())\n"
        "from openrlhf_lopti.cli import bench_loss_head\n"
        f"sys.exit(bench_loss_head.main(['--device', 'cpu', '--n', '16', '--v', '96', '--seq-len', '8', '--repeats',"
        f" '1', '--warmup', '0', '--backends', 'openrlhf', '--ar-alpha', '0', '--json', {str(path)!r}]))\n"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=600)
    assert out.returncode == 0, out.stderr.strip().splitlines()[-1:]
    assert "ok" in out.stdout.splitlines(), out.stdout  # openrlhf_loss_status(): DeepSpeed is real here
    row = json.loads(path.read_text())["rows"][0]
    assert (row["status"], row["backend_ran"]) == ("ok", ["openrlhf"]), row


def _bench_fails(capsys, argv):
    """``openrlhf-lopti bench ARGV``: exit code 2 and one line on stderr, returned."""
    from openrlhf_lopti.__main__ import main as cli_main

    assert cli_main(["bench", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--n", "0"], "--n must be an integer >= 1, got 0"),
        (["--seq-len", "0"], "--seq-len must be an integer >= 1, got 0"),
        (["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
        (["--v", "0"], "--v must be an integer >= 1, got 0"),
        (["--n", "0", "--seq-len", "0", "--repeats", "0"], "--n must be an integer >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be an integer >= 0, got -1"),
        (["--seed", "-1"], "--seed must be an integer in [0, 2**64 - 1], got -1"),
        (["--seed", str(2**64)], f"--seed must be an integer in [0, 2**64 - 1], got {2**64}"),
        (["--keep-fraction", "nan"], "--keep-fraction must be in (0, 1], got nan"),
        (["--alpha", "1.7"], "--alpha must be in [0, 1], got 1.7"),
        (["--alpha", "nan"], "--alpha must be in [0, 1], got nan"),
        (["--ar-alpha", "-0.1"], "--ar-alpha must be in [0, 1], got -0.1"),
        (["--eps-low", "3"], "--eps-low must be in [0, 1), got 3.0"),
        (["--eps-low", "-0.1"], "--eps-low must be in [0, 1), got -0.1"),
        (["--eps-high", "-1"], "--eps-high must be a finite number >= 0, got -1.0"),
        (["--eps-high", "inf"], "--eps-high must be a finite number >= 0, got inf"),
        (["--kl-coef", "nan"], "--kl-coef must be a finite number, got nan"),
        (["--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
        (["--temperature", "-1"], "--temperature must be a finite number > 0, got -1.0"),
        (["--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
        (["--temperature", "1e-300"], "--temperature must be a finite number > 0, got 1e-300"),
        (["--device", "foo"], "--device must be cpu, cuda or cuda:<index>, got 'foo'"),
    ],
)
def test_bench_refuses_a_bad_number_in_one_line_before_building_inputs(tmp_path, capsys, monkeypatch, flags, message):
    """Every numeric flag is checked up front (before: 0 for --n / --seq-len / --repeats silently became the
    default, and --alpha 1.7 or --eps-low 3 died in a traceback from the loss after the inputs were built)."""
    from openrlhf_lopti.cli import bench_loss_head

    def no_inputs(cfg):
        raise AssertionError("inputs built before the flags were checked")

    monkeypatch.setattr(bench_loss_head, "make_inputs", no_inputs)
    path = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--n", "16", "--v", "32", "--seq-len", "8", "--repeats", "1", "--warmup", "0",
            "--backends", "torch", "--ar-alpha", "0", "--json", str(path), *flags]  # fmt: skip
    assert _bench_fails(capsys, argv) == f"openrlhf-lopti bench: error: {message}"
    assert not path.exists()


def test_bench_as_a_script_reports_a_bad_flag_in_one_line(tmp_path, capsys, monkeypatch):
    """Run as a script (sys.argv read; benchmarks/bench_policy_loss.py's name), the same one line and exit code 2,
    no usage block; `openrlhf-lopti bench` names the --help to read."""
    from benchmarks import bench_policy_loss

    monkeypatch.setattr(sys, "argv", ["bench_policy_loss", "--device", "cpu", "--n", "0"])
    with pytest.raises(SystemExit, match="2"):
        bench_policy_loss.main()
    assert capsys.readouterr().err == "bench_policy_loss: error: --n must be an integer >= 1, got 0\n"
    line = _bench_fails(capsys, ["--device", "cpu", "--n", "8", "--seq-len", "16", "--json", str(tmp_path / "b.json")])
    assert line == ("openrlhf-lopti bench: error: --n (8) must be a multiple of --seq-len (16) "
                    "(see `openrlhf-lopti bench --help`)")  # fmt: skip
