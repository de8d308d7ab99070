"""``openrlhf-lopti study``: S seeds x methods of the local trainer on one setting, with 95% confidence intervals.

Seed k fixes the tiny model's initialisation, its supervised warm-up data, and the RL run's puzzles and
sampling; every method of seed k starts from the same warmed-up model, so a method's difference to GRPO
can be taken seed by seed (paired). Each (method, seed) is one ``openrlhf-lopti train`` process with
``--track-direction``; ``--jobs`` of them run at once, one CPU thread each.

``--optimizer`` picks the runs' optimizer and ``--train-args "..."`` passes any other ``train`` flag to every
run (last, so it overrides the study's value of a flag both set: ``--train-args "--lr 5e-5"``); both are part
of the setting.

``--out`` holds the study's own files, nothing else is touched:

- ``study_settings.json``: the setting; a study in the same folder resumes only with the same setting;
- ``warmup/seed<k>/``: the warmed-up model of seed k (``warmup.json`` beside it when complete);
- ``runs/<method>/seed<k>/``: the ``train`` run directories (``study_run.json`` when finished);
- ``logs/``: each process's output;
- ``study.json``, ``study.md``, ``study.png``: the results.

Stopping the study (Ctrl-C, or killing it) stops its processes; running it again skips finished runs and
continues a killed one from its last checkpoint (``train --resume``).
"""

import argparse
import json
import math
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command
from openrlhf_lopti.local.config import METHODS, OPTIMIZERS, method_list
from openrlhf_lopti.local.task import people_sizes
from openrlhf_lopti.runs import check_can_write, read_metrics, window_mean

from .report import write_json
from .stats import format_ci, mean_ci, paired_differences

SETTINGS_FILE = "study_settings.json"
WARMUP_DIR = "warmup"
RUNS_DIR = "runs"
LOGS_DIR = "logs"
RESULT_FILES = ("study.json", "study.md", "study.png")
LOCK_FILE = ".study.lock"
STUDY_OUTPUTS = (SETTINGS_FILE, WARMUP_DIR, RUNS_DIR, LOGS_DIR, *RESULT_FILES, LOCK_FILE)
RUN_DONE_FILE = "study_run.json"
WARMUP_DONE_FILE = "warmup.json"

# The default setting, chosen by experiment (README, "Multi-seed study"): the demo's task, model and warm-up,
# sampled at temperature 1.0 (the paper's math value), where about 8-16% of the tokens have p < 0.5 through
# training (the demo's 0.7: 1-4% by its end) and the reward still rises; 8 seeds x 4 methods fit 30 minutes
# of 2 idle CPU cores.
DEFAULT_SEEDS = 8
SETTING_DEFAULTS = {
    "people": "2",  # K&K sizes, comma-separated
    "temperature": 1.0,  # sampling temperature (also in the loss)
    "hidden_size": 128,  # the tiny Llama's width
    "num_layers": 2,
    "warmup_target": 0.3,  # stop the warm-up at this held-out greedy accuracy
    "warmup_steps": 600,  # ... or after this many steps
    "steps": 100,  # RL steps per run
    "prompts_per_step": 16,
    "n_samples": 8,
    "lr": 5e-4,
    "eval_prompts": 200,  # held-out puzzles for the final greedy accuracy
}
STUDY_HEADS = 4  # the tiny Llama's attention heads (demo.warmup.build_warm_model's)
SETTING_HELP = {
    "temperature": "sampling temperature, also applied in the loss",
    "hidden_size": "width of the tiny Llama (a multiple of 8: 4 heads of an even size)",
    "num_layers": "layers of the tiny Llama",
    "warmup_target": "stop the supervised warm-up at this greedy validation accuracy (0: run all its steps)",
    "warmup_steps": "most supervised warm-up steps",
    "steps": "RL steps per run",
    "prompts_per_step": "puzzles per RL step",
    "n_samples": "responses per puzzle (GRPO group size)",
    "lr": "learning rate of the RL runs",
    "eval_prompts": "held-out puzzles of the final greedy accuracy",
}
PEOPLE_FORM = "must be comma-separated K&K sizes in [2, 8], e.g. 2 or 3,4"
# Settings that are not flags of SETTING_DEFAULTS' kind, with the value a study folder written before they
# existed ran with.
SETTING_EXTRAS = {"optimizer": "adamw", "train_args": ""}
# `train` flags the study sets itself or depends on: refused in --train-args (the study flag is named instead).
OWNED_TRAIN_FLAGS = {
    "model": "the seed's warmed-up model", "out": "runs/<method>/seed<k>", "method": "--methods",
    "alpha": "--methods", "lopti": "--methods", "seed": "--seeds", "steps": "--steps", "optimizer": "--optimizer",
    "resume": "the study's own resumption", "overwrite": "the study's own resumption",
    "track_direction": "the study's Fig. 3 numbers", "progress": "the study's progress bar",
}  # fmt: skip
METRICS = (
    ("eval_accuracy", "final held-out greedy accuracy"),
    ("reward_last", "reward over the last 20% of steps"),
    ("pos_up_q4", "A>0 tokens with p >= .75 whose p rose, over training"),
)
# Paper Fig. 3 by probability quartile (bins [0,.25) [.25,.5) [.5,.75) [.75,1]), over the first FIRST_STEPS
# steps (near the starting model, as the paper's one-step measurement) and over the rest of the run.
FIRST_STEPS = 5
FIG3_KEYS = tuple(f"pos_up_q{q}_{part}" for part in ("first", "rest") for q in (1, 2, 3, 4))


