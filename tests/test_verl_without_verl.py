"""openrlhf_lopti.verl without verl installed (the main .venv has none: verl runs in its own .venv-verl, tests/verl):
one line saying what to install."""

import importlib
import subprocess
import sys

import pytest

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# from a checkout, the command installs the extra from that checkout (the package is on no index)
MESSAGE = ("openrlhf_lopti.verl needs verl 0.9.1, in its own environment (verl and TRL cannot share one): "
           f'make -C "{REPO}" venv-verl, then use {REPO}/.venv-verl/bin/python (see docs/VERL.md)')


def test_importing_the_verl_front_end_without_verl_raises_one_line(monkeypatch):
    for name in [n for n in sys.modules if n == "openrlhf_lopti.verl" or n.startswith("openrlhf_lopti.verl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verl", None)  # what an environment without verl gives: ModuleNotFoundError
    with pytest.raises(ImportError) as info:
        importlib.import_module("openrlhf_lopti.verl")
    assert str(info.value) == MESSAGE
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained traceback of verl's


def test_a_python_without_verl_prints_that_line_last():
    code = "import importlib.util, sys; assert importlib.util.find_spec('verl') is None; import openrlhf_lopti.verl"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == f"ImportError: {MESSAGE}"
    assert "During handling" not in run.stderr and "direct cause" not in run.stderr
