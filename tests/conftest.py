"""Run Triton kernels in interpreter mode on machines without a GPU (CI): every kernel is checked there."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit definition is executed, i.e. before our triton modules import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray's metrics exporter outlives ray.shutdown(): a process that started Ray keeps a thread per session that tries to
# reach the (gone) metrics agent every 10 s (its driver log: "Failed to export metrics to the metrics agent"). The
# pytest process starts and stops Ray several times (the pipeline tests' drivers, the vLLM engine fixture), and the one
# unexplained crash of the suite (a segmentation fault, no Python traceback, at a Triton-interpreter test after
# them) came while 7 such threads were firing. Tests do not read Ray's metrics; with collection off no thread
# is left (checked: 2 sessions, then 25 s, 2 failed exports by default, 0 with it off). A user's value is kept.
os.environ.setdefault("RAY_enable_metrics_collection", "0")


# ---- the `rounding` marker: the tests the alternate-dispatch pass of `make test` reruns (Makefile, TESTING.md) ----
# A test depends on the machine's rounding when it compares floats against a tolerance or compares two computation
# paths: it calls one of these, itself or through any function of its own module (found by reading the code
# objects, so a new comparison helper in a test module is followed without a list to keep). Everything else in the
# numerics files (error messages, shapes, masks, exact integer results) would only run twice for nothing.
import inspect  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402

ROUNDING_NAMES = frozenset({
    # tests/numerics.py and tests/kernel_cases.py: the derived bounds
    "assert_same_computation", "assert_all_same_computation", "scalars_same_computation", "assert_near_float64",
    "fp32_error_bound", "in_float64", "Float64Shadow", "assert_near_truth", "check_backend_matches_reference",
    "reference_truth", "reference_in_float64",
    # tolerance comparisons and exact float equality between two paths
    "allclose", "assert_close", "isclose", "approx", "assert_allclose", "equal",
})  # fmt: skip


def _names(code: types.CodeType) -> set:
    """Every global / attribute name ``code`` and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _uses_rounding(function, module, seen: set) -> bool:
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = _names(code)
    if names & ROUNDING_NAMES:
        return True
    for name in names:  # the module's own helpers (and the shared test helpers it imported), followed
        helper = getattr(module, name, None)
        helper_module = inspect.getmodule(helper) if inspect.isfunction(helper) else None
        if helper_module is not None and helper_module.__name__.startswith("tests."):
            if _uses_rounding(helper, helper_module, seen):
                return True
    return False


def pytest_configure(config):
    config.addinivalue_line("markers", "rounding: compares floats with a tolerance or two paths (auto-applied)")


# ---- how `make test`'s two workers share the files (pytest-xdist, `--dist loadfile --no-loadscope-reorder`) ----
# Each file is one unit of work (its module fixtures start once). The files that start Ray clusters and vLLM engines
# are one unit, run one after the other: two of them at once beside verl's main_ppo (the other track) left a Ray
# head node unstarted after 300 s at load 25. The units go out longest first, so that the workers end together
# (times measured on the 2-core VM: TESTING.md, "The suite's time budget"); a file missing from these lists runs
# after them, in its usual order, so a stale list costs time, never a test.
RAY_FILES = ("test_openrlhf_cpu_pipeline.py", "test_openrlhf_multinode.py", "test_openrlhf_cpu_vllm.py",
             "test_openrlhf_cpu_settings.py")  # fmt: skip
SLOW_FILES = ("test_openrlhf_deepspeed.py", "test_trl_cpu_colocate.py", "test_trl_example.py", "test_trl_processes.py",
              "test_audit_study.py", "test_trl_options.py", "test_cli_quiet_start.py", "test_ops_cpp.py")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and _uses_rounding(function, item.module, set()):
            item.add_marker("rounding")
    rank = {name: 0 for name in RAY_FILES} | {name: 1 + i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent where xdist is not installed (.venv-verl)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``: xdist's file-by-file scheduler with :data:`RAY_FILES` as one unit. (Its
    ``loadgroup`` cannot group them: it renames the tests' node ids, which pytest 9.2 no longer lets it do.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "ray" if path.rsplit("/", 1)[-1] in RAY_FILES else path

    return RayFilesTogether(config, log)
