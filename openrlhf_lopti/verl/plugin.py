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
  :class:`~.worker.LoptiTrainingWorker`, which without our keys is verl's ``TrainingWorker``.

The CPU seam (:mod:`.cpu`) runs only with ``VERL_PLATFORM=cpu`` (the package's ``__init__``). A registration that
fails leaves verl as it was and is logged as a warning (verl logs a plugin that fails to load at debug level only);
``loss_mode=ar`` then raises the reason in one line instead of verl's "Unsupported loss mode", and so does building
:class:`~.config.LoptiPolicyLossConfig` with AR or Lopti on (``config.check_plugin``).
"""

import importlib.abc
import logging
import sys
from typing import Callable, Dict

LOGGER = logging.getLogger(__name__)
# what failed to register in this process, and why (one line each)
FAILED: Dict[str, str] = {}


def unavailable(what: str) -> str:
    """One line: why ``what`` (e.g. ``loss_mode=ar``) cannot run in this process, or "" when it can."""
    if not FAILED:
        return ""
    reasons = "; ".join(f"{part}: {reason}" for part, reason in FAILED.items())
    return f"{what} needs openrlhf_lopti's verl plugin (openrlhf_lopti.verl.plugin), which failed here: {reasons}"


def _failed(part: str, exc: BaseException) -> None:
    FAILED[part] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    LOGGER.warning("openrlhf_lopti's verl plugin: %s not registered (%s); verl runs without it", part, FAILED[part])


def _ar_unavailable(*args, **kwargs):
    """Stands in for the ``ar`` loss when it failed to register: its reason, in one line."""
    raise ImportError(unavailable("actor_rollout_ref.actor.policy_loss.loss_mode=ar"))


def _register_ar_loss(core_algos) -> None:
    try:
        from . import loss  # noqa: F401  (registers "ar" in core_algos.POLICY_LOSS_REGISTRY)
    except Exception as exc:  # noqa: BLE001  (a failing plugin must not break verl for runs without AR)
        _failed("the 'ar' policy loss", exc)
        core_algos.register_policy_loss("ar")(_ar_unavailable)


def _set_lopti_worker(engine_workers) -> None:
    try:
        from .worker import LoptiTrainingWorker
    except Exception as exc:  # noqa: BLE001
        _failed("the Lopti worker", exc)
        return
    engine_workers.ActorRolloutRefWorker.actor_worker_cls = LoptiTrainingWorker


class _RunAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds module ``name`` with the other finders and, once it has run, calls ``callback(module)`` (once)."""

    def __init__(self, name: str, callback: Callable):
        self.name, self.callback, self.loader = name, callback, None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.loader is not None:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        loader = self.loader
        module.__loader__ = module.__spec__.loader = loader  # the module keeps no trace of this finder
        sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not self]
        loader.exec_module(module)
        self.callback(module)


def _after_import(name: str, callback: Callable) -> None:
    module = sys.modules.get(name)
    if module is not None:  # already imported: by VERL_USE_EXTERNAL_MODULES, or the CPU seam (VERL_PLATFORM=cpu)
        callback(module)
    else:
        sys.meta_path.insert(0, _RunAfterImport(name, callback))


_after_import("verl.trainer.ppo.core_algos", _register_ar_loss)
_after_import("verl.workers.engine_workers", _set_lopti_worker)
