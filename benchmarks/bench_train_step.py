"""What a whole RL step costs, and where its time goes: GRPO / +AR / +Lopti / +AR+Lopti, both trainers, every
loss path, side by side.

Trainers (``--trainers``):

- ``local``: the one-process trainer (``openrlhf_lopti.local``, ``LocalTrainer.train_step``). One trainer per
  (loss path, method) lives in this process; each round runs one step of every trainer, methods (and loss
  paths) in an order rotated from round to round, so a method never always runs first or last on a shared
  machine. The first ``--warmup`` rounds are not counted.
- ``openrlhf``: OpenRLHF 0.11.2's own pipeline, ``python -m openrlhf_lopti.cli.train_ppo_ray --cpu`` (real
  DeepSpeed actor, Ray, vLLM on its CPU backend; one policy, one reference, one rollout engine,
  colocated), one launch per (loss path, method), launches in a rotated order, ``--openrlhf-warmup`` +
  ``--openrlhf-steps`` RL steps each; the first steps of each launch are not counted. Stage times are
  upstream's own ``timing/*`` (TensorBoard ``train/timing/*``; the step is their sum); per-phase Lopti times
  are read when the trainer logs them (``lopti/<phase>/train_s`` or ``timing/lopti_<phase>``) and reported
  missing otherwise.

Loss paths (``--loss-paths``):

- ``eager``: OpenRLHF: upstream's ``PolicyLoss`` (``--actor.fused_loss off``); local: ``--loss-backend torch``
  (the eager torch reference of the loss, on fp32 ``[N, V]`` logits);
- ``logits_kernel``: our fused loss on the model's logits (``--actor.fused_loss auto`` / ``--loss-backend
  auto``: the C++ kernel on CPU);
- ``fused_lm_head``: the lm_head and the loss together from the last hidden states (``--actor.fused_lm_head`` /
  ``--fused-lm-head``).

Per (trainer, method, loss path), medians with min / max over the counted steps: stage wall times
(generation; experience making = old / reference log-probs, reward, advantages; training, per Lopti phase;
OpenRLHF's weight broadcast to the rollout engine), training tokens/s (response tokens x epochs / training
seconds), optimizer steps, peak memory, the fraction of tokens below Lopti's eta; and Lopti's training-time
factor (``lopti`` / ``grpo`` and ``ar+lopti`` / ``ar``, the median of step-by-step ratios) next to the paper's
2.0x (Table 6: 17.6 s -> 35.3 s per step, Qwen2.5-3B).

Peak memory: local on CPU, the growth of the process's peak RSS during the step over its RSS when the step
starts (glibc's free memory is returned first with ``malloc_trim``, the peak mark reset through
``/proc/self/clear_refs``); on CUDA, the growth of ``max_memory_allocated``. OpenRLHF: the peak RSS (VmHWM) of
the policy actor's process over the whole launch, polled every 0.5 s.

Model: ``--model PATH`` (a Hugging Face folder with a chat template), or by default a random tiny Llama with a
K&K tokenizer (``openrlhf-lopti tiny-model``) of the size given by ``--hidden-size`` / ``--layers`` / ``--heads``
/ ``--vocab-size``, whose final norm is scaled by ``--sharpen`` so that its token probabilities spread over
both sides of eta = 0.5 as a trained model's do (a random model's are all near 1/V: every token would be
"low"). Prompts are 2-person K&K puzzles; the reward is the K&K rule plus 0.01 x the response's length in
characters, so that rewards (and advantages) vary within a group even for a random model.

    python -m benchmarks.bench_train_step --out benchmarks/results/train_step     # everything
    python -m benchmarks.bench_train_step --quick --out /tmp/bench                # a few minutes
    openrlhf-lopti bench-step --trainers local --methods grpo,lopti --loss-paths fused_lm_head --out /tmp/b

Writes ``train_step.json`` (keyed by trainer, method and loss path, plus every step's record), ``train_step.md``
(the table) and ``train_step.png`` (stacked stage times per method) into ``--out``.
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` and `openrlhf_lopti` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cpu_policy_loss import _cpu_model, _peak_growth, _start_peak_window  # noqa: E402
from openrlhf_lopti.errors import ArgumentParser, UserError, run_command  # noqa: E402
from openrlhf_lopti.local.config import METHODS  # noqa: E402

from openrlhf_lopti.runs import check_model_dir, prepare_out_dir  # noqa: E402

TRAINERS = ("local", "openrlhf")
LOSS_PATHS = ("eager", "logits_kernel", "fused_lm_head")
OUTPUTS = ("train_step.json", "train_step.md", "train_step.png")
PAPER_LOPTI_FACTOR = 2.0  # Table 6: 17.6 s -> 35.3 s of training per step, Qwen2.5-3B
# Lopti's factor: the method with Lopti over the same method without it.
LOPTI_PAIRS = {"lopti": "grpo", "ar+lopti": "ar"}
# Stages in plotting order; "train" is the whole update (a Lopti run also splits it into its phases).
STAGES = ("generation", "experience", "train", "broadcast")
PHASES = ("low", "high")  # Lopti's phases; the update runs them in --lopti-order
REWARD_FILE = '''"""bench_train_step's reward: the K&K rule plus 0.01 x the response's length in characters."""
from openrlhf_lopti.tasks.reward_kk import reward_func as kk_reward


def reward_func(queries, prompts, labels):
    out = kk_reward(queries, prompts, labels)
    length = [len(q) - len(p) for q, p in zip(queries, prompts)]
    out["rewards"] = out["rewards"] + 0.01 * out["rewards"].new_tensor(length)
    return out
'''
LOCAL_LOSS_PATHS = {  # loss path -> TrainConfig fields
    "eager": {"loss_backend": "torch", "fused_lm_head": False},
    "logits_kernel": {"loss_backend": "auto", "fused_lm_head": False},
    "fused_lm_head": {"loss_backend": "auto", "fused_lm_head": True},
}
OPENRLHF_STAGES = {  # record field -> upstream's status key under timing/
    "generation_s": "generation", "experience_s": "make_experience", "train_s": "ppo_train", "broadcast_s": "broadcast",
}  # fmt: skip
OPENRLHF_LOSS_PATHS = {  # loss path -> our flags of train_ppo_ray
    "eager": ["--actor.fused_loss", "off"],
    "logits_kernel": ["--actor.fused_loss", "auto"],
    "fused_lm_head": ["--actor.fused_loss", "auto", "--actor.fused_lm_head"],
}


# ---------------------------------------------------------------------------------------------- statistics
def spread(values: Sequence[float]) -> dict:
    """``{"median", "min", "max", "n"}`` of ``values`` (None for an empty list)."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def rotated(items: Sequence, shift: int) -> list:
    """``items`` rotated left by ``shift``: over ``len(items)`` rounds every item takes every position."""
    shift %= max(len(items), 1)
    return list(items[shift:]) + list(items[:shift])


