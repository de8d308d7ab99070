"""The ``--cpu`` rollout engines: upstream's ``create_vllm_engines`` and ``RolloutRayActor`` on vLLM's CPU backend.

:func:`create_cpu_vllm_engines` runs upstream's ``create_vllm_engines`` (its placement groups, bundles and actor
options) with its rollout actor class replaced, for that call, by a subclass of upstream's ``RolloutRayActor``
that changes only the engine arguments upstream hard-codes for CUDA before upstream's ``__init__`` builds
``vllm.AsyncLLMEngine``:

- ``dtype``: the policy's parameter dtype (upstream passes ``"bfloat16"``; the weight sync needs them equal);
- ``worker_extension_cls``: :class:`~.worker.CPUWorkerWrap` (weights received on the CPU over gloo);
- ``gpu_memory_utilization`` dropped; the KV cache size and OpenMP threads come from :data:`VLLM_CPU_ENV`
  (an environment variable already set wins);
- ``enforce_eager``: vLLM's CPU backend would otherwise compile the model with the inductor first.

Everything else (``generate``, ``generate_responses`` with upstream's agent executor and reward file,
``reset_prefix_cache``, the weight-sync calls through ``collective_rpc``) is upstream's code on vLLM's.
"""

import os
from typing import Optional

import ray

from openrlhf.trainer.ray import vllm_engine as upstream

# Sized so the smoke run (2 engines beside 2 policy + 2 reference ranks) fits a 2-core, 24 GiB machine:
# 1 GiB of KV cache per engine (vLLM's smallest setting, far more than a tiny model's rollouts need), no
# binding of OpenMP threads to cores (vLLM's "auto" would bind every engine to the same cores), one thread each.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
WORKER_EXTENSION = "openrlhf_lopti.openrlhf.cpu.worker.CPUWorkerWrap"


class CPURolloutActor(upstream.RolloutRayActor.__ray_actor_class__):
    """Upstream's rollout actor with the engine arguments of vLLM's CPU backend (see the module docstring)."""

    engine_dtype = "float32"  # set per launch by create_cpu_vllm_engines

    async def __init__(self, *args, **kwargs):
        for name, value in VLLM_CPU_ENV.items():
            os.environ.setdefault(name, value)
        kwargs.update(dtype=self.engine_dtype, worker_extension_cls=WORKER_EXTENSION, enforce_eager=True)
        kwargs.pop("gpu_memory_utilization", None)
        await super().__init__(*args, **kwargs)

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """``method`` of every vLLM worker's extension (:class:`~.worker.CPUWorkerWrap`), e.g. ``model_weights``."""
        return await self.llm.collective_rpc(method, args=tuple(args))


def create_cpu_vllm_engines(*args, dtype: str = "float32", **kwargs) -> list:
    """Upstream's ``create_vllm_engines(*args, **kwargs)`` building :class:`CPURolloutActor` s whose engines run in
    ``dtype`` (``"float32"``, ``"bfloat16"`` or ``"float16"``: the policy's parameter dtype)."""
    actor = type("CPURolloutActor", (CPURolloutActor,), {"engine_dtype": dtype, "__module__": __name__})
    saved = upstream.RolloutRayActor
    upstream.RolloutRayActor = ray.remote(actor)  # the name create_vllm_engines builds its actors from
    try:
        return upstream.create_vllm_engines(*args, **kwargs)
    finally:
        upstream.RolloutRayActor = saved


def engine_dtype(param_dtype: Optional[str]) -> str:
    """vLLM's name of ``--ds.param_dtype`` (``bf16`` / ``fp16`` / ``fp32``)."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(param_dtype, "float32")
