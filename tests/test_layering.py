"""Imports point DOWN the package's layers, never up (ARCHITECTURE.md): every module of ``openrlhf_lopti`` is parsed
with ``ast`` (nothing is imported, so this runs without any extra installed).

The layers, top to bottom, as the code is (ARCHITECTURE.md's map, where the code showed the order):

- ``__main__`` and ``cli/``: the entry points;
- the front ends ``openrlhf/``, ``trl/``, ``verl/``: adapters, none imports another;
- ``vllm_cpu.py``: vLLM's CPU backend with weights that change (keep and repack after a sync), shared by the front
  ends that generate with vLLM; the one unit below the front ends that imports a framework (vllm, nothing else);
- ``audit/``: diagnostics and the multi-seed study; it drives the local trainer and warms up the demo's model,
  so it sits above both;
- ``demo/``: the demo, its warm-up and the tiny-model builders; it drives the local trainer (never the reverse);
- ``local/``: the one-process reference trainer;
- ``tasks/``: data, rewards, evaluation;
- ``runs.py`` and ``models.py``: helpers more than one front end needs (run folders and metrics files; lm_head);
- ``ops/`` (with ``_C``, its compiled C++ kernel);
- ``algo/``: the method, once;
- ``errors.py`` (and the package's ``__init__``): imports nothing of the package, every layer may import it.

Rules: a module imports its own unit (top-level package or module) and units of lower layers only; two units of
one layer never import each other; a front end imports nothing of audit/, demo/ or local/ (the local trainer is a
front end too: what front ends share lies below it); nothing below the front ends imports openrlhf, trl, verl,
ray, deepspeed or vllm, except ``vllm_cpu``, which imports vllm (and no other framework); nothing imports the
top-level ``benchmarks`` package (one named exception below). Lazy imports inside functions count, and so does
``importlib.import_module("a.constant.name")``.
"""

import ast
import re
import shutil
from pathlib import Path

PACKAGE = "openrlhf_lopti"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

LAYERS = (
    ("__main__", "cli"),
    ("openrlhf", "trl", "verl"),
    ("vllm_cpu",),
    ("audit",),
    ("demo",),
    ("local",),
    ("tasks",),
    ("runs", "models"),
    ("ops",),
    ("algo",),
    # "": the package's own __init__ (its version); install: the pip command hints; after_import: an import hook
    ("errors", "install", "after_import", ""),
)
LAYER = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}
ALIASES = {"_C": "ops"}  # the C++ extension ops/cpp_policy_loss.py loads
FRONT_ENDS = LAYER["openrlhf"]
# Below the front ends in the list (the CLI may reach them all), but no front end imports them: the local trainer is
# a front end of its own, and audit/ and demo/ are built on it. What two front ends share lives below local/.
BESIDE_FRONT_ENDS = ("audit", "demo", "local")
FRAMEWORKS = ("openrlhf", "trl", "verl", "ray", "deepspeed", "vllm")
# The one unit below the front ends that may import a framework, and the one framework it may import.
FRAMEWORK_BELOW_FRONT_ENDS = {("vllm_cpu", "vllm")}
# `openrlhf-lopti bench-step` runs benchmarks/bench_train_step.py from a source checkout (__main__ names it as a
# string and checks the file is there). The one exception; a new one fails here.
BENCHMARK_NAMES_ALLOWED = {("__main__", "benchmarks.bench_train_step")}
BENCHMARK_MODULE = re.compile(r"benchmarks(\.[A-Za-z_]\w*)+")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(name: str) -> str:
    """The unit of a dotted ``openrlhf_lopti...`` name: its top-level package or module ("" for the package)."""
    parts = name.split(".")
    unit = parts[1] if len(parts) > 1 else ""
    return ALIASES.get(unit, unit)


def submodule(base: str, name: str, root: Path) -> str:
    """``base.name`` when that is a module or package of the tree under ``root``, else ``base``."""
    candidate = root.parent.joinpath(*base.split("."), name)
    if base.split(".")[0] == root.name and (candidate.is_dir() or candidate.with_suffix(".py").is_file()):
        return f"{base}.{name}"
    return base


def imports(path: Path, root: Path) -> list:
    """``(line, dotted name)`` of every import in ``path``: relative ones resolved, ``from pkg import sub`` as
    ``pkg.sub``, ``importlib.import_module`` with a constant name included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from openrlhf_lopti import local` imports the subpackage (`from .model import x`: the module)
            found += [(node.lineno, submodule(base, alias.name, root)) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def benchmark_strings(path: Path) -> list:
    """``(line, value)`` of string constants that are a module path in ``benchmarks`` (``benchmarks.x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and BENCHMARK_MODULE.fullmatch(node.value)]  # fmt: skip


