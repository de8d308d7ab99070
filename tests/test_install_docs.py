"""docs/INSTALL.md's install blocks, one per user: each installs torch 2.13.0 first (CPU blocks from PyTorch's CPU
wheel index) and pins it in every later pip step, so that pip never downloads a torch that it then replaces; the
later steps of the CPU blocks, resolved with ``pip install --dry-run`` against an environment that holds only
torch 2.13.0+cpu (this environment's, linked), would install no other torch and nothing of CUDA. The verl CPU block is
the Makefile's ``venv-verl`` recipe, step by step: CI runs that recipe for real (``make test``), and tests/verl checks
the environment it builds (``test_plugin.py``).

The dry runs ask the package index (as a user's pip does): about 30-60 s each here, two of them.
"""

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.test_install_wheel import copy_sources

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "docs" / "INSTALL.md"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CONSTRAINT = ["-c", "requirements/constraints.txt"]
USERS = {"local trainer", "kernels only", "TRL", "OpenRLHF", "verl"}
# Installed by no CPU step after torch: another torch, CUDA's libraries, Triton (a CUDA torch's companion).
NOT_ON_CPU = re.compile(r"torch|nvidia-.*|cuda-.*|triton")


def install_blocks() -> dict:
    """``(users, device) -> [logical command lines]`` of each fenced block starting ``# install: <users> on <device>``."""
    blocks, lines, inside = {}, None, False
    for line in INSTALL.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = not inside
            if not inside and lines and lines[0].startswith("# install:"):
                header = re.match(r"# install: (.+?) on (CPU|GPU)\b", lines[0])
                assert header, f"an install block's first line names its users and device: {lines[0]!r}"
                blocks[(header.group(1), header.group(2))] = [" ".join(shlex.split(x, comments=True)) for x in lines]
            lines = [] if inside and line.strip() == "```bash" else None
        elif lines is not None:
            lines.append(line)
    return {key: [x for x in cmds if x] for key, cmds in blocks.items()}


BLOCKS = install_blocks()


def pip_installs(commands: list) -> list:
    """The argument lists of the block's ``pip install`` commands (environment prefixes dropped)."""
    found = []
    for command in commands:
        words = [w for w in shlex.split(command) if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)]
        if words[:2] == ["pip", "install"]:
            found.append(words[2:])
    return found


def test_every_user_has_a_cpu_and_a_gpu_block():
    covered = {(user.strip(), device) for users, device in BLOCKS for user in re.split(r",| and ", users.split(" (")[0])}
    for user in USERS:
        for device in ("CPU", "GPU"):
            assert any(u.startswith(user) for u, d in covered if d == device), f"no {device} block for {user}"


def test_the_constraints_file_pins_the_torch_the_blocks_install():
    lines = [x.strip() for x in (REPO / "requirements" / "constraints.txt").read_text().splitlines()]
    assert "torch==2.13.0" in lines


@pytest.mark.parametrize("key", sorted(BLOCKS), ids=[f"{u} on {d}" for u, d in sorted(BLOCKS)])
def test_torch_goes_first_and_stays(key):
    _, device = key
    installs = pip_installs(BLOCKS[key])
    if not installs:  # `make install`: the Makefile's own torch step
        assert BLOCKS[key][0].startswith("make install"), BLOCKS[key]
        makefile = (REPO / "Makefile").read_text()
        assert f"TORCH_CPU := torch==2.13.0 --index-url {CPU_INDEX}" in makefile
        steps = re.findall(r"\$\(PIP\) install (.*)", makefile.split("$(VENV)/.installed:")[1].split("touch $@")[0])
        assert steps[1] == "--no-deps $(TORCH_CPU)" and all("$(CONSTRAINTS)" in s or "--no-deps" in s for s in steps[2:])
        return
    tools = {"pip", "setuptools", "wheel", "packaging", "psutil", "ninja"}
    first = next(i for i, args in enumerate(installs) if not set(a for a in args if not a.startswith("-")) <= tools)
    torch_args = installs[first]
    assert "torch==2.13.0" in torch_args, f"{key}: torch is not the first thing installed: {torch_args}"
    if device == "CPU":
        assert torch_args[torch_args.index("--index-url") + 1] == CPU_INDEX, torch_args
    else:
        assert "--index-url" not in torch_args and "--extra-index-url" not in torch_args  # the index's CUDA build
    for args in installs[first + 1 :]:
        assert args[:2] == CONSTRAINT, f"{key}: a later step without the torch pin: {args}"


