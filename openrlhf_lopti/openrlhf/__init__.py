"""Glue to OpenRLHF 0.11.2: ``LoptiActorPPOTrainer``, ``LoptiPolicyModelActor``, our CLI flags, the ``--cpu`` runtime.

``flags`` imports nothing from openrlhf; ``trainer`` and ``actor`` import OpenRLHF's Ray trainer, which needs
vLLM (the CPU install has vLLM's CPU build) and flash-attn (on CPU, ``cpu.stubs.install_cpu_stubs()`` first). ``cpu/`` holds everything that
differs when the pipeline runs without a GPU (``--cpu``). They are loaded on first access
so that importing this package (e.g. for the CLI's ``--help``) stays light.
"""

import importlib

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
