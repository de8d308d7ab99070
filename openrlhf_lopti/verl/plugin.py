"""verl's plugin entry point for AR and Lopti: group ``verl.plugins``, name ``openrlhf_lopti`` (setup.py).

verl 0.9.1 loads every installed ``verl.plugins`` entry point at the end of ``import verl``, in every process that
imports verl (``verl/__init__.py``; ``VERL_USE_EXTERNAL_PLUGINS``: ``auto``, the default, ``none``, or names): the
driver and every Ray worker, on every node. So installing this package is enough for ``loss_mode=ar`` and our keys.
Code shipped with a Ray job's ``py_modules`` has no entry points:
``VERL_USE_EXTERNAL_MODULES=openrlhf_lopti.verl.plugin`` loads the same module.

It loads into every verl process of the environment, runs that never use AR or Lopti included, so it imports
nothing of verl itself: each registration waits until verl imports the module it extends, and runs right after that
module has run (or at once, when it already has):

- ``verl.trainer.ppo.core_algos``: the policy loss ``ar`` (:mod:`.loss`, in verl's ``POLICY_LOSS_REGISTRY``);
- ``verl.workers.engine_workers`` (which imports vLLM): ``ActorRolloutRefWorker.actor_worker_cls`` =
  :class:`~.worker.LoptiTrainingWorker`, which without our keys is verl's ``TrainingWorker``; only when it is still
  verl's ``TrainingWorker`` (a worker another plugin or recipe chose stays, and Lopti is then refused).

The CPU seam (:mod:`.cpu`) runs only with ``VERL_PLATFORM=cpu`` (the package's ``__init__``). A registration that
fails leaves verl as it was and is logged as a warning (verl logs a plugin that fails to load at debug level only);
``loss_mode=ar`` then raises the reason in one line instead of verl's "Unsupported loss mode", and so does building
:class:`~.config.LoptiPolicyLossConfig` with AR or Lopti on (``config.check_plugin``).
"""

import logging
from typing import Dict, Tuple

from openrlhf_lopti.after_import import call_after_import

LOGGER = logging.getLogger(__name__)
# The plugin's parts: AR is a loss and runs in any worker; Lopti needs our training worker.
AR_LOSS = "the 'ar' policy loss"
LOPTI_WORKER = "the Lopti worker"
# what failed to register in this process, and why (one line each), by part
FAILED: Dict[str, str] = {}


def unavailable(what: str, needs: Tuple[str, ...]) -> str:
    """One line: why ``what`` (e.g. ``loss_mode=ar``), which needs the parts ``needs`` (:data:`AR_LOSS`,
    :data:`LOPTI_WORKER`), cannot run in this process, or "" when it can."""
    failed = {part: FAILED[part] for part in needs if part in FAILED}
    if not failed:
        return ""
    reasons = "; ".join(f"{part}: {reason}" for part, reason in failed.items())
    return f"{what} needs openrlhf_lopti's verl plugin (openrlhf_lopti.verl.plugin), which failed here: {reasons}"


def _failed(part: str, exc: BaseException) -> None:
    FAILED[part] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    LOGGER.warning("openrlhf_lopti's verl plugin: %s not registered (%s); verl runs without it", part, FAILED[part])


def _ar_unavailable(*args, **kwargs):
    """Stands in for the ``ar`` loss when it failed to register: its reason, in one line."""
    raise ImportError(unavailable("actor_rollout_ref.actor.policy_loss.loss_mode=ar", (AR_LOSS,)))


def _register_ar_loss(core_algos) -> None:
    try:
        from . import loss  # noqa: F401  (registers "ar" in core_algos.POLICY_LOSS_REGISTRY)
    except Exception as exc:  # noqa: BLE001  (a failing plugin must not break verl for runs without AR)
        _failed(AR_LOSS, exc)
        core_algos.register_policy_loss("ar")(_ar_unavailable)


def _set_lopti_worker(engine_workers) -> None:
    try:
        from .worker import LoptiTrainingWorker
    except Exception as exc:  # noqa: BLE001
        _failed(LOPTI_WORKER, exc)
        return
    chosen = engine_workers.ActorRolloutRefWorker.actor_worker_cls
    if chosen is not engine_workers.TrainingWorker:  # another plugin or recipe chose it: runs without our keys are its
        FAILED[LOPTI_WORKER] = (
            f"ActorRolloutRefWorker.actor_worker_cls is {chosen.__module__}.{chosen.__qualname__} already (set by "
            "another plugin or recipe), which ours would replace"
        )
        LOGGER.warning("openrlhf_lopti's verl plugin: %s not registered (%s)", LOPTI_WORKER, FAILED[LOPTI_WORKER])
        return
    engine_workers.ActorRolloutRefWorker.actor_worker_cls = LoptiTrainingWorker


call_after_import("verl.trainer.ppo.core_algos", _register_ar_loss)
call_after_import("verl.workers.engine_workers", _set_lopti_worker)
