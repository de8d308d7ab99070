"""``openrlhf-lopti demo``: a tiny model, a supervised warm-up, then GRPO / +AR / +Lopti / +AR+Lopti side by side.

Nothing is downloaded. The task is 2-person Knights and Knaves with the paper's reward
(``tasks.kk.reward``), written in a word-level vocabulary so that sequences stay short (see
:mod:`openrlhf_lopti.local.task`). Every method starts from the same warmed-up weights (:mod:`.warmup`), with
the same seed, puzzles and budget; the only differences are AR's alpha and Lopti's two phases. Each method is
one run of the local trainer (:class:`openrlhf_lopti.local.trainer.LocalTrainer`).

Writes into ``--out``: ``warmup_model/`` (a Hugging Face checkpoint: ``audit --model`` and
``train --model`` take it), ``runs/<method>/`` (each a full ``train`` run directory), ``demo.png``
(the four methods' curves), ``summary.json`` and ``summary.md`` (the comparison table).
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command
from openrlhf_lopti.local.config import METHODS, ConfigError, TrainConfig, method_list, method_settings
from openrlhf_lopti.local.evaluation import kk_eval
from openrlhf_lopti.local.model import load_model, quiet_transformers
from openrlhf_lopti.local.plots import plot_runs
from openrlhf_lopti.local.task import eval_puzzles, prompt_for
from openrlhf_lopti.local.trainer import LocalTrainer, check_loss_backend, resolve_device
from openrlhf_lopti.runs import prepare_out_dir, window_mean

from .warmup import build_warm_model, check_warmup_flags

WARMUP_DIR = "warmup_model"
# Everything the demo writes into --out: exactly what --overwrite removes (each run folder as a whole).
DEMO_OUTPUTS = (WARMUP_DIR, "warmup.json", *(f"runs/{m}" for m in METHODS), "demo.png", "summary.json",
                "summary.md", f".{WARMUP_DIR}.tmp-*", f".{WARMUP_DIR}.old-*")  # fmt: skip
DEMO_PEOPLE = [2]
# The flags that make the warm-up model and its baseline accuracy (warmup.json records them): a --resume with other
# values would train the methods from a warm-up that is not the one asked for.
WARMUP_SETTINGS = ("seed", "warmup_steps", "warmup_target", "eval_prompts")
MAX_NEW_TOKENS = 20  # the ideal 2-person response is 15 tokens with its eos


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="openrlhf-lopti demo",
        description="Warm up a tiny model on 2-person Knights and Knaves, then train it with GRPO, +AR, "
        "+Lopti and +AR+Lopti (same seed and budget) and compare. No downloads; about 4-5 minutes on 2 CPU cores.",
    )
    p.add_argument("--out", default=None, help="output directory (default: runs/demo-<timestamp>)")
    p.add_argument("--steps", type=int, default=80, help="RL steps per method (default 80)")
    p.add_argument("--warmup-steps", type=int, default=600, help="most supervised warm-up steps (default 600)")
    p.add_argument(
        "--warmup-target",
        type=float,
        default=0.3,
        help="stop the warm-up once greedy validation accuracy reaches this (default 0.3; 0: run all steps)",
    )
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--n-samples", type=int, default=8, help="responses per prompt (GRPO group size)")
    p.add_argument("--lr", type=float, default=5e-4, help="RL learning rate (AdamW)")
    p.add_argument("--eval-prompts", type=int, default=200, help="held-out puzzles for greedy accuracy (0: none)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-backend", default="auto", choices=("auto", "triton", "cpp", "torch"))
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the tiny model gains little from more, and on a machine busy with other "
        "work more threads spin-wait for each other, several times slower; 0: torch's choice)",
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue an interrupted demo in --out")
    mode.add_argument("--overwrite", action="store_true",
                      help="remove an earlier demo's files from --out first (only those, not others)")  # fmt: skip
    return p


def flag(name: str) -> str:
    """The flag of an argument: ``warmup_steps`` -> ``--warmup-steps``."""
    return "--" + name.replace("_", "-")


def method_config(out: Path, method: str, args: argparse.Namespace) -> TrainConfig:
    """The settings every method shares; only alpha and lopti differ (``openrlhf_lopti.local.config.METHODS``)."""
    return TrainConfig(
        model=str(out / WARMUP_DIR),
        out=str(out / "runs" / method),
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        n_samples=args.n_samples,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=0.7,
        people=DEMO_PEOPLE,
        lr=args.lr,
        mini_batch_size=64,
        seed=args.seed,
        device=args.device,
        loss_backend=args.loss_backend,
        eval_prompts=args.eval_prompts,
        progress=not args.no_progress,
        **method_settings(method),
    )


def summarize(method: str, rows: list, seconds: float, cpu_seconds: float) -> dict:
    """One row of the comparison table from a run's metrics; ``seconds`` wall, ``cpu_seconds`` this process's CPU
    time (all its threads): on a machine shared with other work the wall time grows with the load, the CPU time
    much less, so the ratio of two methods' CPU seconds is the methods' cost ratio."""
    last = rows[-1] if rows else {}
    return {
        "method": method,
        "reward_first": window_mean(rows, "reward", True),
        "reward_last": window_mean(rows, "reward", False),
        "accuracy_first": window_mean(rows, "accuracy", True),
        "accuracy_last": window_mean(rows, "accuracy", False),
        "eval_accuracy": last.get("eval_accuracy", float("nan")),
        "kl_last": window_mean(rows, "kl", False),
        "low_token_fraction_last": window_mean(rows, "lopti/low_token_frac", False),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }


def format_table(baseline: Optional[dict], rows: list, frac: float = 0.2) -> str:
    """Markdown table of the methods (reward / sampled accuracy over the first and last ``frac`` of steps)."""
    pct = int(frac * 100)
    head = (
        f"| method | reward, first {pct}% of steps | reward, last {pct}% | train acc. first -> last | "
        "held-out greedy acc. | KL (last) | p<0.5 tokens (last) | wall s | CPU s |"
    )
    lines = [head, "|" + "---|" * 9]
    if baseline is not None:
        wall, cpu = baseline.get("seconds", float("nan")), baseline.get("cpu_seconds", float("nan"))
        lines.append(f"| warm-up only | | | | {baseline['accuracy']:.3f} | | | {wall:.0f} | {cpu:.0f} |")
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | "
            f"{r['accuracy_first']:.3f} -> {r['accuracy_last']:.3f} | {r['eval_accuracy']:.3f} | "
            f"{r['kl_last']:.4f} | {r['low_token_fraction_last']:.3f} | {r['seconds']:.0f} | "
            f"{r.get('cpu_seconds', float('nan')):.0f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_transformers()
    methods = method_list(args.methods)
    for name in ("steps", "warmup_steps", "prompts_per_step", "n_samples"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads < 0:
        raise UserError(f"--threads must be >= 0 (0: torch's choice), got {args.threads}")
    check_warmup_flags(args.warmup_steps, args.warmup_target, args.seed)
    for method in methods:  # every run's settings, checked before the warm-up spends minutes and writes its model
        try:
            method_config(Path(args.out or "runs/demo"), method, args)
        except ConfigError as e:  # the demo's flags are the trainer's names (--lr, --eval-prompts, --seed, ...)
            raise e.as_flag_error() from None
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run_demo(args, methods)
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (a notebook, the tests) keeps its own


def _run_demo(args: argparse.Namespace, methods: list) -> int:
    """The warm-up, then each of ``methods`` trained and summarised (``main`` has checked the arguments)."""
    out = Path(args.out or time.strftime("runs/demo-%Y%m%d-%H%M%S"))
    check_loss_backend(args.loss_backend, resolve_device(args.device))
    out = prepare_out_dir(out, DEMO_OUTPUTS, overwrite=args.overwrite, resume=args.resume, can_resume=True)
    t_start = time.perf_counter()
    print(f"demo: writing to {out}")

    facts_path = out / "warmup.json"
    settings = {name: getattr(args, name) for name in WARMUP_SETTINGS}
    if args.resume and (out / WARMUP_DIR).is_dir() and facts_path.exists():
        try:
            facts = json.loads(facts_path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"--resume: {facts_path} line {e.lineno} is not valid JSON ({e.msg}): start again with "
                            "--overwrite") from None  # fmt: skip
        needed = ("parameters", "warmup_steps", "warmup_final_loss", "baseline")
        whole = isinstance(facts, dict) and all(k in facts for k in needed)
        if not whole or not isinstance(facts["baseline"], dict) or "accuracy" not in facts["baseline"]:
            raise UserError(f"--resume: {facts_path} is not the demo's warm-up record (a JSON object with "
                            f"{', '.join(needed)}): start again with --overwrite")  # fmt: skip
        if not isinstance(facts.get("settings", {}), dict):
            raise UserError(f"--resume: {facts_path}: its 'settings' is not an object: start again with --overwrite")
        if "settings" not in facts:  # written before warmup.json recorded them
            print(f"demo: {facts_path} does not say which {', '.join(flag(n) for n in WARMUP_SETTINGS)} built it: "
                  "reusing it unchecked")  # fmt: skip
        for name, value in facts.get("settings", {}).items():
            if settings.get(name) != value:  # the methods would start from a warm-up other than the one asked for
                raise UserError(f"--resume: {flag(name)} {settings.get(name)} differs from the warm-up in {out} "
                                f"({flag(name)} {value}): drop it to continue that demo, or start again with "
                                "--overwrite or in another --out")  # fmt: skip
        print(f"demo: reusing the warm-up model in {out / WARMUP_DIR}")
    else:
        facts = build_warm_model(
            out / WARMUP_DIR,
            seed=args.seed,
            max_steps=args.warmup_steps,
            target_accuracy=args.warmup_target,
            people=DEMO_PEOPLE,
            device=resolve_device(args.device),
            progress=not args.no_progress,
        )
        model, tokenizer, style = load_model(out / WARMUP_DIR, resolve_device(args.device))
        baseline = {"accuracy": float("nan"), "seconds": facts["warmup_seconds"], "cpu_seconds": facts["warmup_cpu_seconds"]}
        if args.eval_prompts:
            records = eval_puzzles(args.eval_prompts, DEMO_PEOPLE)
            prompts = [prompt_for(r, style, tokenizer) for r in records]
            baseline.update(kk_eval(model, tokenizer, records, prompts, MAX_NEW_TOKENS))
        facts["baseline"] = baseline
        facts["settings"] = settings
        facts_path.write_text(json.dumps(facts, indent=2) + "\n")
    print(
        f"demo: warm-up done ({facts['parameters']} parameters, {facts['warmup_steps']} steps, "
        f"loss {facts['warmup_final_loss']:.3f}, held-out greedy accuracy {facts['baseline']['accuracy']:.3f})"
    )

    summaries, runs = [], {}
    for method in methods:
        cfg = method_config(out, method, args)
        t0, cpu0 = time.perf_counter(), time.process_time()
        run_dir = Path(cfg.out)
        resume_run = args.resume and run_dir.is_dir()
        trainer = LocalTrainer(cfg, resume=resume_run)
        rows = trainer.run(desc=method)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
        timing_path = run_dir / "seconds.json"
        if resume_run and timing_path.exists():  # the run had finished before: keep its own time
            earlier = json.loads(timing_path.read_text())
            seconds += earlier["seconds"]
            cpu_seconds += earlier.get("cpu_seconds", 0.0)
        timing_path.write_text(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds}) + "\n")
        runs[method] = rows
        summaries.append(summarize(method, rows, seconds, cpu_seconds))
        del trainer

    plot_runs(runs, out / "demo.png", title="tiny Llama on 2-person K&K: same seed, same budget")
    table = format_table(facts["baseline"], summaries)
    total = time.perf_counter() - t_start
    summary = {"warmup": facts, "methods": summaries, "total_seconds": total, "steps": args.steps, "seed": args.seed}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(table + "\n")
    print()
    print(table)
    print(f"\ndemo: done in {total:.0f} s; plots in {out / 'demo.png'}, table in {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("openrlhf-lopti demo", main, sys.argv[1:]))
