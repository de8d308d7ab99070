"""openrlhf_lopti/after_import.py: code run right after a module's import, without importing it (verl's plugin and
vLLM's CPU packing patch use it on modules a process may import later or never)."""

import sys

from openrlhf_lopti.after_import import _CallAfterImport, call_after_import


def test_callbacks_run_once_right_after_the_module_runs_and_the_finder_leaves(tmp_path, monkeypatch):
    (tmp_path / "later_pkg").mkdir()
    (tmp_path / "later_pkg" / "__init__.py").write_text("")
    (tmp_path / "later_pkg" / "mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    call_after_import("later_pkg.mod", lambda module: seen.append(("first", module.VALUE)))
    call_after_import("later_pkg.mod", lambda module: setattr(module, "VALUE", module.VALUE + 1))
    assert seen == [] and "later_pkg.mod" not in sys.modules  # nothing imported by asking
    import later_pkg  # noqa: F401  (another module of the package: no callback)

    assert seen == []
    from later_pkg import mod

    assert seen == [("first", 41)] and mod.VALUE == 42  # in order, before the importer got the module
    assert not any(isinstance(finder, _CallAfterImport) for finder in sys.meta_path)
    import importlib

    importlib.reload(mod)  # a second execution is not an import the callbacks were waiting for
    assert seen == [("first", 41)] and mod.VALUE == 41
    call_after_import("later_pkg.mod", lambda module: seen.append(("now", module.VALUE)))  # already imported: at once
    assert seen[-1] == ("now", 41)
    for name in ("later_pkg.mod", "later_pkg"):
        monkeypatch.delitem(sys.modules, name)