SUMMARY_FIELDS = ("generation_s", "experience_s", "train_s", "broadcast_s", "step_s", "train_low_s", "train_high_s",
                  "generation_cpu_s", "experience_cpu_s", "train_cpu_s", "step_cpu_s", "train_tokens_per_s",
                  "optimizer_steps", "peak_memory_mib", "low_token_fraction", "response_tokens")  # fmt: skip
FACTOR_FIELDS = {"train": "train_s", "step": "step_s", "train_cpu": "train_cpu_s", "step_cpu": "step_cpu_s"}


def summarize(records: list) -> dict:
    """``{trainer: {method: {loss_path: {field: spread}}}}`` over the counted step records."""
    out: dict = {}
    order = {name: i for i, name in enumerate((*TRAINERS, *METHODS, *LOSS_PATHS))}
    for r in sorted(records, key=lambda r: (order[r["trainer"]], order[r["loss_path"]], order[r["method"]])):
        out.setdefault(r["trainer"], {}).setdefault(r["method"], {}).setdefault(r["loss_path"], []).append(r)
    return {
        trainer: {
            method: {path: {f: spread([r.get(f) for r in rows]) for f in SUMMARY_FIELDS} for path, rows in paths.items()}
            for method, paths in methods.items()
        }
        for trainer, methods in out.items()
    }


def lopti_factors(records: list) -> dict:
    """``{trainer: {loss_path: {method: {"train" | "step" | "train_cpu" | "step_cpu": spread}}}}``: Lopti's time
    factor, the ratio of a Lopti method's time to the same method's without Lopti, step by step (same round, or
    same launch order and step index), for the training stage and the whole step, in wall and (local) CPU
    seconds."""
    by_key = {(r["trainer"], r["loss_path"], r["method"], r["pair"]): r for r in records}
    out: dict = {}
    for (trainer, path, method, pair), r in by_key.items():
        base = by_key.get((trainer, path, LOPTI_PAIRS.get(method), pair))
        if method not in LOPTI_PAIRS or base is None:
            continue
        ratios = out.setdefault(trainer, {}).setdefault(path, {}).setdefault(method, {})
        for name, field in FACTOR_FIELDS.items():
            if r.get(field) is not None and base.get(field):
                ratios.setdefault(name, []).append(r[field] / base[field])
    return {t: {p: {m: {k: spread(v) for k, v in d.items()} for m, d in ms.items()} for p, ms in ps.items()}
            for t, ps in out.items()}  # fmt: skip