def environment_with_only_torch(root: Path) -> Path:
    """A venv whose site-packages links this environment's torch and its requirements, nothing else."""
    linked = root / "torch-only"
    linked.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        todo += [r.name for r in map(Requirement, dist.requires or []) if r.marker is None or
                 r.marker.evaluate({"extra": ""})]  # fmt: skip
        site = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if not top.startswith("..") and top != "bin" and (site / top).exists() and not (linked / top).exists():
                (linked / top).symlink_to(site / top)
    env = root / "venv"
    venv.create(env, with_pip=False)
    (site_packages,) = env.glob("lib/python*/site-packages")
    (site_packages / "torch-only.pth").write_text(f"{linked}\n")
    return env / "bin" / "python"


CPU_RESOLVED = [key for key in sorted(BLOCKS) if key[1] == "CPU" and key[0].split(" (")[0] in ("local trainer, demo, audit", "TRL")]


@pytest.mark.parametrize("key", CPU_RESOLVED, ids=[u.split(" (")[0] for u, _ in CPU_RESOLVED])
def test_the_cpu_block_resolves_without_another_torch_or_cuda(key, tmp_path):
    source = copy_sources(tmp_path / "checkout")
    python = environment_with_only_torch(tmp_path)
    probe = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert probe.stdout.strip() == "2.13.0+cpu", probe.stderr[-2000:]
    installs = pip_installs(BLOCKS[key])
    assert any("torch==2.13.0" in args for args in installs)
    for i, args in enumerate(a for a in installs if "torch==2.13.0" not in a):
        report = tmp_path / f"report{i}.json"
        command = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", "install",
                   "--dry-run", "--quiet", "--report", str(report), *args]  # fmt: skip
        run = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"{' '.join(args)}:\n{run.stderr[-3000:]}"
        names = sorted(item["metadata"]["name"] for item in json.loads(report.read_text())["install"])
        assert "openrlhf-lopti" in names, names
        assert not [n for n in names if NOT_ON_CPU.fullmatch(canonicalize_name(n))], names
        if "[trl]" in " ".join(args):
            assert "trl" in names, names


def test_the_example_scripts_the_blocks_run_take_those_arguments():
    # A block's first run of an example script (`python examples/<...>.py ...`) parses with that script's own parser.
    ran = 0
    for commands in BLOCKS.values():
        for command in commands:
            words = shlex.split(command)
            if words[:1] == ["python"] and len(words) > 1 and words[1].startswith("examples/"):
                spec = importlib.util.spec_from_file_location("install_block_example", REPO / words[1])
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)  # its parser; __main__ does not run
                try:
                    module.parse_args(words[2:])
                except SystemExit as exc:
                    pytest.fail(f"`{command}` does not parse: exit {exc.code}")
                ran += 1
    assert ran >= 1


def makefile_recipe(target: str, pip: str) -> list:
    """The pip commands of a Makefile recipe as a user types them: ``pip`` for ``pip``'s variable, the Makefile's
    torch and constraints variables expanded."""
    makefile = (REPO / "Makefile").read_text()
    torch_cpu = re.search(r"^TORCH_CPU := (.*)$", makefile, re.M).group(1)
    recipe = makefile.split(f"\n{target}:")[1].split("touch $@")[0]
    steps = []
    for line in recipe.splitlines():
        if pip in line:
            line = line.replace(pip, "pip").replace("$(TORCH_CPU)", torch_cpu)
            steps.append(" ".join(shlex.split(line.replace("$(CONSTRAINTS)", " ".join(CONSTRAINT)))))
    return steps


def test_the_verl_cpu_block_is_make_venv_verl():
    """One recipe, two copies: `make venv-verl` (what the tests run in) and the block a user pastes."""
    (key,) = [k for k in BLOCKS if k[0].startswith("verl") and k[1] == "CPU"]
    block = [c for c in BLOCKS[key] if re.match(r"([A-Z_][A-Z0-9_]*=\S* )*pip ", c)]
    assert block == makefile_recipe("$(VERL_VENV)/.installed", "$(VERL_PIP)")

