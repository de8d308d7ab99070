"""AR and Lopti for verl 0.9 (extra ``[verl]``, its own environment: docs/VERL.md).

Importing this package (``VERL_USE_EXTERNAL_MODULES=openrlhf_lopti.verl`` makes verl import it in every process)
does, through verl's own extension points and without editing verl:

- registers the policy loss ``ar`` (:mod:`.loss`): ``actor_rollout_ref.actor.policy_loss.loss_mode=ar``;
- makes :class:`LoptiTrainingWorker` (:mod:`.worker`) the actor's training worker
  (``ActorRolloutRefWorker.actor_worker_cls``); with Lopti off and no AR it is verl's ``TrainingWorker`` unchanged;
- registers verl's ``cpu`` platform, and with ``VERL_PLATFORM=cpu`` runs verl on the CPU (:mod:`.cpu`).

The keys (``ar_alpha``, ``lopti_eta``, ``lopti_order``, ``lopti_quantile``) live in
``actor_rollout_ref.actor.policy_loss`` with ``_target_=openrlhf_lopti.verl.LoptiPolicyLossConfig`` (:mod:`.config`).
"""

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

# first: registers verl's "cpu" platform; with VERL_PLATFORM=cpu, verl on the CPU in this process (cpu.py), before
# anything of verl reads its platform or looks vLLM up (the import below does)
from . import cpu  # noqa: E402

if cpu.selected():
    cpu.use_cpu()

from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402

from .config import ConfigError, LoptiPolicyLossConfig
from .loss import compute_policy_loss_ar
from .worker import LoptiTrainingWorker

ActorRolloutRefWorker.actor_worker_cls = LoptiTrainingWorker

__all__ = ["ConfigError", "LoptiPolicyLossConfig", "LoptiTrainingWorker", "compute_policy_loss_ar"]
