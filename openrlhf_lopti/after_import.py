"""Run code right after a module is imported, without importing it: for a registration or patch on a framework's
module that a process may import later or never (verl's plugin, vLLM's CPU layers). Nothing of the package or of a
framework is imported here; every layer may use it."""

import importlib.abc
import importlib.util
import sys
from typing import Callable, Dict, List

# module name -> what runs once it has: each callback once, in the order given
_PENDING: Dict[str, List[Callable]] = {}


def call_after_import(name: str, callback: Callable) -> None:
    """``callback(module)`` once module ``name`` has run: at once if it has, else right after its import executes it
    (before the importer gets it). An exception of ``callback`` is the importer's: catch what must not fail it."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _PENDING.setdefault(name, []).append(callback)
    if not any(isinstance(finder, _CallAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CallAfterImport())


class _CallAfterImport(importlib.abc.MetaPathFinder):
    """Finds a pending module through the other finders and makes its loader run the callbacks after the module."""

    def find_spec(self, name, path=None, target=None):
        callbacks = _PENDING.pop(name, None)
        if callbacks is None:
            return None
        spec = importlib.util.find_spec(name)  # the other finders: this one has nothing pending for it now
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module  # the spec's own loader (a new one per spec), patched for this import only

        def run_then_call(module) -> None:
            run(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = run_then_call
        if not _PENDING:  # leaves once nothing waits (a spec is returned: the finders after it are not searched)
            sys.meta_path.remove(self)
        return spec
