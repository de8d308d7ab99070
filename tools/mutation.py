"""``make mutation``: mutation testing of the core with mutmut, one module at a time, against its own tests only.

It first copies the working tree (tracked and untracked files that git does not ignore, plus the built C++
extension) to ``build/mutation/tree/``, so every module is tested against the same code and tests even while
the checkout changes. For each module in :data:`MODULES` it then copies that tree to ``build/mutation/<name>/``, writes a ``setup.cfg`` whose
``[mutmut]`` section mutates that one module and selects that module's own test files, and runs
``mutmut run`` there. mutmut copies the copy once more into ``mutants/`` and only ever edits that, so the
checkout is never touched while the run lasts (other work can go on in it).

mutmut runs each mutant with the tests that executed the mutated function (found in one instrumented run of
the selected files), stopping at the first failure, in processes forked from a server that has already
imported torch (``process_isolation = forkserver``: forking the pytest process itself is not safe with torch's
thread pools). What mutmut does not mutate: code at module level (constants such as the clamp bounds) and
decorated functions other than static/class methods. Functions decorated only with ``@contextmanager`` or
``@torch.no_grad()`` are rewritten in the copy so that they are mutated (:func:`undecorate`); that leaves the
``@triton.jit`` kernels, and TESTING.md says how those are covered.

Writes ``build/mutation/report.md`` (the score of each module and every mutant that was not killed, with its
diff) and ``build/mutation/report.json``. Not part of ``make test`` or CI: the whole run takes tens of
minutes on 2 cores.

Usage: ``python tools/mutation.py [--only NAME[,NAME...]] [--jobs N] [--tree DIR] [--out DIR]`` (names from
:data:`MODULES`; ``--tree`` tests another copy of the project instead of this checkout, e.g. an older one).
"""

import argparse
import ast
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "build" / "mutation"

# name -> (the module mutated, its own test files). A module is judged by these files only: a mutant that
# only another module's tests would notice counts as a survivor here.
MODULES = {
    "algo.advantage": ("openrlhf_lopti/algo/advantage.py", ["tests/test_algo_advantage.py"]),
    "algo.direction": ("openrlhf_lopti/algo/direction.py", ["tests/test_algo_direction.py"]),
    "algo.lopti": ("openrlhf_lopti/algo/lopti.py", ["tests/test_algo_lopti.py"]),
    "algo.policy_loss": ("openrlhf_lopti/algo/policy_loss.py", ["tests/test_algo_policy_loss.py"]),
    "ops.fused_policy_loss": (
        "openrlhf_lopti/ops/fused_policy_loss.py",
        ["tests/test_ops_fused_policy_loss.py", "tests/test_ops_torch_backend.py"],
    ),
    "ops.cpp_policy_loss": ("openrlhf_lopti/ops/cpp_policy_loss.py", ["tests/test_ops_cpp.py"]),
    "ops.triton": ("openrlhf_lopti/ops/triton/*", ["tests/test_ops_triton.py"]),
    "ops.fused_linear_policy_loss": (
        "openrlhf_lopti/ops/fused_linear_policy_loss.py",
        ["tests/test_ops_fused_linear_policy_loss.py"],
    ),
    "local.update": ("openrlhf_lopti/local/update.py", ["tests/test_local_update.py", "tests/test_local_fused_lm_head.py"]),
    "tasks.kk": ("openrlhf_lopti/tasks/kk.py", ["tests/test_tasks_kk.py"]),
    "tasks.math": ("openrlhf_lopti/tasks/math.py", ["tests/test_tasks_math.py"]),
    "openrlhf.trainer": ("openrlhf_lopti/openrlhf/trainer.py", ["tests/test_openrlhf_trainer.py"]),
}

KILLED = {"killed", "timeout", "segfault", "caught by type check"}  # the tests (or the clock) noticed

# Imported once in mutmut's fork server (added to the copy's tests/conftest.py): the tests of these modules import
# openrlhf / DeepSpeed lazily, and 20-40 CPU seconds of imports in every mutant's process would both slow the run
# and trip mutmut's CPU-time limit, so that a mutant would count as killed by a "timeout" its tests never reached.
PRELOAD = """
# Added by tools/mutation.py in its copy of the tree only: heavy imports done once, in mutmut's fork server.
from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs as _install_cpu_stubs

_install_cpu_stubs()
import deepspeed  # noqa: E402,F401
import openrlhf.models  # noqa: E402,F401
import openrlhf.trainer.ray.ppo_actor  # noqa: E402,F401
"""
PRELOADED = {"algo.policy_loss", "openrlhf.trainer"}