def violations(root: Path = ROOT) -> list:
    """Every import of the package under ``root`` that breaks a rule, as ``"file:line: what"``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent)
        unit = unit_of(module_name(path, root))
        if unit not in LAYER:
            found.append(f"{where}: unit {unit!r} has no layer: add it to LAYERS (and ARCHITECTURE.md)")
            continue
        for line, name in imports(path, root):
            top = name.split(".")[0]
            if top == "benchmarks":
                found.append(f"{where}:{line}: imports {name} (benchmarks/ is not part of the package)")
            elif top in FRAMEWORKS and LAYER[unit] > FRONT_ENDS and (unit, top) not in FRAMEWORK_BELOW_FRONT_ENDS:
                found.append(f"{where}:{line}: {unit} imports {name}: only a front end imports its framework")
            elif top == PACKAGE:
                target = unit_of(name)
                if target == unit:
                    continue
                if target not in LAYER:
                    found.append(f"{where}:{line}: imports {name}, whose unit {target!r} has no layer")
                elif LAYER[target] == LAYER[unit]:
                    found.append(f"{where}:{line}: {unit} imports {name}: {unit} and {target} are one layer, "
                                 "siblings never import each other")  # fmt: skip
                elif LAYER[target] < LAYER[unit]:
                    found.append(f"{where}:{line}: {unit} imports {name}: {target} is above {unit}")
                elif LAYER[unit] == FRONT_ENDS and target in BESIDE_FRONT_ENDS:
                    found.append(f"{where}:{line}: front end {unit} imports {name}: the front ends share only what "
                                 "lies below local/ (tasks, runs, models, ops, algo)")  # fmt: skip
        for line, value in benchmark_strings(path):
            if (unit, value) not in BENCHMARK_NAMES_ALLOWED:
                found.append(f"{where}:{line}: names {value!r} (benchmarks/ is not part of the package)")
    return list(dict.fromkeys(found))  # one line per import, however many names it takes


def test_every_import_points_down_the_layers():
    assert violations() == []


def write(root: Path, relative: str, text: str) -> None:
    path = root / PACKAGE / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_planted_wrong_imports_fail(tmp_path):
    """The checker finds each kind of wrong import planted into a copy of the package."""
    copy = tmp_path / PACKAGE
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert violations(copy) == []
    planted = {
        "local/planted_up.py": "from openrlhf_lopti.demo.tiny_model import build_tiny_llama\n",
        "algo/planted_relative.py": "def f():\n    from ..local import trainer\n",
        "trl/planted_sibling.py": "from openrlhf_lopti.openrlhf import flags\n",
        "openrlhf/planted_local.py": "from openrlhf_lopti.local.model import save_model\n",
        "runs_planted.py": "import openrlhf_lopti.runs\n",
        "ops/planted_framework.py": "def f():\n    import deepspeed\n",
        "tasks/planted_benchmarks.py": "import importlib\nimportlib.import_module('benchmarks.bench_memory')\n",
        "demo/planted_from_root.py": "from openrlhf_lopti import audit\n",
        "tasks/planted_vllm.py": "def f():\n    from vllm.model_executor.layers import utils\n",
        "local/planted_vllm_cpu.py": "from openrlhf_lopti.vllm_cpu import repack_linear_layers\n",
        "trl/planted_vllm_cpu.py": "from ..vllm_cpu import keep_weights_when_packing\n",  # allowed: a front end
    }
    for relative, text in planted.items():
        write(tmp_path, relative, text)
    vllm_cpu = copy / "vllm_cpu.py"  # vllm_cpu may import vllm, and nothing else of the frameworks
    vllm_cpu.write_text(vllm_cpu.read_text() + "\nimport vllm\nimport ray\n")
    vllm_lines = len(vllm_cpu.read_text().splitlines())
    found = "\n".join(violations(copy))
    assert "local/planted_up.py:1: local imports openrlhf_lopti.demo.tiny_model: demo is above local" in found
    assert "algo/planted_relative.py:2: algo imports openrlhf_lopti.local.trainer: local is above algo" in found
    assert "trl/planted_sibling.py:1: trl imports openrlhf_lopti.openrlhf.flags: trl and openrlhf are one" in found
    assert "openrlhf/planted_local.py:1: front end openrlhf imports openrlhf_lopti.local.model" in found
    assert "runs_planted.py: unit 'runs_planted' has no layer" in found
    assert "ops/planted_framework.py:2: ops imports deepspeed" in found
    assert "tasks/planted_benchmarks.py:2: imports benchmarks.bench_memory" in found
    assert "tasks/planted_benchmarks.py:2: names 'benchmarks.bench_memory'" in found
    assert "demo/planted_from_root.py:1: demo imports openrlhf_lopti.audit: audit is above demo" in found
    assert "tasks/planted_vllm.py:2: tasks imports vllm.model_executor.layers: only a front end imports" in found
    assert "local/planted_vllm_cpu.py:1: local imports openrlhf_lopti.vllm_cpu: vllm_cpu is above local" in found
    assert "trl/planted_vllm_cpu.py" not in found
    assert f"vllm_cpu.py:{vllm_lines}: vllm_cpu imports ray: only a front end imports its framework" in found
    assert f"vllm_cpu.py:{vllm_lines - 1}:" not in found
