"""Every "install X" message gives a command that works from where the user is (openrlhf_lopti.install), and the C++
kernel's "unavailable" warning says what is missing and the command that fixes it (openrlhf_lopti.ops.cpp_policy_loss).

The command for a wheel install is run through pip in tests/test_install_wheel.py; here each source pip can record
(PEP 610) and each reason the kernel cannot be built, one at a time, in this process.
"""

import importlib
import warnings
from pathlib import Path

import pytest

from openrlhf_lopti import install
from openrlhf_lopti.ops import cpp_policy_loss as cpp

REPO = Path(__file__).resolve().parents[1]


def test_from_a_checkout_the_command_installs_that_checkout():
    assert install.pip_install("trl") == f'pip install -e "{REPO}[trl]"'
    assert install.pip_install() == f'pip install -e "{REPO}"'


@pytest.mark.parametrize(
    "recorded, command",
    [
        ({"url": "https://github.com/o/openrlhf-lopti.git", "vcs_info": {"vcs": "git", "commit_id": "ab12",
          "requested_revision": "v0.1"}},
         'pip install "openrlhf-lopti[trl] @ git+https://github.com/o/openrlhf-lopti.git@v0.1"'),
        ({"url": "https://github.com/o/r.git", "vcs_info": {"vcs": "git", "commit_id": "ab12"}},
         'pip install "openrlhf-lopti[trl] @ git+https://github.com/o/r.git"'),
        ({"url": "file:///src/my%20checkout", "dir_info": {}}, 'pip install "/src/my checkout[trl]"'),
        ({"url": "file:///src/co", "dir_info": {"editable": True}}, 'pip install -e "/src/co[trl]"'),
        ({"url": "file:///w/openrlhf_lopti-0.1.0-py3-none-any.whl", "archive_info": {}},
         'pip install "openrlhf-lopti[trl] @ file:///w/openrlhf_lopti-0.1.0-py3-none-any.whl"'),
        (None, 'pip install "openrlhf-lopti[trl]"'),  # nothing recorded: installed from an index by name
    ],
    ids=["git-tag", "git", "folder", "editable-folder", "wheel-file", "index"],
)
def test_an_installed_copy_gets_the_source_pip_recorded(monkeypatch, recorded, command):
    monkeypatch.setattr(install, "checkout", lambda: None)
    monkeypatch.setattr(install, "_recorded_source", lambda: recorded)
    assert install.pip_install("trl") == command


# ---------------------------------------------------------------- the kernel: why it is unavailable, and the fix
@pytest.fixture
def fresh_loader(monkeypatch):
    """cpp_policy_loss as if nothing had been tried yet in this process (restored afterwards)."""
    monkeypatch.setattr(cpp, "_tried", False)
    monkeypatch.setattr(cpp, "_loaded", False)
    monkeypatch.setattr(cpp, "_error", None)
    monkeypatch.delenv("OPENRLHF_LOPTI_NO_JIT", raising=False)
    return monkeypatch


def unavailable_warning() -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpp.cpp_available() is False
    ours = [str(w.message) for w in caught if "openrlhf_lopti" in str(w.message)]
    assert len(ours) == 1 and "\n" not in ours[0], ours
    return ours[0]


def test_without_a_compiler_the_warning_says_how_to_get_one(fresh_loader, tmp_path):
    fresh_loader.setattr(cpp, "_TORCH_STAMP", tmp_path / "built-for")
    (tmp_path / "built-for").write_text("0.0.1\n")  # the built _C is skipped, so a JIT build is what is tried
    fresh_loader.setenv("CXX", str(tmp_path / "no-such-c++"))
    message = unavailable_warning()
    assert f"openrlhf_lopti._C was built for torch 0.0.1, this is torch {cpp.torch.__version__}" in message
    assert f"no C++ compiler ('{tmp_path / 'no-such-c++'}' is not on PATH)" in message
    assert "apt-get install g++" in message and "or set CXX" in message