def snapshot(tree: Path, out: Path) -> Path:
    """Copy the files a test run in ``tree`` sees (tracked and untracked-but-not-ignored files, and the built
    extension) to ``out/tree``; ``tree`` need not be a git checkout (then every file is copied)."""
    if (tree / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=tree, check=True, capture_output=True,
        ).stdout.decode().split("\0")  # fmt: skip
        files = [Path(p) for p in listed if p and (tree / p).is_file()]
        files += [p.relative_to(tree) for p in (tree / "openrlhf_lopti").glob("_C*.so")]  # built in place, ignored
    else:
        files = [p.relative_to(tree) for p in tree.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    copy = out / "tree"
    if copy.exists():
        shutil.rmtree(copy)
    for path in files:
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / path, copy / path)
    return copy


# Decorators that only wrap the function they decorate. mutmut never mutates a decorated function, so in the copy
# ``@contextmanager def f`` becomes ``def f`` followed by ``f = contextmanager(f)`` (what the decorator does): the
# bodies of the trainer's context managers and of its ``@torch.no_grad()`` pass are then mutated like any other.
UNDECORATED = ("contextmanager", "torch.no_grad()")


def undecorate(source: str) -> str:
    """``source`` with every function whose only decorator is in :data:`UNDECORATED` rewritten as a plain ``def``
    and an assignment applying the decorator right after the function's body."""
    lines = source.splitlines(keepends=True)
    rewrites = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and len(node.decorator_list) == 1:
            decorator = ast.get_source_segment(source, node.decorator_list[0])
            if decorator in UNDECORATED:
                rewrites.append((node.decorator_list[0].lineno, node.end_lineno, node.col_offset, node.name, decorator))
    for decorator_line, end_line, column, name, decorator in sorted(rewrites, reverse=True):
        lines.insert(end_line, f"{' ' * column}{name} = {decorator}({name})\n")
        del lines[decorator_line - 1]
    return "".join(lines)


def prepare(name: str, tree: Path, out: Path) -> Path:
    """A fresh copy of the snapshot for one module (its decorated functions rewritten by :func:`undecorate`), with
    its mutmut configuration."""
    module, tests = MODULES[name]
    work = out / name
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(tree, work)
    for path in work.glob(module):
        path.write_text(undecorate(path.read_text()))
    if name in PRELOADED:
        with open(work / "tests" / "conftest.py", "a") as conftest:
            conftest.write(PRELOAD)
    also_copy = [p for p in ("csrc", "benchmarks", "examples", "pytest.ini", "setup.py") if (work / p).exists()]
    lines = [
        "[mutmut]",
        "source_paths = openrlhf_lopti",
        f"only_mutate = {module}",
        "pytest_add_cli_args_test_selection =",
        *[f"    {t}" for t in tests],
        "also_copy =",
        *[f"    {p}" for p in also_copy],
        "process_isolation = forkserver",
        # mutmut's CPU-time limit per mutant: (the tests' measured time + 5 s) x 15 x 2; the default 1 s is too
        # tight for tests that build a DeepSpeed engine in each forked process
        "timeout_constant = 5",
        "use_git_change_detection = false",
    ]
    (work / "setup.cfg").write_text("\n".join(lines) + "\n")
    return work


