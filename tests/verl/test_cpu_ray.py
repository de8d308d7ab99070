"""The local Ray of a ``CPU=1`` main_ppo run: its workers at the driver's priority. Ray's default (nice 15) starves
them beside any other work on a CPU machine, where they are the whole run."""

import os
import shutil
import tempfile

from openrlhf_lopti.verl.cpu_overrides import main_ppo_overrides

from . import harness


def test_main_ppos_local_ray_runs_its_workers_at_the_drivers_priority(monkeypatch):
    import ray
    from omegaconf import OmegaConf

    monkeypatch.delenv("RAY_worker_niceness", raising=False)  # the overrides must do it, not this environment

    temp_dir = tempfile.mkdtemp(prefix="verl-ray-", dir="/tmp")  # short, as the script's: socket paths < 108 chars
    cfg = harness.compose(main_ppo_overrides(ngpus=1, temp_dir=temp_dir))
    ray.init(**OmegaConf.to_container(cfg.ray_kwargs.ray_init))  # as main_ppo calls it
    try:
        niceness = ray.get(ray.remote(lambda: os.nice(0)).remote(), timeout=600)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert niceness == os.nice(0)


def test_a_users_worker_niceness_is_kept(monkeypatch):
    """A ``RAY_worker_niceness`` the user set is what main_ppo's local Ray gets (Ray's ``_system_config`` overrides
    its environment variable: before, the overrides' 0 replaced the user's value)."""
    monkeypatch.setenv("RAY_worker_niceness", "7")
    assert "++ray_kwargs.ray_init._system_config.worker_niceness=7" in main_ppo_overrides(ngpus=1)


def test_too_few_ray_cpus_are_refused_not_a_wait_forever():
    """(Before: ``--num-cpus 0`` printed ``num_cpus=0``, whose first placement group would wait forever.)"""
    import pytest

    for cpus in (0, -3):
        with pytest.raises(ValueError, match=rf"^num_cpus: Ray's CPU slots must be >= 1 \(the default for 1 ranks: 12\), "
                                             rf"got {cpus}$"):  # fmt: skip
            main_ppo_overrides(ngpus=1, num_cpus=cpus)


IMPORT_ORDER = """
import sys
from openrlhf_lopti.vllm_cpu import keep_weights_when_packing_on_import
keep_weights_when_packing_on_import()
before = "vllm" in sys.modules
import vllm.model_executor.layers.utils as utils
print(before, getattr(utils.dispatch_cpu_unquantized_gemm, "keeps_weight", False))
"""


def test_a_process_that_imports_vllm_after_the_patch_keeps_the_packed_weights():
    """What ``use_cpu`` now calls, in a process that has not imported vLLM (one that starts an engine later): vLLM's
    CPU layers still keep their weight when they pack it, so weight syncs reach the engine. (Before: ``use_cpu``
    patched only if ``vllm`` was already imported; verl's engine imports bring it in this environment, so the old
    code patched here, by that chain only.)"""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", IMPORT_ORDER], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["False", "True"], result.stdout


def test_the_vllm_cpu_version_alias_adds_cpu_once(monkeypatch):
    """verl looks up the distribution "vllm"; vLLM's CPU build is "vllm-cpu", whose version may carry "+cpu" already.
    (Before: "0.32.0+cpu+cpu", not a version.)"""
    import importlib.metadata

    from openrlhf_lopti.verl import cpu

    def version(name):
        if name == "vllm-cpu":
            return "0.32.0+cpu"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    cpu._alias_vllm_cpu_distribution()
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"
