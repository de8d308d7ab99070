"""main_ppo's configuration for a run on the CPU (the other half of the seam: :mod:`.cpu`), as hydra overrides.

Imports nothing of verl, so that the launch script can print them in a fraction of a second by running this file
by path (``python openrlhf_lopti/verl/cpu_overrides.py --ngpus N``: importing the module through its package would
import verl first, ~20 s).
"""

import argparse
import os
import sys
from typing import List, Optional

# main_ppo overrides for an actor on the CPU: what runs there (module docstring). reshard_after_forward=false: see
# tests/verl/harness.py (the same numbers in fp32; the tests' float64 runs need it).
CPU_OVERRIDES = (
    "actor_rollout_ref.model.use_remove_padding=false",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "++actor_rollout_ref.model.override_config.attn_implementation=eager",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.use_torch_compile=false",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
    "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32",
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=fp32",
)


def main_ppo_overrides(ngpus: int = 1, num_cpus: Optional[int] = None, temp_dir: Optional[str] = None) -> List[str]:
    """main_ppo's overrides for a run on the CPU: ``ngpus`` actor ranks = rollout ranks = Ray logical GPUs, Ray a
    private local cluster (``address=local``: never another cluster on the machine; its own ``temp_dir``), the
    rollout server vLLM's CPU build in fp32 without sleep mode (vLLM-CPU refuses it; verl's default is on,
    ``workers/config/rollout.py:268``), one agent-loop worker, one reward worker, one TransferQueue storage unit."""
    if ngpus < 1:
        raise ValueError(f"ngpus: the number of actor ranks must be >= 1, got {ngpus}")
    # Ray's CPUs are slots, not cores: the task runner, TransferQueue's controller and storage, the agent-loop and
    # reward workers and each resource-pool bundle (max_colocate_count CPUs per rank, single_controller/ray/base.py:
    # 205) take one or more; too few and a placement group waits forever
    cpus = num_cpus if num_cpus is not None else 8 + 4 * ngpus
    if cpus < 1:  # Ray would start, and the first placement group wait forever
        raise ValueError(f"num_cpus: Ray's CPU slots must be >= 1 (the default for {ngpus} ranks: {8 + 4 * ngpus}), "
                         f"got {cpus}")  # fmt: skip
    ray = "ray_kwargs.ray_init"
    out = list(CPU_OVERRIDES) + [
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={ngpus}",
        "trainer.nnodes=1",
        f"{ray}.num_cpus={cpus}",
        f"++{ray}.num_gpus={ngpus}",
        f"++{ray}.address=local",
        f"++{ray}.include_dashboard=false",
        # Ray starts its workers at nice 15; on a CPU they are the whole run (actor, rollout, reward), so beside any
        # other work they would starve. Passed to the local Ray that main_ppo's ray.init starts (a _system_config
        # value overrides Ray's environment variable: the user's RAY_worker_niceness, when set, is passed instead).
        f"++{ray}._system_config.worker_niceness={os.environ.get('RAY_worker_niceness') or 0}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "++actor_rollout_ref.rollout.enable_sleep_mode=false",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
        "++actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
        "++actor_rollout_ref.ref.fsdp_config.mixed_precision.reduce_dtype=fp32",
        "++actor_rollout_ref.ref.fsdp_config.mixed_precision.buffer_dtype=fp32",
        "actor_rollout_ref.ref.use_torch_compile=false",
        "reward.num_workers=1",
        "data.dataloader_num_workers=0",  # no loader subprocesses in the task runner (memory, and its teardown)
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    if temp_dir is not None:
        out.append(f"++{ray}._temp_dir={temp_dir}")
    return out


class _Parser(argparse.ArgumentParser):
    """A usage error in one line (the package's ``errors.ArgumentParser`` rule, without importing the package)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def main(argv: Optional[list] = None) -> int:
    """``python <this file> --ngpus N [--temp-dir DIR]``: main_ppo's CPU overrides, one a line (for
    ``examples/verl/train_kk_grpo_ar_lopti.sh`` under ``CPU=1``)."""
    parser = _Parser(prog="cpu_overrides.py", description="main_ppo's overrides for a CPU run")
    parser.add_argument("--ngpus", type=int, default=1, help="actor ranks (Ray logical GPUs)")
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray's logical CPUs (default: 8 + 4 x ngpus)")
    parser.add_argument("--temp-dir", default=None, help="Ray's private temp dir (short path: socket names)")
    ns = parser.parse_args(argv)
    try:
        print("\n".join(main_ppo_overrides(ns.ngpus, ns.num_cpus, ns.temp_dir)))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
