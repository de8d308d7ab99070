"""A command's first screen is ours: no pynvml FutureWarning, no DeepSpeed accelerator line before our output."""

import os
import subprocess
import sys

NOISE = ("FutureWarning", "pynvml", "Setting accelerator to CPU")


def test_a_command_prints_no_upstream_noise(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "PYTHONWARNINGS")}
    run = subprocess.run(
        [sys.executable, "-m", "openrlhf_lopti", "tiny-model", "--out", str(tmp_path / "model")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith("tiny-model: "), run.stdout
    for noise in NOISE:
        assert noise not in run.stderr, run.stderr


def test_the_openrlhf_cli_prints_no_upstream_noise_before_its_help():
    """The OpenRLHF-style CLI imports torch before anything of ours runs: quiet only because the install has
    nvidia-ml-py's ``pynvml`` module rather than the ``pynvml`` shim package (requirements/cpu.txt, Makefile)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "PYTHONWARNINGS")}
    run = subprocess.run(
        [sys.executable, "-m", "openrlhf_lopti.cli.train_ppo_ray", "--help"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: python -m openrlhf_lopti.cli.train_ppo_ray"), run.stdout[:200]
    for noise in NOISE:
        assert noise not in run.stderr, run.stderr
