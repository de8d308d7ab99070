"""AR and Lopti for verl 0.9 (extra ``[verl]``, its own environment: docs/VERL.md).

Installed, this package is a verl plugin: verl loads its ``verl.plugins`` entry point (:mod:`.plugin`) in every
process that imports verl, which

- registers the policy loss ``ar`` (:mod:`.loss`): ``actor_rollout_ref.actor.policy_loss.loss_mode=ar``;
- makes :class:`LoptiTrainingWorker` (:mod:`.worker`) the actor's training worker
  (``ActorRolloutRefWorker.actor_worker_cls``); with Lopti off and no AR it is verl's ``TrainingWorker`` unchanged.

Importing this package registers neither (only the plugin does): it checks that verl is there and, with
``VERL_PLATFORM=cpu``, runs verl on the CPU in this process (:mod:`.cpu`). The keys (``ar_alpha``, ``lopti_eta``,
``lopti_order``, ``lopti_quantile``) live in ``actor_rollout_ref.actor.policy_loss`` with
``_target_=openrlhf_lopti.verl.LoptiPolicyLossConfig`` (:mod:`.config`).
"""

import importlib

from openrlhf_lopti.install import checkout, pip_install

# verl 0.9.1 gets its own environment (a checkout's Makefile makes it): TRL 1.x cannot share one with it, and the
# tested one runs vLLM's CPU build on transformers 5.19, past verl's declared <5.11 (docs/VERL.md)
MISSING_VERL = "openrlhf_lopti.verl needs verl 0.9.1, in its own environment (verl and TRL cannot share one): " + (
    f'make -C "{checkout()}" venv-verl, then use {checkout()}/.venv-verl/bin/python' if checkout()
    else f"in a venv with torch, {pip_install('verl')}") + " (see docs/VERL.md)"

try:
    import verl  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name != "verl":  # verl is there but one of its own imports is not: that error says which
        raise
    raise ImportError(MISSING_VERL) from None

# registers verl's "cpu" platform (never auto-detected); with VERL_PLATFORM=cpu, verl on the CPU in this process
# (cpu.py), before anything of verl reads its platform or looks vLLM up
from . import cpu  # noqa: E402

if cpu.selected():
    cpu.use_cpu()

# the public names, imported on first use: importing the package must not register anything (the plugin does)
_PUBLIC = {"ConfigError": "config", "LoptiPolicyLossConfig": "config", "LoptiTrainingWorker": "worker",
           "compute_policy_loss_ar": "loss"}  # fmt: skip
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
