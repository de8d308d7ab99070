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