# ---------------------------------------------------------------------------------------------- the model and data
def build_bench_model(out: Path, hidden_size: int, layers: int, heads: int, vocab_size: Optional[int],
                      sharpen: float) -> Path:  # fmt: skip
    """A random tiny Llama + K&K tokenizer (``tiny-model``) whose final norm is scaled by ``sharpen``; saved to ``out``.
    Its lm_head has one row per tokenizer id: ``vocab_size`` (``None``: all the K&K text yields)."""
    import torch

    from openrlhf_lopti.demo.tiny_model import build_tiny_model

    try:
        model, tokenizer = build_tiny_model(hidden_size, layers, heads, max_positions=2048, vocab_size=vocab_size)
    except ValueError as exc:
        raise UserError(f"--vocab-size {vocab_size}: {exc}; for a larger vocabulary pass --model with a local "
                        "Hugging Face model folder") from None  # fmt: skip
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpen)  # logits x sharpen: peaked next-token distributions
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def vocab_of(model_dir: Path) -> tuple:
    """``(lm_head rows, tokenizer ids)`` of the model folder: what the loss head's ``V`` really was."""
    from transformers import AutoTokenizer

    config = json.loads((Path(model_dir) / "config.json").read_text())
    rows = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))  # None when neither says
    return rows, len(AutoTokenizer.from_pretrained(model_dir))


def write_kk_prompts(path: Path, count: int, people: Sequence[int], seed: int) -> Path:
    """``count`` K&K prompt records (OpenRLHF's dataset format: chat messages, label) for the OpenRLHF launches."""
    from openrlhf_lopti.local.task import train_puzzles
    from openrlhf_lopti.tasks.data import kk_record

    with open(path, "w", encoding="utf-8") as f:
        for puzzle in train_puzzles(seed, 0, count, list(people)):
            f.write(json.dumps(kk_record(puzzle)) + "\n")
    return path


# ---------------------------------------------------------------------------------------------- memory
def _malloc_trim() -> None:
    """Hand glibc's free heap pages back to the OS, so a step's peak RSS is not hidden by memory freed earlier."""
    name = ctypes.util.find_library("c")
    if name and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).malloc_trim(0)


class StepMemory:
    """Peak memory growth of one step: CPU RSS (``clear_refs`` / ``VmHWM``) or CUDA ``max_memory_allocated``."""

    def __init__(self, device):
        self.device = device

    def __enter__(self) -> "StepMemory":
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            _malloc_trim()
            self.method, self.base = _start_peak_window()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.growth = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.growth = _peak_growth(self.method, self.base)


