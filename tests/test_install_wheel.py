"""The C++ kernel travels with the package: a wheel built from the checkout the way pip builds one by default (build
isolation: no torch to compile against) carries the kernel's sources, and the package installed from it, outside the
checkout, builds the kernel at first use against the torch it runs with and runs the ``cpp`` backend.

The install reuses this environment's torch (the wheel goes into a ``--target`` folder put on ``PYTHONPATH``, with
``--no-deps``): nothing is downloaded but what pip's isolated build environment needs (setuptools). About a minute
here: the wheel build (~15 s) and one compile of csrc/ (~15-40 s).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a source distribution of the checkout holds (MANIFEST.in): the wheel is built from a copy of these, so that
# the build writes nothing into the checkout and nothing built in the checkout (an in-place _C) reaches the wheel.
SOURCE_FILES = ("setup.py", "MANIFEST.in", "README.md")
SOURCE_DIRS = ("openrlhf_lopti", "csrc", "docs", "requirements")

FIRST_USE = textwrap.dedent(
    """
    import json, os, sys, warnings
    # This environment has the checkout installed in editable mode, whose import hook would hand the installed copy
    # the checkout's in-place `openrlhf_lopti._C`: a user's environment has the installed copy alone.
    sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    import torch
    import openrlhf_lopti
    from openrlhf_lopti.install import pip_install
    from openrlhf_lopti.ops import fused_policy_loss
    from openrlhf_lopti.ops.cpp_policy_loss import cpp_available
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = cpp_available()
    gen = torch.Generator().manual_seed(0)
    n, v = 12, 50
    logits = torch.randn(n, v, generator=gen)
    args = dict(labels=torch.randint(0, v, (n,), generator=gen), old_log_probs=-torch.rand(n, generator=gen),
                advantages=torch.randn(n, generator=gen), mask=torch.rand(n, generator=gen) > 0.2, alpha=0.3)
    got = {}
    for backend in ("cpp", "torch"):
        x = logits.clone().requires_grad_(True)
        out = fused_policy_loss(x, **args, backend=backend)
        out.loss.sum().backward()
        got[backend] = (out.loss.detach(), x.grad)
    print(json.dumps({
        "package": openrlhf_lopti.__file__,
        "available": available,
        "warnings": [str(w.message) for w in caught if "openrlhf_lopti" in str(w.message)],
        "loss_error": (got["cpp"][0] - got["torch"][0]).abs().max().item(),
        "grad_error": (got["cpp"][1] - got["torch"][1]).abs().max().item(),
        "libraries": [os.path.join(d, f) for d, _, fs in os.walk(os.environ["TORCH_EXTENSIONS_DIR"])
                      for f in fs if f.endswith(".so")],
        "trl_command": pip_install("trl"),
    }))
    """
)


def copy_sources(dest: Path) -> Path:
    dest.mkdir()
    for name in SOURCE_FILES:
        shutil.copy2(REPO / name, dest / name)
    for name in SOURCE_DIRS:
        shutil.copytree(REPO / name, dest / name,
                        ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.torch_version", "csrc"
                                                      if name == "openrlhf_lopti" else "__none__"))  # fmt: skip
    return dest


def test_a_wheel_built_with_build_isolation_builds_and_runs_the_kernel_where_it_is_installed(tmp_path):
    source = copy_sources(tmp_path / "checkout")
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OPENRLHF_LOPTI_NO_JIT",
                                                              "OPENRLHF_LOPTI_NO_BUILD", "PIP_NO_BUILD_ISOLATION")}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(source)], env=env,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("openrlhf_lopti-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name  # no compiled code: pure Python plus sources
    names = zipfile.ZipFile(wheel).namelist()
    sources = sorted(n for n in names if n.startswith("openrlhf_lopti/csrc/"))
    assert sources == sorted(f"openrlhf_lopti/csrc/{p.name}" for p in (REPO / "csrc").iterdir()
                             if p.suffix in (".cpp", ".h")), sources  # fmt: skip

    install = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                             env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]

    # Outside the checkout: only the installed copy is importable (this environment's editable install comes after
    # PYTHONPATH); a fresh extension cache, so the kernel is compiled here from the installed sources.
    env.update(PYTHONPATH=str(site), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), MAX_JOBS="2")
    run = subprocess.run([sys.executable, "-c", FIRST_USE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["package"] == str(site / "openrlhf_lopti" / "__init__.py"), got["package"]
    assert got["available"] is True and got["warnings"] == [], got
    assert len(got["libraries"]) == 1, got["libraries"]
    assert got["loss_error"] < 1e-5 and got["grad_error"] < 1e-5, got
    # pip recorded the wheel it installed from: the missing-extra command points at that wheel, and pip accepts it
    assert got["trl_command"] == f'pip install "openrlhf-lopti[trl] @ {wheel.as_uri()}"', got["trl_command"]
    requirement = got["trl_command"].split('"')[1]
    dry_run = [*pip[:-1], "install", "--dry-run", "--no-deps", "--no-index", "--target", str(tmp_path / "t")]
    check = subprocess.run([*dry_run, requirement], env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "Would install openrlhf-lopti-0.1.0" in check.stdout.replace("_", "-"), check.stdout
