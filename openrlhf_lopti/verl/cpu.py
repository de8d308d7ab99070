"""The CPU seam of the verl front end, in one place: used only by the tests and the ``--cpu`` rehearsal.

verl 0.9.1 knows the platforms nvidia, npu and rocm; on a machine without CUDA its platform manager falls back to
nvidia, so ``get_device_name()`` says ``cuda`` and the first device call fails. Its FSDP engines are registered
for the devices cuda and npu only. :func:`use_cpu` fills both gaps through verl's own registries (nothing of verl
is edited):

- :class:`PlatformCPU`, registered as ``PlatformRegistry`` platform ``"cpu"`` and made the current platform
  (``set_platform``; ``VERL_PLATFORM=cpu`` is exported for processes started later): device ``cpu``, collectives
  over gloo, no memory statistics (reported as 0);
- verl's own ``FSDPEngineWithLMHead`` registered with ``EngineRegistry`` for ``device="cpu"`` (language models,
  backends ``fsdp`` and ``fsdp2``; only FSDP2 runs: FSDP1 refuses CPU parameters with the
  ``sync_module_states=True`` verl hard-codes).

What runs on it: the FSDP2 engine on a gloo process group (any world size), fp32, eager attention,
``use_remove_padding=False``, no torch.compile. Not verl's trainer (``main_ppo``), which needs CUDA devices and a
vLLM / SGLang rollout server (docs/VERL.md).
"""

import os
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Optional

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform

PLATFORM = "cpu"
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


class PlatformCPU(PlatformBase):
    """verl platform for CPU processes: device ``cpu``, gloo collectives."""

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
        return "CUDA_VISIBLE_DEVICES"  # verl reads it; nothing is visible through it here

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def use_cpu() -> None:
    """Make verl run on the CPU in this process (idempotent); see the module docstring."""
    PlatformRegistry.register(platform=PLATFORM)(PlatformCPU)
    os.environ["VERL_PLATFORM"] = PLATFORM
    if get_platform().device_name != "cpu":
        set_platform(PlatformCPU())
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engines = EngineRegistry._engines.get("language_model", {})
    if "cpu" not in engines.get("fsdp2", {}):
        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
            FSDPEngineWithLMHead
        )