def _status_kib(pid: int, field: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class ProcessTreePeaks(threading.Thread):
    """Polls the processes below ``root`` (Linux ``/proc``) and keeps each one's peak RSS (VmHWM) and name."""

    def __init__(self, root: int, every: float = 0.5):
        super().__init__(daemon=True)
        self.root, self.every = root, every
        self.peaks: dict = {}  # pid -> (VmHWM KiB, command line)
        self.done = threading.Event()

    def _tree(self) -> list:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                        parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        tree, frontier = [], [self.root]
        while frontier:
            pid = frontier.pop()
            tree.append(pid)
            frontier += [child for child, parent in parents.items() if parent == pid]
        return tree

    def poll(self) -> None:
        for pid in self._tree():
            peak = _status_kib(pid, "VmHWM")
            if peak is None:
                continue
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    name = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                old = self.peaks.get(pid, (0, ""))
                self.peaks[pid] = (max(old[0], peak), name or old[1])

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.poll()

    def peak_mib(self, name_part: str) -> Optional[float]:
        """The largest peak RSS (MiB) among processes whose command line contains ``name_part``."""
        found = [kib for kib, name in self.peaks.values() if name_part in name]
        return max(found) / 1024 if found else None


# ---------------------------------------------------------------------------------------------- the local trainer
@contextlib.contextmanager
def stage_clocks() -> Iterator[dict]:
    """While inside, the local trainer's stages add their ``[wall, cpu]`` seconds to the yielded dict:
    ``generation`` (``generate_rollouts`` as ``make_experience`` calls it), ``experience`` (the whole
    ``make_experience``, generation included) and ``train`` (``update_policy``). CPU seconds are this process's
    (every thread's), which a machine shared with other jobs inflates far less than wall seconds."""
    import openrlhf_lopti.local.experience as experience
    import openrlhf_lopti.local.trainer as trainer

    clocks = {"generation": [0.0, 0.0], "experience": [0.0, 0.0], "train": [0.0, 0.0]}
    patched = [(experience, "generate_rollouts", "generation"), (trainer, "make_experience", "experience"),
               (trainer, "update_policy", "train")]  # fmt: skip
    originals = [getattr(module, name) for module, name, _ in patched]

    def clocked(real, stage):
        def run(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return real(*args, **kwargs)
            finally:
                clocks[stage][0] += time.perf_counter() - wall
                clocks[stage][1] += time.process_time() - cpu

        return run

    for (module, name, stage), real in zip(patched, originals):
        setattr(module, name, clocked(real, stage))
    try:
        yield clocks
    finally:
        for (module, name, _), real in zip(patched, originals):
            setattr(module, name, real)


def local_config(args, model_dir: Path, reward_file: Path, out: Path, method: str, loss_path: str):
    """The ``TrainConfig`` of one local trainer: the benchmark's sizes, the paper's K&K loss settings."""
    from openrlhf_lopti.local.config import TrainConfig, method_settings

    return TrainConfig(
        model=str(model_dir), out=str(out), steps=10**9, prompts_per_step=args.prompts, n_samples=args.n_samples,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, people=list(args.people),
        reward_file=str(reward_file), lr=args.lr, mini_batch_size=args.mini_batch_size,
        micro_batch_size=args.micro_batch_size, kl_coef=0.001, kl_estimator="k3", eps_low=0.2, eps_high=0.24,
        eta=args.eta, seed=args.seed, device=args.device, progress=False,
        **LOCAL_LOSS_PATHS[loss_path], **method_settings(method),
    )  # fmt: skip


def bench_local(args, model_dir: Path, reward_file: Path, work: Path, log: Callable[[str], None]) -> list:
    """Every (loss path, method) trainer, ``args.warmup + args.repeats`` rounds of one step each; returns the
    counted steps' records."""
    import torch

    from openrlhf_lopti.local.trainer import LocalTrainer
    from openrlhf_lopti.ops import backends_ran

    trainers = {}
    for path in args.loss_paths:
        for method in args.methods:
            cfg = local_config(args, model_dir, reward_file, work / "local" / path / method, method, path)
            trainers[(path, method)] = LocalTrainer(cfg)
    records = []
    for round_ in range(args.warmup + args.repeats):
        counted = round_ >= args.warmup
        for path in rotated(args.loss_paths, round_):
            for method in rotated(args.methods, round_):
                trainer = trainers[(path, method)]
                torch.manual_seed(args.seed * 1_000_003 + round_)  # every method samples with the same seed
                before = backends_ran()
                with stage_clocks() as clocks, StepMemory(trainer.device) as memory:
                    metrics = trainer.train_step()
                after = backends_ran()
                record = local_record(trainer.cfg, metrics, clocks, memory.growth)
                record["loss_backend"] = sorted(name for name in after if after[name] > before.get(name, 0))
                record.update(trainer="local", method=method, loss_path=path, pair=round_, counted=counted)
                log(f"local {path:<13} {method:<8} round {round_ + 1}{'' if counted else ' (warm-up)'}: "
                    f"step {record['step_s']:.2f} s, train {record['train_s']:.2f} s")  # fmt: skip
                if counted:
                    records.append(record)
    return records


def local_record(cfg, metrics: dict, clocks: dict, memory_bytes: int) -> dict:
    """One step's record: the stage clocks (:func:`stage_clocks`), ``LocalTrainer.train_step``'s metrics
    (``lopti/<phase>/train_s``: Lopti's phases, wall seconds) and the step's memory growth."""
    batch = cfg.prompts_per_step * cfg.n_samples
    tokens = metrics["response_tokens"] * batch  # response_tokens is the mean per response
    (gen, gen_cpu), (exp, exp_cpu), (train, train_cpu) = clocks["generation"], clocks["experience"], clocks["train"]
    record = {
        "generation_s": gen, "experience_s": exp - gen, "train_s": train, "step_s": exp + train,
        "generation_cpu_s": gen_cpu, "experience_cpu_s": exp_cpu - gen_cpu, "train_cpu_s": train_cpu,
        "step_cpu_s": exp_cpu + train_cpu,
        "response_tokens": tokens,
        "train_tokens_per_s": tokens * cfg.epochs / train,
        "optimizer_steps": metrics["optimizer_steps"],
        "peak_memory_mib": memory_bytes / 2**20,
        "low_token_fraction": metrics.get("lopti/low_token_frac"),
    }
    if cfg.lopti:
        order = PHASES if cfg.lopti_order == "low_first" else PHASES[::-1]
        for phase in order:  # an empty phase trains for 0 s (it logs its tokens only); None: no per-phase times
            empty = metrics.get(f"lopti/{phase}/tokens") == 0
            record[f"train_{phase}_s"] = 0.0 if empty else metrics.get(f"lopti/{phase}/train_s")
    return record


# ---------------------------------------------------------------------------------------------- OpenRLHF
def openrlhf_argv(args, model_dir: Path, data: Path, reward_file: Path, save: Path, method: str, loss_path: str) -> list:
    """``train_ppo_ray`` flags of one launch: the benchmark's sizes, the paper's K&K loss settings, ``--cpu``."""
    alpha, lopti = METHODS[method]
    steps = args.openrlhf_warmup + args.openrlhf_steps
    sizes = {
        "--rollout.batch_size": args.prompts, "--rollout.n_samples_per_prompt": args.n_samples,
        "--rollout.max_new_tokens": args.max_new_tokens, "--rollout.temperature": args.temperature,
        "--rollout.micro_batch_size": args.micro_batch_size, "--train.batch_size": args.mini_batch_size,
        "--train.micro_batch_size": args.micro_batch_size, "--data.max_samples": steps * args.prompts,
        "--data.max_len": 1024 + args.max_new_tokens, "--actor.adam.lr": args.lr,
    }  # fmt: skip
    argv = [
        "--cpu", "--actor.model_name_or_path", str(model_dir), "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
        "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1", "--vllm.num_engines", "1",
        "--vllm.tensor_parallel_size", "1", "--train.colocate_all", "--ds.zero_stage", "2", "--ds.param_dtype", "fp32",
        "--reward.remote_url", str(reward_file), "--data.prompt_dataset", str(data), "--data.input_key", "prompt",
        "--data.label_key", "label", "--data.apply_chat_template", "--algo.advantage.estimator", "group_norm",
        "--train.max_epochs", "1", "--train.num_episodes", "1", "--actor.lr_scheduler", "constant",
        "--actor.eps_clip_low_high", "0.2", "0.24", "--actor.loss_agg_mode", "token-mean", "--algo.kl.use_loss",
        "--algo.kl.init_coef", "0.001", "--algo.kl.estimator", "k3", "--actor.entropy_coef", "0",
        "--ckpt.output_dir", str(save), "--ckpt.path", str(save / "ckpt"), "--ckpt.save_steps", str(10**6),
        "--logger.tensorboard_dir", str(save / "tensorboard"), "--logger.logging_steps", "1",
    ]  # fmt: skip
    for flag, value in sizes.items():
        argv += [flag, str(value)]
    argv += ["--algo.ar.alpha", str(alpha)] if alpha else []
    argv += ["--algo.lopti.eta", str(args.eta)] if lopti else []
    return argv + OPENRLHF_LOSS_PATHS[loss_path]


def openrlhf_has_flag(flag: str) -> bool:
    """Whether our ``train_ppo_ray`` parser knows ``flag`` (``--actor.fused_lm_head`` came late)."""
    from openrlhf_lopti.cli.train_ppo_ray import build_parser

    return any(flag in action.option_strings for action in build_parser()._actions)


def read_scalars(logdir: Path) -> dict:
    """``{tag: {step: value}}`` of every TensorBoard scalar under ``logdir`` (any sub-folder)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict = {}
    for folder in sorted({p.parent for p in logdir.rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return scalars


def openrlhf_records(args, scalars: dict, method: str, loss_path: str, launch: int, peak_mib: Optional[float]) -> list:
    """The counted steps of one launch from its ``train/*`` scalars (upstream's ``timing/*``, rollout stats, ours)."""

    def value(tag: str, step: int) -> Optional[float]:
        return scalars.get(f"train/{tag}", {}).get(step)

    alpha, lopti = METHODS[method]
    steps = sorted(scalars.get("train/timing/ppo_train", {}))
    if len(steps) < args.openrlhf_warmup + args.openrlhf_steps:
        raise RuntimeError(f"OpenRLHF {method}/{loss_path}: logged {len(steps)} steps, expected "
                           f"{args.openrlhf_warmup + args.openrlhf_steps}")  # fmt: skip
    records = []
    for step in steps[args.openrlhf_warmup :]:
        low = value("lopti/low_token_frac", step)
        tokens = value("rollout/response_length_mean", step) * value("rollout/num_samples", step)
        stages = {name: value(f"timing/{tag}", step) for name, tag in OPENRLHF_STAGES.items()}
        # upstream's optimizer steps per pass: the batch / --train.batch_size, once per non-empty Lopti phase
        passes = (int(low > 0) + int(low < 1)) if lopti and low is not None else 1
        record = {
            "trainer": "openrlhf", "method": method, "loss_path": loss_path, "pair": (launch, step), "counted": True,
            **stages, "step_s": sum(stages.values()),  # not upstream's step_total: it sums every timing/* key
            "response_tokens": tokens, "train_tokens_per_s": tokens / stages["train_s"],
            "optimizer_steps": passes * (args.prompts * args.n_samples // args.mini_batch_size),
            "peak_memory_mib": peak_mib, "low_token_fraction": low,
        }  # fmt: skip
        for phase in PHASES if lopti else ():  # None until the trainer logs them
            seconds = value(f"lopti/{phase}/train_s", step)
            record[f"train_{phase}_s"] = seconds if seconds is not None else value(f"timing/lopti_{phase}", step)
        records.append(record)
    return records


def bench_openrlhf(args, model_dir: Path, reward_file: Path, work: Path, log: Callable[[str], None]) -> list:
    """One ``--cpu`` launch per (loss path, method), ``args.openrlhf_launches`` times, in rotated orders."""
    data = write_kk_prompts(work / "kk_prompts.jsonl", (args.openrlhf_warmup + args.openrlhf_steps) * args.prompts,
                            args.people, args.seed)  # fmt: skip
    records = []
    for launch in range(args.openrlhf_launches):
        for path in rotated(args.loss_paths, launch):
            for method in rotated(args.methods, launch + args.loss_paths.index(path)):
                save = work / "openrlhf" / f"{path}-{method}-{launch}"
                argv = openrlhf_argv(args, model_dir, data, reward_file, save, method, path)
                cmd = [sys.executable, "-m", "openrlhf_lopti.cli.train_ppo_ray", *argv]
                log(f"openrlhf {path:<13} {method:<8} launch {launch + 1}: {args.openrlhf_warmup} + "
                    f"{args.openrlhf_steps} steps ...")  # fmt: skip
                started = time.perf_counter()
                save.mkdir(parents=True)
                env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
                with open(save / "launch.log", "w") as out:
                    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=work, env=env)
                    peaks = ProcessTreePeaks(proc.pid)
                    peaks.start()
                    code = proc.wait()
                    peaks.done.set()
                    peaks.join()
                if code != 0:
                    tail = (save / "launch.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"OpenRLHF launch {path}/{method} failed (exit {code}):\n{tail}")
                scalars = read_scalars(save / "tensorboard")
                new = openrlhf_records(args, scalars, method, path, launch, peaks.peak_mib("PolicyModelActor"))
                log(f"  done in {time.perf_counter() - started:.0f} s; median step "
                    f"{statistics.median(r['step_s'] for r in new):.2f} s")  # fmt: skip
                records += new
    return records


# ---------------------------------------------------------------------------------------------- report
def _fmt(stat: dict, digits: int = 2) -> str:
    if not stat or stat["median"] is None:
        return "n/a"
    if stat["n"] == 1:
        return f"{stat['median']:.{digits}f}"
    return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}-{stat['max']:.{digits}f})"


def markdown_table(report: dict) -> str:
    """One row per (trainer, loss path, method): medians (min-max) of the stage times and the rest. The stage columns
    (generation, experience, train, broadcast: OpenRLHF's weight sync to the rollout engine, n/a for the local
    trainer) add up to the step's."""
    lines = [
        "| trainer | loss path | method | generation s | experience s | train s | train low / high s | broadcast s "
        "| step s | train CPU s | train tok/s | opt. steps | peak MiB | low tokens | Lopti factor: train (CPU) "
        "| step (CPU) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for trainer, methods in report["results"].items():
        paths = list(dict.fromkeys(p for m in methods.values() for p in m))
        for path in paths:
            for method, by_path in methods.items():
                s = by_path.get(path)
                if s is None:
                    continue
                phases = " / ".join(_fmt(s[f"train_{p}_s"]) for p in PHASES) if METHODS[method][1] else ""
                factor = report["lopti_factor"].get(trainer, {}).get(path, {}).get(method, {})
                factors = ["" if kind not in factor else
                           f"{_fmt(factor[kind])}x" + (f" ({_fmt(factor[kind + '_cpu'])}x)" if kind + "_cpu" in factor else "")
                           for kind in ("train", "step")]  # fmt: skip
                lines.append(
                    f"| {trainer} | {path} | {method} | {_fmt(s['generation_s'])} | {_fmt(s['experience_s'])} "
                    f"| {_fmt(s['train_s'])} | {phases} | {_fmt(s['broadcast_s'])} | {_fmt(s['step_s'])} "
                    f"| {_fmt(s['train_cpu_s'])} "
                    f"| {_fmt(s['train_tokens_per_s'], 0)} | {_fmt(s['optimizer_steps'], 0)} "
                    f"| {_fmt(s['peak_memory_mib'], 0)} | {_fmt(s['low_token_fraction'])} | {factors[0]} | {factors[1]} |"
                )
    return "\n".join(lines)


def plot_stages(report: dict, path: Path) -> None:
    """Stacked median stage times per method, one panel per (trainer, loss path)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, p) for t, methods in report["results"].items()
              for p in dict.fromkeys(p for m in methods.values() for p in m)]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.5), squeeze=False, sharey=False)
    colors = {"generation": "#8da0cb", "experience": "#66c2a5", "train": "#e5c494", "train_low": "#e78ac3",
              "train_high": "#fc8d62", "broadcast": "#a6d854"}  # fmt: skip
    for ax, (trainer, loss_path) in zip(axes[0], panels):
        methods = [m for m in METHODS if loss_path in report["results"][trainer].get(m, {})]
        for i, method in enumerate(methods):
            s = report["results"][trainer][method][loss_path]
            lopti_split = METHODS[method][1] and all(s[f"train_{p}_s"]["median"] is not None for p in PHASES)
            parts = ["generation", "experience"] + (["train_low", "train_high"] if lopti_split else ["train"])
            parts += ["broadcast"] if s["broadcast_s"]["median"] is not None else []
            bottom = 0.0
            for part in parts:
                height = s[f"{part}_s"]["median"] or 0.0
                ax.bar(i, height, bottom=bottom, color=colors[part], label=part.replace("_", " "), edgecolor="white")
                bottom += height
        ax.set_xticks(range(len(methods)), methods)
        ax.set_title(f"{trainer}: {loss_path}")
        ax.set_ylabel("seconds per RL step (median)")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))  # one entry per stage
        ax.legend(unique.values(), unique.keys(), fontsize=8)
    fig.suptitle("Where an RL step's time goes (bench_train_step)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def machine() -> dict:
    """The CPU (``/proc/cpuinfo`` model name), cores, load average, versions."""
    import torch

    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": model or _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }  # fmt: skip
    with contextlib.suppress(OSError):
        info["load_average_1m"] = os.getloadavg()[0]
    return info


# ---------------------------------------------------------------------------------------------- command line
def _csv(choices: Sequence[str]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:  # argparse reports it as "argument <flag>: <this message>"
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated subset of {','.join(choices)}")
        return list(dict.fromkeys(items))

    return parse


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="bench_train_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/train_step",
                   help="folder for train_step.json/.md/.png (default benchmarks/results/train_step)")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs already in --out (only those)")
    p.add_argument("--quick", action="store_true", help="a short run: local 1 warm-up + 2 rounds; OpenRLHF only the "
                   "logits_kernel loss path, 1 + 1 steps per launch (explicit flags still win)")
    p.add_argument("--trainers", type=_csv(TRAINERS), default=None, help="local,openrlhf (default both)")
    p.add_argument("--methods", type=_csv(tuple(METHODS)), default=None,
                   help="comma-separated subset of grpo,ar,lopti,ar+lopti (default all)")
    p.add_argument("--loss-paths", type=_csv(LOSS_PATHS), default=None,
                   help="eager,logits_kernel,fused_lm_head (default all)")
    g = p.add_argument_group("model (default: a random tiny Llama built here)")
    g.add_argument("--model", help="a local Hugging Face model folder with a chat template, instead of the tiny model")
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="the tiny tokenizer's BPE ids = the lm_head's rows, at most what the K&K text yields "
                   "(default: all of it, 748)")  # fmt: skip
    g.add_argument("--sharpen", type=float, default=3.5,
                   help="scale of the tiny model's final norm (its logits): how peaked its next-token probabilities are")
    g = p.add_argument_group("sizes of one RL step (both trainers)")
    g.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    g.add_argument("--n-samples", type=int, default=8, help="responses per prompt (default 8, the paper's)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="response length limit (default 128)")
    g.add_argument("--mini-batch-size", type=int, default=32,
                   help="responses per optimizer step (default 32: 2 optimizer steps per pass, as the paper's K&K runs)")
    g.add_argument("--micro-batch-size", type=int, default=8, help="responses per forward (default 8)")
    g.add_argument("--people", type=int, nargs="+", default=[2], help="K&K puzzle sizes (default 2)")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--eta", type=float, default=0.5, help="Lopti's threshold (default 0.5, the paper's)")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("repeats")
    g.add_argument("--warmup", type=int, default=None, help="local: uncounted rounds first (default 1)")
    g.add_argument("--repeats", type=int, default=None, help="local: counted rounds, one step per trainer (default 3)")
    g.add_argument("--openrlhf-warmup", type=int, default=None, help="OpenRLHF: uncounted first steps per launch "
                   "(default 1)")
    g.add_argument("--openrlhf-steps", type=int, default=None, help="OpenRLHF: counted steps per launch (default 2)")
    g.add_argument("--openrlhf-launches", type=int, default=1, help="OpenRLHF: launches per (loss path, method)")
    g = p.add_argument_group("device")
    g.add_argument("--device", default="cpu", help="local trainer's device (default cpu); OpenRLHF runs with --cpu")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads of the local trainer and of every OpenRLHF process (OMP_NUM_THREADS); 0: "
                   "torch's default. Default 1: on a machine shared with other jobs, 2 threads made the update "
                   "5-15x slower and far noisier (a thread waits at each barrier for one the OS descheduled)")
    return p


def resolve_args(argv: Optional[list]):
    """Parse, apply ``--quick`` and the defaults, and check every value (a :class:`UserError` names the flag)."""
    args = build_parser().parse_args(argv)
    quick = args.quick
    args.trainers = args.trainers or list(TRAINERS)
    args.methods = args.methods or list(METHODS)
    explicit_paths = args.loss_paths is not None
    args.loss_paths = args.loss_paths or list(LOSS_PATHS)
    defaults = {"warmup": 1, "repeats": 2 if quick else 3, "openrlhf_warmup": 1, "openrlhf_steps": 1 if quick else 2}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.openrlhf_loss_paths = args.loss_paths if explicit_paths or not quick else ["logits_kernel"]
    for name in ("hidden_size", "layers", "heads", "vocab_size", "prompts", "n_samples", "max_new_tokens",
                 "mini_batch_size", "micro_batch_size", "repeats", "openrlhf_steps", "openrlhf_launches"):  # fmt: skip
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "openrlhf_warmup", "threads"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    from openrlhf_lopti.demo.tiny_model import check_head_size

    check_head_size(args.hidden_size, args.heads)  # a whole, even head size (Llama's rotary embedding)
    if not args.sharpen > 0 or not args.temperature > 0 or not args.lr > 0:
        raise UserError("--sharpen, --temperature and --lr must be > 0")
    if not 0 < args.eta <= 1:
        raise UserError(f"--eta must be in (0, 1], got {args.eta}")
    if args.n_samples < 2:
        raise UserError(f"--n-samples must be >= 2 for GRPO's group normalisation, got {args.n_samples}")
    batch = args.prompts * args.n_samples
    if args.mini_batch_size > batch or batch % args.mini_batch_size:
        raise UserError(f"--mini-batch-size {args.mini_batch_size} must divide the batch, --prompts x --n-samples = "
                        f"{batch} (OpenRLHF needs whole optimizer steps)")  # fmt: skip
    if args.mini_batch_size % args.micro_batch_size:
        raise UserError(f"--micro-batch-size {args.micro_batch_size} must divide --mini-batch-size "
                        f"{args.mini_batch_size}")  # fmt: skip
    if any(not 2 <= n <= 8 for n in args.people):
        raise UserError(f"--people takes K&K sizes in [2, 8], got {args.people}")
    if args.model:
        check_model_dir(args.model)
    return args


def main(argv: Optional[list] = None) -> int:
    """Run the benchmark; prints the table and writes ``train_step.json/.md/.png`` into ``--out``."""
    args = resolve_args(argv)
    out = prepare_out_dir(args.out, OUTPUTS, overwrite=args.overwrite, inputs=[("--model", args.model)])
    started = time.perf_counter()
    not_run = []
    if "openrlhf" in args.trainers and "fused_lm_head" in args.openrlhf_loss_paths:
        if not openrlhf_has_flag("--actor.fused_lm_head"):
            args.openrlhf_loss_paths = [p for p in args.openrlhf_loss_paths if p != "fused_lm_head"]
            not_run.append("openrlhf fused_lm_head: this train_ppo_ray has no --actor.fused_lm_head")

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    info = machine()
    records = []
    with tempfile.TemporaryDirectory(prefix="bench_train_step-") as tmp:
        work = Path(tmp)
        model_dir = Path(args.model) if args.model else build_bench_model(
            work / "model", args.hidden_size, args.layers, args.heads, args.vocab_size, args.sharpen)  # fmt: skip
        vocab = vocab_of(model_dir)
        reward_file = work / "reward_bench.py"
        reward_file.write_text(REWARD_FILE)
        if "local" in args.trainers:
            records += bench_local(args, model_dir, reward_file, work, log)
        if "openrlhf" in args.trainers and args.openrlhf_loss_paths:
            paths, args.loss_paths = args.loss_paths, args.openrlhf_loss_paths
            try:
                records += bench_openrlhf(args, model_dir, reward_file, work, log)
            finally:
                args.loss_paths = paths
    info["load_average_1m_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    settings["lm_head_rows"], settings["tokenizer_ids"] = vocab
    report = {
        "benchmark": "bench_train_step",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": time.perf_counter() - started,
        "machine": info,
        "settings": settings,
        "paper_lopti_factor": PAPER_LOPTI_FACTOR,
        "results": summarize(records),
        "lopti_factor": lopti_factors(records),
        "not_run": not_run,
        "records": records,
    }
    table = markdown_table(report)
    (out / "train_step.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    header = (f"{info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), "
              f"lm_head rows {settings['lm_head_rows']}, "
              f"load average {info.get('load_average_1m', 0):.1f} -> {info['load_average_1m_end'] or 0:.1f}; "
              f"took {report['wall_s']:.0f} s. Medians (min-max); Lopti factor = the Lopti method's time over the "
              f"same method's without Lopti, step by step (paper: {PAPER_LOPTI_FACTOR}x training time).")  # fmt: skip
    notes = "".join(f"\n- not run: {n}" for n in not_run)
    (out / "train_step.md").write_text(f"{header}\n\n{table}\n{notes}\n", encoding="utf-8")
    plot_stages(report, out / "train_step.png")
    print(header)
    print(table + notes)
    print(f"wrote {out / 'train_step.json'}, train_step.md, train_step.png")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("bench_train_step", main, sys.argv[1:]))