def mutmut(work: Path, *args: str, log=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mutmut", *args], cwd=work, text=True,
        stdout=log if log is not None else subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def results(work: Path) -> dict:
    """mutant name -> status, from the ``.meta`` files mutmut writes next to each mutated module."""
    from mutmut.stats import status_by_exit_code

    statuses = {}
    for meta in (work / "mutants").rglob("*.py.meta"):
        data = json.loads(meta.read_text())
        for key, code in data.get("exit_code_by_key", {}).items():
            statuses[key] = status_by_exit_code[code]
    return statuses


def run_module(name: str, tree: Path, out: Path, jobs: int) -> dict:
    work = prepare(name, tree, out)
    start = time.time()
    with open(work / "mutmut.log", "w") as log:
        done = mutmut(work, "run", "--max-children", str(jobs), log=log)
    seconds = time.time() - start
    statuses = results(work)
    counts = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    killed = sum(n for s, n in counts.items() if s in KILLED)
    total = sum(n for s, n in counts.items() if s != "skipped")
    left = {}
    for key, status in sorted(statuses.items()):
        if status not in KILLED and status != "skipped":
            diff = mutmut(work, "show", key).stdout
            left[key] = {"status": status, "diff": diff.split("\n", 1)[1] if "\n" in diff else diff}
    return {
        "module": MODULES[name][0],
        "tests": MODULES[name][1],
        "exit_code": done.returncode,
        "seconds": round(seconds),
        "counts": counts,
        "killed": killed,
        "total": total,
        "score": round(100.0 * killed / total, 1) if total else None,
        "not_killed": left,
    }


def write_report(report: dict, out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Mutation testing report (`make mutation`)", "", "| module | own tests | killed / mutants | score | time |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, r in report.items():
        tests = ", ".join(Path(t).name for t in r["tests"])
        error = "" if r["exit_code"] == 0 else f" (mutmut exit {r['exit_code']}, see {name}/mutmut.log)"
        lines.append(f"| {name} | {tests} | {r['killed']} / {r['total']} | {r['score']}% | {r['seconds']} s{error} |")
    for name, r in report.items():
        if not r["not_killed"]:
            continue
        lines += ["", f"## {name}: not killed", ""]
        for key, item in r["not_killed"].items():
            lines += [f"### {key} ({item['status']})", "", "```diff", item["diff"].rstrip(), "```", ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")


MARKER = ".mutation-out"  # written into --out: the folder is this tool's, whose tree/ and <module>/ it replaces
OWN_NAMES = {MARKER, "tree", "report.json", "report.md", *MODULES}


def out_problem(out: Path, tree: Path) -> str:
    """Why ``--out`` may not be used ('' when it may): each run removes ``out/tree`` and ``out/<module>`` whole, so
    ``out`` must be new, empty, this tool's (its marker file), or hold only the names the tool writes, and must not
    hold the ``--tree`` it copies."""
    if out.exists() and not out.is_dir():
        return "is a file; --out takes a folder"
    if tree == out or out in tree.parents:
        return f"holds --tree {tree}, which a run would remove; choose an --out outside it"
    if not out.is_dir() or (out / MARKER).exists():
        return ""
    names = {p.name for p in out.iterdir()}
    if names and not (names <= OWN_NAMES and "report.json" in names):
        shown = ", ".join(sorted(names - OWN_NAMES)[:4] or sorted(names)[:4])
        return (f"holds files this tool did not write ({shown}); a run replaces its tree/ and <module>/ folders: "
                "choose a new or empty folder")
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mutation.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated module names, from: {', '.join(MODULES)}")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--tree", type=Path, default=REPO, help="the project copy to test (default: this checkout)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where work dirs and the report go (default {OUT})")
    args = parser.parse_args(argv)
    names = list(MODULES) if not args.only else args.only.split(",")
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        parser.error(f"--only: unknown module(s) {unknown}; known: {', '.join(MODULES)}")
    out = args.out.resolve()
    problem = out_problem(out, args.tree.resolve())
    if problem:
        parser.exit(2, f"{parser.prog}: error: --out {args.out}: {problem}\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("tools/mutation.py work folder: it replaces tree/ and <module>/ here on each run\n")
    previous = out / "report.json"
    report = json.loads(previous.read_text()) if previous.exists() and args.only else {}
    tree = snapshot(args.tree.resolve(), out)
    for name in names:
        print(f"[mutation] {name}: {MODULES[name][0]} against {', '.join(MODULES[name][1])}", flush=True)
        report[name] = run_module(name, tree, out, args.jobs)
        r = report[name]
        print(f"[mutation] {name}: {r['killed']} / {r['total']} killed ({r['score']}%) in {r['seconds']} s", flush=True)
        write_report({n: report[n] for n in MODULES if n in report}, out)
    print(f"[mutation] report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