def test_an_extension_built_for_another_torch_is_not_loaded(fresh_loader, tmp_path):
    imported, built = [], []
    importlib.import_module("openrlhf_lopti._C")  # the ops registered, as after any successful load or JIT build
    fresh_loader.setattr(cpp, "_TORCH_STAMP", tmp_path / "built-for")
    (tmp_path / "built-for").write_text("0.0.1\n")
    fresh_loader.setattr(cpp.importlib, "import_module", lambda name: imported.append(name))
    fresh_loader.setattr(cpp, "_jit_build", lambda: built.append(True))
    assert cpp.cpp_available() is True  # the JIT build against this torch (a stub here) replaced it
    assert imported == [] and built == [True]
    (tmp_path / "built-for").write_text(cpp.torch.__version__ + "\n")  # built for this torch: loaded as it is
    fresh_loader.setattr(cpp, "_tried", False)
    assert cpp.cpp_available() is True
    assert imported == ["openrlhf_lopti._C"] and built == [True]


def test_without_ninja_the_warning_says_pip_install_ninja(fresh_loader, tmp_path):
    fresh_loader.setattr(cpp, "_TORCH_STAMP", tmp_path / "built-for")
    (tmp_path / "built-for").write_text("0.0.1\n")
    real_which = cpp.shutil.which
    fresh_loader.setattr(cpp.shutil, "which", lambda name, *a, **k: None if name == "ninja" else real_which(name))
    fresh_loader.setitem(__import__("sys").modules, "ninja", None)  # the pip package is not there either
    assert "torch builds C++ extensions with ninja, not installed: pip install ninja" in unavailable_warning()


def test_without_sources_the_warning_says_how_to_reinstall(fresh_loader, tmp_path):
    fresh_loader.setattr(cpp, "_TORCH_STAMP", tmp_path / "built-for")
    (tmp_path / "built-for").write_text("0.0.1\n")
    fresh_loader.setattr(cpp, "_PACKAGE", tmp_path / "site" / "openrlhf_lopti")
    message = unavailable_warning()
    where = tmp_path / "site" / "openrlhf_lopti" / "csrc"  # not site/csrc: in site-packages, another package's
    assert f"no C++ sources in {where} (a wheel" in message
    assert f'reinstall, pip install -e "{REPO}" --force-reinstall --no-deps' in message


def test_no_jit_says_how_to_turn_the_build_back_on(fresh_loader, tmp_path):
    fresh_loader.setattr(cpp, "_TORCH_STAMP", tmp_path / "built-for")
    (tmp_path / "built-for").write_text("0.0.1\n")
    fresh_loader.setenv("OPENRLHF_LOPTI_NO_JIT", "1")
    assert "unset it to build the kernel at first use" in unavailable_warning()


QUIET_IMPORT = """
import logging, sys, torch
torch.cuda._is_compiled = lambda: True  # as a CUDA build of torch on a machine without a GPU
torch.version.cuda = "13.0"
torch.cuda.is_available = lambda: False
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("torch.utils.cpp_extension").addHandler(handler)  # torch's loggers may not propagate
if sys.argv[1] == "ours":
    from openrlhf_lopti.ops.cpp_policy_loss import _quiet_import_of_the_builder
    builder = _quiet_import_of_the_builder()
else:
    import torch.utils.cpp_extension as builder
print(builder.CUDA_HOME, [r.getMessage() for r in records if r.name == "torch.utils.cpp_extension"])
"""


def test_the_build_does_not_print_torchs_no_cuda_runtime_line(tmp_path):
    # torch's builder, imported in a CUDA build of torch without a GPU, logs "No CUDA runtime is found": the JIT
    # build of the CPU kernel imports it with that line dropped (and only while it imports).
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUDA_HOME=str(tmp_path))
    said = {}
    for how in ("plain", "ours"):
        run = subprocess.run([sys.executable, "-c", QUIET_IMPORT, how], env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        said[how] = run.stdout.strip().splitlines()[-1]
    assert said["plain"] == f"{tmp_path} [\"No CUDA runtime is found, using CUDA_HOME='{tmp_path}'\"]", said
    assert said["ours"] == f"{tmp_path} []", said