def fig3_parts(steps: int) -> tuple:
    """``(part, label)`` of the two step ranges of :data:`FIG3_KEYS` in a run of ``steps`` steps."""
    return ("first", f"steps 1-{FIRST_STEPS}"), ("rest", f"steps {FIRST_STEPS + 1}-{steps}")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="openrlhf-lopti study",
        description="S seeds x methods of the local trainer on one setting, with 95% confidence intervals. "
        "Running it again continues an interrupted study.",
    )
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help=f"seeds 0..S-1 (default {DEFAULT_SEEDS})")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--out", default=None, help="study folder (default runs/study-<timestamp>)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes at once (default: CPU count)")
    p.add_argument("--people", default=SETTING_DEFAULTS["people"], help="comma-separated K&K sizes (default 2)")
    for name, value in SETTING_DEFAULTS.items():
        if name != "people":
            flag = "--" + name.replace("_", "-")
            p.add_argument(flag, type=type(value), default=value, help=f"{SETTING_HELP[name]} (default {value})")
    p.add_argument("--optimizer", default=SETTING_EXTRAS["optimizer"], choices=OPTIMIZERS,
                   help="optimizer of the RL runs: adamw, or sgd (plain gradient steps; default adamw)")  # fmt: skip
    p.add_argument("--train-args", default=SETTING_EXTRAS["train_args"],
                   help="more `openrlhf-lopti train` flags for every run, one quoted string, e.g. \"--lr 5e-5 "
                   "--momentum 0.9\"; given last, they override the study's value of a flag both set")  # fmt: skip
    p.add_argument("--loss-backend", default="auto", choices=("auto", "triton", "cpp", "torch"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a different study in --out (removes only the study's own files)")  # fmt: skip
    p.add_argument("--compare", nargs="+", metavar="STUDY_DIR", default=None,
                   help="print finished studies side by side (their study.json: each method against GRPO, outcomes "
                   "and Fig. 3 per quartile) and exit; runs nothing")  # fmt: skip
    p.add_argument("--warmup-job", type=int, default=None, help=argparse.SUPPRESS)  # internal: one seed's warm-up
    return p


def joined_train_args(argv: list) -> list:
    """``--train-args X`` as ``--train-args=X``: argparse would read a value that starts with ``--`` (such as
    ``--no-track-direction``) as a flag of its own."""
    out, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        out.append(f"{arg}={rest.pop(0)}" if arg == "--train-args" and rest else arg)
    return out


def parse_people(text: str) -> list:
    """``--people`` ("3" or "3,4") as a list of K&K sizes; :class:`UserError` with the expected form otherwise."""
    try:  # 3,,4 refused: a size was lost in typing
        people = people_sizes(text)
    except ValueError:
        raise UserError(f"--people {PEOPLE_FORM}, got {text!r}") from None
    if not people or any(not 2 <= n <= 8 for n in people):
        raise UserError(f"--people {PEOPLE_FORM}, got {text!r}")
    return people


def setting_of(args: argparse.Namespace) -> dict:
    """The fields that define the study's numbers (seeds, methods and jobs may change between runs)."""
    setting = {name: getattr(args, name) for name in SETTING_DEFAULTS}
    setting["people"] = parse_people(args.people)
    setting["loss_backend"] = args.loss_backend
    setting["optimizer"] = args.optimizer
    setting["train_args"] = args.train_args.strip()
    return setting


def check_setting(setting: dict) -> None:
    """Raise :class:`UserError` naming the flag of the first bad value."""
    if not setting["people"] or any(not 2 <= n <= 8 for n in setting["people"]):
        raise UserError(f"--people {PEOPLE_FORM}, got {setting['people']!r}")
    for name in ("hidden_size", "num_layers", "steps", "prompts_per_step", "eval_prompts"):
        if setting[name] < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {setting[name]}")
    if setting["n_samples"] < 2:
        raise UserError(f"--n-samples must be >= 2 (GRPO groups), got {setting['n_samples']}")
    if setting["warmup_steps"] < 1:
        raise UserError(f"--warmup-steps must be >= 1, got {setting['warmup_steps']}")
    if not 0 <= setting["warmup_target"] <= 1:
        raise UserError(f"--warmup-target must be in [0, 1], got {setting['warmup_target']}")
    for name in ("temperature", "lr"):
        if not (math.isfinite(setting[name]) and setting[name] > 0):
            raise UserError(f"--{name} must be a number > 0, got {setting[name]}")
    if setting["hidden_size"] % (2 * STUDY_HEADS):  # heads of an even size: Llama's rotary embedding rotates pairs
        raise UserError(f"--hidden-size {setting['hidden_size']}: must be a multiple of {2 * STUDY_HEADS} "
                        f"({STUDY_HEADS} attention heads of an even size, for the rotary embedding)")  # fmt: skip
    run_config(setting)


def run_config(setting: dict, out: Path = Path("study"), method: str = "grpo", seed: int = 0):
    """The :class:`TrainConfig` that ``train`` builds from a run's command line (:func:`train_command`), i.e.
    the setting with ``--train-args`` applied; raises :class:`UserError` for bad or study-owned train flags."""
    from openrlhf_lopti.local.cli import build_parser as train_parser, config_from_args

    try:
        extra = shlex.split(setting["train_args"])
    except ValueError as e:
        raise UserError(f"--train-args {setting['train_args']!r}: {e}") from None
    try:
        given = vars(train_parser().parse_args(extra))
    except UserError as e:
        raise UserError(f"--train-args {setting['train_args']!r}: {e}") from None
    for name in given:
        if name in OWNED_TRAIN_FLAGS:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"--train-args: {flag} is set by the study ({OWNED_TRAIN_FLAGS[name]}); leave it out")
    # the flags after `python -m openrlhf_lopti train`, as for a fresh run
    argv = [a for a in train_command(out, setting, method, seed)[4:] if a not in ("--resume", "--overwrite")]
    try:
        return config_from_args(train_parser().parse_args(argv))
    except UserError as e:  # a study flag's value names itself; one from --train-args is told where it came from
        if not setting["train_args"]:
            raise
        raise UserError(f"--train-args {setting['train_args']!r}: {e}") from None


def max_new_tokens(people: list) -> int:
    """Response budget: the ideal compact answer is 5 + 5 * people tokens with its eos, plus a few."""
    return 5 * max(people) + 9


# ---------------------------------------------------------------- the study folder


def open_study(out: Path, setting: dict, overwrite: bool) -> None:
    """Accept ``out`` (an existing folder, locked by :func:`lock_study`) for this setting: a new study, or the
    same study to resume; a different study there is refused unless ``overwrite`` (which removes
    :func:`study_files` only: a user's own files in ``runs/`` or ``logs/`` stay)."""
    full = {**SETTING_EXTRAS, **setting}  # a setting written before an extra existed ran with its default
    saved_path = out / SETTINGS_FILE
    ours = study_files(out)
    folders = [out / RUNS_DIR / m for m in METHODS] + [out / RUNS_DIR, out / WARMUP_DIR, out / LOGS_DIR]
    if saved_path.exists():
        try:
            saved = json.loads(saved_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            saved = None
        saved = {**SETTING_EXTRAS, **saved} if isinstance(saved, dict) else None
        if saved == full:
            return  # the same study: resume it
        if not overwrite:
            diff = sorted(k for k in full if saved is None or saved.get(k) != full[k])
            raise UserError(
                f"--out {out} holds a different study (settings differ: {', '.join(diff)}): pass --overwrite "
                "to replace it (only the study's own files are removed), or another --out"
            )
    elif not overwrite and (ours or any(f.is_dir() for f in folders)):  # a study's files, or its empty folders
        there = ours + [f for f in folders if f.is_dir()]
        shown = ", ".join(str(p.relative_to(out)) for p in there[:4]) + (", ..." if len(there) > 4 else "")
        raise UserError(
            f"--out {out} holds {shown} but no {SETTINGS_FILE}: not a study this command can resume; "
            "pass --overwrite to replace those (only they are removed), or another --out"
        )
    for path in ours:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for folder in folders:
        try:  # the study's folders go when they are empty; a user's file in one keeps it
            folder.rmdir()
        except OSError:
            pass
    (out / SETTINGS_FILE).write_text(json.dumps(setting, indent=2) + "\n")


def study_files(out: Path) -> list:
    """The study's own files and folders in ``out`` (what ``--overwrite`` removes): the settings and results, each
    ``warmup/seed<k>``, ``runs/<method>/seed<k>`` and the jobs' logs, and nothing else the user keeps there."""
    seed = re.compile(r"seed\d+")
    found = [out / name for name in (SETTINGS_FILE, *RESULT_FILES)]
    found += [p for p in sorted((out / WARMUP_DIR).glob("seed*")) if seed.fullmatch(p.name)]
    for method in METHODS:
        found += [p for p in sorted((out / RUNS_DIR / method).glob("seed*")) if seed.fullmatch(p.name)]
    logs = re.compile(r"(warmup|" + "|".join(re.escape(m.replace("+", "_")) for m in METHODS) + r")-seed\d+\.log")
    found += [p for p in sorted((out / LOGS_DIR).glob("*.log")) if logs.fullmatch(p.name)]
    return [p for p in found if p.exists() or p.is_symlink()]


def lock_study(out: Path):
    """Create ``out`` and hold an exclusive lock on it for this process's lifetime (a second study there
    is refused, before it can touch anything)."""
    import fcntl

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file; --out takes a folder")
    check_can_write(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = open(out / LOCK_FILE, "w")
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise UserError(f"--out {out}: another study is running in this folder") from None
    return handle


def warmup_dir(out: Path, seed: int) -> Path:
    return out / WARMUP_DIR / f"seed{seed}"


def run_dir(out: Path, method: str, seed: int) -> Path:
    return out / RUNS_DIR / method / f"seed{seed}"


def read_rows(path: Path) -> list:
    """metrics.jsonl rows (:func:`openrlhf_lopti.runs.read_metrics`: a torn last line is ignored); [] when missing."""
    return read_metrics(path) if path.exists() else []


# ---------------------------------------------------------------- jobs


def warmup_job(out: Path, seed: int) -> int:
    """Body of the internal ``--warmup-job SEED``: warm up seed ``seed``'s model, measure its held-out accuracy."""
    import torch

    from openrlhf_lopti.local.evaluation import kk_eval
    from openrlhf_lopti.local.model import load_model, quiet_transformers
    from openrlhf_lopti.local.task import eval_puzzles, prompt_for
    from openrlhf_lopti.demo.warmup import build_warm_model

    quiet_transformers()
    torch.set_num_threads(1)
    setting = json.loads((out / SETTINGS_FILE).read_text())
    path = warmup_dir(out, seed)
    facts = build_warm_model(
        path, seed=seed, max_steps=setting["warmup_steps"], target_accuracy=setting["warmup_target"],
        people=setting["people"], device="cpu", progress=False, hidden_size=setting["hidden_size"],
        num_layers=setting["num_layers"],
    )  # fmt: skip
    model, tokenizer, style = load_model(path)
    records = eval_puzzles(setting["eval_prompts"], setting["people"])
    prompts = [prompt_for(r, style, tokenizer) for r in records]
    facts["eval_accuracy"] = kk_eval(model, tokenizer, records, prompts, max_new_tokens(setting["people"]))["accuracy"]
    (path / WARMUP_DONE_FILE).write_text(json.dumps(facts, indent=2) + "\n")
    return 0


def train_command(out: Path, setting: dict, method: str, seed: int) -> list:
    """The ``openrlhf-lopti train`` command line of one run (``--resume`` when it has a checkpoint)."""
    rd = run_dir(out, method, seed)
    argv = [
        sys.executable, "-m", "openrlhf_lopti", "train", "--model", str(warmup_dir(out, seed)), "--out", str(rd),
        "--method", method, "--seed", str(seed), "--steps", str(setting["steps"]),
        "--prompts-per-step", str(setting["prompts_per_step"]), "--n-samples", str(setting["n_samples"]),
        "--max-new-tokens", str(max_new_tokens(setting["people"])), "--temperature", str(setting["temperature"]),
        "--people", ",".join(map(str, setting["people"])), "--lr", str(setting["lr"]), "--mini-batch-size", "64",
        "--eval-prompts", str(setting["eval_prompts"]), "--loss-backend", setting["loss_backend"],
        "--device", "cpu", "--track-direction", "--no-progress", "--threads", "1",
        "--optimizer", setting["optimizer"], *shlex.split(setting["train_args"]),
    ]  # fmt: skip
    if (rd / "checkpoint.pt").exists():
        argv.append("--resume")
    elif rd.exists():
        argv.append("--overwrite")  # died before its first checkpoint: start it again
    return argv


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the study process dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Job:
    """One subprocess of the study: a seed's warm-up or a (method, seed) run."""

    def __init__(self, name: str, argv: list, log: Path, done, after: Optional[list] = None, on_success=None):
        self.name, self.argv, self.log, self.done, self.after = name, argv, log, done, after or []
        self.on_success = on_success
        self.proc: Optional[subprocess.Popen] = None
        self.started = 0.0

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        argv = self.argv() if callable(self.argv) else self.argv
        with open(self.log, "a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
            )
        self.started = time.perf_counter()


def run_jobs(jobs: list, parallel: int, progress) -> list:
    """Run the jobs not yet ``done()``, at most ``parallel`` at once, each after the jobs in its ``after``.

    Returns the names of failed jobs. ``progress()`` is called about once a second. Ctrl-C / SIGTERM stops
    the running jobs (they resume from their checkpoints next time).
    """
    pending = [j for j in jobs if not j.done()]
    running: list = []
    failed: list = []
    try:
        while pending or running:
            for job in list(pending):
                if len(running) >= parallel:
                    break
                if any(dep.name in failed for dep in job.after):
                    pending.remove(job)
                    failed.append(job.name)
                elif all(dep.done() for dep in job.after):
                    pending.remove(job)
                    job.start()
                    running.append(job)
            if not running:  # nothing could start: the rest wait on jobs that did not finish
                failed += [j.name for j in pending]
                break
            for job in list(running):
                rc = job.proc.poll()
                if rc is None:
                    continue
                running.remove(job)
                if rc == 0 and job.on_success is not None:
                    job.on_success(time.perf_counter() - job.started)
                if rc != 0 or not job.done():
                    failed.append(job.name)
            progress(running)
            if running:
                time.sleep(1.0)
    finally:
        for job in running:
            job.proc.terminate()
        for job in running:
            try:
                job.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                job.proc.kill()
    return failed


def study_jobs(out: Path, setting: dict, seeds: list, methods: list) -> list:
    """The warm-up job of each seed, then the runs (seed-major, so early seeds finish first)."""
    jobs, warmups = [], {}
    for seed in seeds:
        done_file = warmup_dir(out, seed) / WARMUP_DONE_FILE
        argv = [sys.executable, "-m", "openrlhf_lopti.audit.study", "--out", str(out), "--warmup-job", str(seed)]
        warmups[seed] = Job(f"warmup seed {seed}", argv, out / LOGS_DIR / f"warmup-seed{seed}.log",
                            done=done_file.exists)  # fmt: skip
        jobs.append(warmups[seed])
    for seed in seeds:
        for method in methods:
            rd = run_dir(out, method, seed)

            def done(rd=rd) -> bool:
                return (rd / RUN_DONE_FILE).exists()

            def finished(seconds: float, rd=rd) -> None:
                rows = read_rows(rd / "metrics.jsonl")
                if len(rows) == setting["steps"] and (rd / "final_model").is_dir():
                    (rd / RUN_DONE_FILE).write_text(json.dumps({"seconds": seconds}) + "\n")

            jobs.append(Job(f"{method} seed {seed}", lambda m=method, s=seed: train_command(out, setting, m, s),
                            out / LOGS_DIR / f"{method.replace('+', '_')}-seed{seed}.log", done=done,
                            after=[warmups[seed]], on_success=finished))  # fmt: skip
    return jobs


# ---------------------------------------------------------------- analysis


def pooled_share(rows: list, q: int, kind: str = "pos") -> Optional[float]:
    """Share over the whole run: sum over steps of the bin's moved-right tokens / its A>0 (A<0) tokens."""
    share_key = f"direction/{'pos_up' if kind == 'pos' else 'neg_down'}_q{q}"
    count_key = f"direction/{kind}_tokens_q{q}"
    right = sum(r.get(share_key, 0.0) * r.get(count_key, 0.0) for r in rows)
    total = sum(r.get(count_key, 0.0) for r in rows)
    return right / total if total else None


def run_summary(rows: list) -> dict:
    """The numbers of one finished run."""
    tokens = [sum(r.get(f"direction/tokens_q{q}", 0.0) for r in rows) for q in (1, 2, 3, 4)]
    total = sum(tokens) or 1.0
    out = {
        "eval_accuracy": rows[-1].get("eval_accuracy") if rows else None,
        "reward_last": window_mean(rows, "reward", first=False),
        "reward_first": window_mean(rows, "reward", first=True),
        # runs written before the metric names were unified (issue 32) logged it as low_token_fraction
        "low_token_fraction": sum(r.get("lopti/low_token_frac", r.get("low_token_fraction", 0.0)) for r in rows)
        / max(len(rows), 1),
        "token_share_by_bin": [t / total for t in tokens],
    }
    for q in (1, 2, 3, 4):
        out[f"pos_up_q{q}"] = pooled_share(rows, q, "pos")
        out[f"neg_down_q{q}"] = pooled_share(rows, q, "neg")
        out[f"pos_up_q{q}_first"] = pooled_share(rows[:FIRST_STEPS], q, "pos")
        out[f"pos_up_q{q}_rest"] = pooled_share(rows[FIRST_STEPS:], q, "pos")
    return out


def summarize(out: Path, setting: dict, seeds: list, methods: list) -> dict:
    """Per run, per method (mean and 95% CI over seeds) and paired against GRPO."""
    runs = {m: {s: run_summary(read_rows(run_dir(out, m, s) / "metrics.jsonl")) for s in seeds} for m in methods}
    warm = {s: json.loads((warmup_dir(out, s) / WARMUP_DONE_FILE).read_text()) for s in seeds}
    keys = [k for k, _ in METRICS] + ["reward_first", "low_token_fraction", "pos_up_q1", "pos_up_q2", "pos_up_q3",
                                      "neg_down_q4", *FIG3_KEYS]  # fmt: skip
    per_method = {m: {k: mean_ci([runs[m][s][k] for s in seeds]) for k in keys} for m in methods}
    for m in methods:
        shares = [runs[m][s]["token_share_by_bin"] for s in seeds]
        per_method[m]["token_share_by_bin"] = [sum(x[q] for x in shares) / len(shares) for q in range(4)]
    paired = {}
    if "grpo" in methods:
        for m in methods:
            if m != "grpo":
                paired[m] = {
                    k: mean_ci(paired_differences({s: runs[m][s][k] for s in seeds},
                                                  {s: runs["grpo"][s][k] for s in seeds}))  # fmt: skip
                    for k in [k for k, _ in METRICS] + list(FIG3_KEYS)
                }
    train = run_config(setting, out).to_dict()
    return {
        "setting": setting,
        "train_config": {k: v for k, v in train.items() if k not in ("model", "out", "seed")},
        "seeds": seeds,
        "methods": methods,
        "warmup": {
            "eval_accuracy": mean_ci([warm[s]["eval_accuracy"] for s in seeds]),
            "steps": mean_ci([warm[s]["warmup_steps"] for s in seeds]),
            "parameters": warm[seeds[0]]["parameters"],
        },
        "per_method": per_method,
        "paired_vs_grpo": paired,
        "runs": runs,
        "confidence": "95%, Student's t over seeds (n - 1 degrees of freedom); paired: per-seed differences",
    }


def format_markdown(result: dict) -> str:
    s = result["setting"]
    n = len(result["seeds"])
    lines = [
        f"# Study: {n} seeds x {', '.join(result['methods'])}",
        "",
        f"K&K people {s['people']}, sampling temperature {s['temperature']}, tiny Llama "
        f"{result['warmup']['parameters']} parameters (hidden {s['hidden_size']}, {s['num_layers']} layers), "
        f"warm-up to {s['warmup_target']} held-out greedy accuracy (reached "
        f"{format_ci(result['warmup']['eval_accuracy'])} on the evaluation set), {s['steps']} RL steps of "
        f"{s['prompts_per_step']} x {s['n_samples']} responses, {optimizer_text(result['train_config'])}."
        + (f" Train args: `{s['train_args']}`." if s.get("train_args") else ""),
        "",
        "Mean over seeds [95% CI, Student's t].",
        "",
        "| method | " + " | ".join(label for _, label in METRICS) + " | reward, first 20% | p < 0.5 tokens | "
        "A>0 up, Q1 | A>0 up, Q2 | A>0 up, Q3 | A<0 down, Q4 |",
        "|" + "---|" * (len(METRICS) + 7),
    ]
    for m in result["methods"]:
        pm = result["per_method"][m]
        cells = [format_ci(pm[k]) for k, _ in METRICS]
        cells += [format_ci(pm["reward_first"]), format_ci(pm["low_token_fraction"])]
        cells += [format_ci(pm[k], ".2f") for k in ("pos_up_q1", "pos_up_q2", "pos_up_q3", "neg_down_q4")]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    shares = result["per_method"][result["methods"][0]]["token_share_by_bin"]
    lines += ["", f"Token share per bin ({result['methods'][0]}): "
              + ", ".join(f"Q{q + 1} {shares[q]:.3f}" for q in range(4)), ""]  # fmt: skip
    if result["paired_vs_grpo"]:
        lines += ["Paired differences against GRPO (same seeds): mean [95% CI]; * = the CI excludes 0.", "",
                  "| method - grpo | " + " | ".join(label for _, label in METRICS) + " |",
                  "|" + "---|" * (len(METRICS) + 1)]  # fmt: skip
        for m, diffs in result["paired_vs_grpo"].items():
            lines.append(f"| {m} | " + " | ".join(paired_cell(diffs[k]) for k, _ in METRICS) + " |")
    lines += ["", *fig3_tables(result)]
    return "\n".join(lines) + "\n"


def paired_cell(ci: dict) -> str:
    """A paired difference ``+0.012 [-0.003, +0.027]``, starred when its CI excludes 0."""
    star = " *" if ci["lo"] is not None and (ci["lo"] > 0 or ci["hi"] < 0) else ""
    return format_ci(ci, signed=True) + star


def optimizer_text(train: dict) -> str:
    """``"AdamW lr 0.0005"``, ``"SGD lr 0.5 (momentum 0.9)"``, with the Lopti variants when set."""
    text = f"{'SGD' if train['optimizer'] == 'sgd' else 'AdamW'} lr {train['lr']:g}"
    text += f" (momentum {train['momentum']:g})" if train.get("momentum") else ""
    text += ", Lopti per-phase optimizer state" if train.get("lopti_moments") == "per-phase" else ""
    return text + (f", Lopti lr x {train['lopti_lr_scale']:g}" if train.get("lopti_lr_scale", 1) != 1 else "")


def fig3_tables(result: dict) -> list:
    """Markdown lines: the Fig. 3 share per quartile, steps 1-5 and the rest, per method and paired vs GRPO."""
    head = " | ".join(f"Q{q}, {label}" for _, label in fig3_parts(result["setting"]["steps"]) for q in (1, 2, 3, 4))
    lines = ["Paper Fig. 3 by probability quartile (Q1 p < .25 ... Q4 p >= .75): the share of A>0 tokens whose p "
             "rose after the update, pooled over the steps.", "", f"| method | {head} |", "|" + "---|" * 9]  # fmt: skip
    for m in result["methods"]:
        pm = result["per_method"][m]
        lines.append(f"| {m} | " + " | ".join(format_ci(pm[k], ".3f") for k in FIG3_KEYS) + " |")
    if result["paired_vs_grpo"]:
        lines += ["", "The same, paired differences against GRPO (same seeds); * = the CI excludes 0.", "",
                  f"| method - grpo | {head} |", "|" + "---|" * 9]  # fmt: skip
        for m, diffs in result["paired_vs_grpo"].items():
            lines.append(f"| {m} | " + " | ".join(paired_cell(diffs[k]) for k in FIG3_KEYS) + " |")
    return lines


CURVES = (
    ("reward", "reward (paper rule)"),
    ("accuracy", "sampled accuracy"),
    ("direction/pos_up_q4", "A>0 tokens, p >= .75: share whose p rose"),
    ("low_token_fraction", "fraction of tokens with p < 0.5"),
)


def plot_study(out: Path, result: dict, path: Path) -> None:
    """Rows 1-2: per metric, each method's mean curve over seeds (each run smoothed over ~a tenth of its steps)
    with a 95% t band. Row 3: the Fig. 3 share per probability quartile, steps 1-5 and the rest, per method
    (mean over seeds and its 95% band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from openrlhf_lopti.local.plots import smooth

    steps = result["setting"]["steps"]
    window = max(1, steps // 10)
    fig, axes = plt.subplots(3, 2, figsize=(11, 11))
    for ax, (key, label) in zip(axes.flat, CURVES):
        for m in result["methods"]:
            curves = []
            for s in result["seeds"]:
                rows = read_rows(run_dir(out, m, s) / "metrics.jsonl")
                points = [(r["step"], r[key]) for r in rows if key in r]
                if points:
                    xs, ys = zip(*points)
                    curves.append(dict(zip(xs, smooth(list(ys), window))))
            xs = sorted({x for c in curves for x in c})
            band(ax, xs, [mean_ci([c[x] for c in curves if x in c]) for x in xs], m)
        if key.startswith("direction/"):
            ax.axhline(0.5, color="gray", linestyle="--", linewidth=1)
        ax.set_title(label)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    for ax, (part, label) in zip(axes[2], fig3_parts(steps)):
        for m in result["methods"]:
            cis = [result["per_method"][m][f"pos_up_q{q}_{part}"] for q in (1, 2, 3, 4)]
            band(ax, [1, 2, 3, 4], cis, m, marker="o")
        ax.axhline(0.5, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks([1, 2, 3, 4], ["Q1\np<.25", "Q2\n.25-.5", "Q3\n.5-.75", "Q4\np>=.75"])
        ax.set_title(f"A>0 tokens whose p rose (Fig. 3), {label}")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle(f"{len(result['seeds'])} seeds: mean and 95% CI (t); curves smoothed over {window} steps; "
                 f"{optimizer_text(result['train_config'])}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def band(ax, xs: list, cis: list, label: str, **style) -> None:
    """A mean line over ``xs`` with its 95% CI as a shaded band (``cis``: :func:`mean_ci` results)."""
    xs = [x for x, c in zip(xs, cis) if c["mean"] is not None]
    cis = [c for c in cis if c["mean"] is not None]
    (line,) = ax.plot(xs, [c["mean"] for c in cis], label=label, **style)
    if any(c["lo"] is not None for c in cis):
        lo = [c["lo"] if c["lo"] is not None else c["mean"] for c in cis]
        hi = [c["hi"] if c["hi"] is not None else c["mean"] for c in cis]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)


def read_result(out: Path) -> dict:
    """A finished study's ``study.json``; :class:`UserError` naming the folder otherwise."""
    path = out / "study.json"
    if not path.is_file():
        raise UserError(f"--compare {out}: no study.json in it (not a study folder, or the study has not finished)")
    try:
        result = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--compare {out}: its study.json is not valid JSON ({e}); run the study command on the "
                        "folder again to rewrite it (finished runs are kept)") from None  # fmt: skip
    keys = ("setting", "seeds", "methods", "per_method", "paired_vs_grpo")
    if not isinstance(result, dict) or any(k not in result for k in keys) or not result["methods"]:
        raise UserError(f"--compare {out}: its study.json is not a study's result (a JSON object with "
                        f"{', '.join(keys)}); run the study command on the folder again to rewrite it")  # fmt: skip
    first = result["per_method"].get(result["methods"][0]) if isinstance(result["per_method"], dict) else None
    if "train_config" not in result or not isinstance(first, dict) or "pos_up_q4_first" not in first:
        raise UserError(f"--compare {out}: its study.json was written by an older version; run the study command "
                        "on the folder again to rewrite it (finished runs are kept)")  # fmt: skip
    return result


def compare_markdown(results: list) -> str:
    """Studies side by side (``results``: ``(label, study.json)`` pairs): per method, its paired difference against GRPO
    on held-out accuracy, late reward and the Fig. 3 share per quartile (steps 1-5 and the rest)."""
    lines = ["| study | setting | seeds | method | held-out acc. | reward, last 20% | " +
             " | ".join(f"Q{q} up, {part}" for part in (f"1-{FIRST_STEPS}", "rest") for q in (1, 2, 3, 4)) + " |",
             "|" + "---|" * 14]  # fmt: skip
    for label, result in results:
        setting = optimizer_text(result["train_config"])
        rows = [("grpo", result["per_method"].get("grpo"), format_ci)] if "grpo" in result["methods"] else []
        rows += [(f"{m} - grpo", diffs, paired_cell) for m, diffs in result["paired_vs_grpo"].items()]
        for name, cis, cell in rows:
            keys = ["eval_accuracy", "reward_last", *FIG3_KEYS]
            lines.append(f"| {label} | {setting} | {len(result['seeds'])} | {name} | "
                         + " | ".join(cell(cis[k]) for k in keys) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(joined_train_args(sys.argv[1:] if argv is None else argv))
    if args.compare:
        print(compare_markdown([(d, read_result(Path(d))) for d in args.compare]))
        return 0
    if args.warmup_job is not None:
        if not args.out:
            raise UserError("--warmup-job needs --out")
        return warmup_job(Path(args.out), args.warmup_job)
    methods = method_list(args.methods)
    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {args.seeds}")
    if args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    setting = setting_of(args)
    check_setting(setting)
    out = Path(args.out or time.strftime("runs/study-%Y%m%d-%H%M%S"))
    lock = lock_study(out)
    open_study(out, setting, args.overwrite)
    # SIGTERM ends the study like Ctrl-C: its running jobs are stopped (run_jobs' finally) and resume later.
    signal.signal(signal.SIGTERM, _interrupt)
    seeds = list(range(args.seeds))
    t0 = time.perf_counter()
    jobs = study_jobs(out, setting, seeds, methods)
    runs = [run_dir(out, m, s) for s in seeds for m in methods]
    total = len(runs) * setting["steps"]
    todo = sum(not j.done() for j in jobs)
    print(f"study: {len(seeds)} seeds x {len(methods)} methods in {out}: {todo} of {len(jobs)} jobs to run, "
          f"{args.jobs} at a time")  # fmt: skip
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="study", unit="step", disable=args.no_progress)

    def progress(running: list) -> None:
        done_steps = sum(len(read_rows(rd / "metrics.jsonl")) for rd in runs)
        bar.update(done_steps - bar.n)
        bar.set_postfix_str(", ".join(j.name for j in running)[:60])

    try:
        failed = run_jobs(jobs, args.jobs, progress)
    except KeyboardInterrupt:
        bar.close()
        print(f"study: interrupted; run the same command again to continue ({out})", file=sys.stderr)
        return 130
    bar.close()
    if failed:
        print(f"study: {len(failed)} job(s) failed: {', '.join(failed)}; see {out / LOGS_DIR}", file=sys.stderr)
        return 1
    result = summarize(out, setting, seeds, methods)
    seconds = time.perf_counter() - t0
    result["seconds_this_invocation"] = seconds
    # CPU time of this invocation's jobs: divided by the cores, the wall time an idle machine would need.
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu_seconds_this_invocation"] = children.ru_utime + children.ru_stime
    result["load_average_at_end"] = os.getloadavg()
    result["jobs"] = args.jobs
    result["run_seconds"] = {
        m: [json.loads((run_dir(out, m, s) / RUN_DONE_FILE).read_text())["seconds"] for s in seeds] for m in methods
    }
    write_json(result, out / "study.json")  # NaN as null
    text = format_markdown(result)
    (out / "study.md").write_text(text)
    plot_study(out, result, out / "study.png")
    print(text)
    print(f"study: done in {seconds:.0f} s wall, {result['cpu_seconds_this_invocation']:.0f} s CPU of its jobs; "
          f"{out / 'study.md'}, {out / 'study.json'}, {out / 'study.png'}")  # fmt: skip
    lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_command("openrlhf-lopti study", main, sys.argv[1:]))
