"""The one-process trainer: rollout -> reward -> advantage -> (Lopti phases) update, step after step.

A run directory holds ``config.json``, ``metrics.jsonl`` (one JSON object per step, ``step`` from 1),
``checkpoint.pt`` (see :mod:`.checkpoint`), ``plots.png`` and, when finished, ``final_model/`` (a
Hugging Face checkpoint). A killed run restarted with ``resume=True`` continues from its last
checkpoint; with ``save_every=1`` it loses at most the step in flight.
"""

import copy
import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from openrlhf_lopti.algo import approx_kl, direction_counts, direction_metrics, lopti_settings, plan_round
from openrlhf_lopti.errors import UserError
from openrlhf_lopti.ops.fused_policy_loss import backend_cannot_run
from openrlhf_lopti.runs import check_model_dir, check_out_dir, prepare_out_dir, read_metrics

from .checkpoint import CHECKPOINT_FILE, load_checkpoint, optimizer_states, save_checkpoint, set_rng_state
from .config import TrainConfig, saved_settings
from .dataset import PromptSet, epochs_done, load_prompt_set, step_indices
from .experience import make_experience
from .evaluation import kk_eval, reward_eval
from .model import load_model, save_model
from .plots import plot_runs
from .reward import RewardFile, check_once, queries_of
from .rollout import response_logprobs
from .task import eval_puzzles, prompt_for, resolve_prompt_style, train_puzzles
from .update import build_optimizers, update_policy

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
FINAL_MODEL_DIR = "final_model"
PLOT_FILE = "plots.png"
# Everything a run writes into its folder (with the temporary names of its atomic writes): exactly what
# `--overwrite` removes. A new output file must be added here.
RUN_OUTPUTS = (CONFIG_FILE, METRICS_FILE, CHECKPOINT_FILE, PLOT_FILE, FINAL_MODEL_DIR, f".{CONFIG_FILE}.tmp-*",
               f".{CHECKPOINT_FILE}.tmp-*", f".{FINAL_MODEL_DIR}.tmp-*", f".{FINAL_MODEL_DIR}.old-*")  # fmt: skip


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> cuda if available else cpu; anything else as given, refused (before anything is loaded) when
    this machine has no such device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise UserError(f"--device {device}: torch {torch.__version__} sees {count} CUDA device(s) here; "
                            "use --device cpu, or auto")  # fmt: skip
    return resolved


def check_run_dir(
    out: str | os.PathLike,
    resume: bool,
    overwrite: bool,
    names: Sequence[str] = RUN_OUTPUTS,
    can_resume: bool = True,
    inputs: Sequence[tuple] = (),
) -> Path:
    """Create the run folder ``out`` or accept it (:func:`openrlhf_lopti.runs.prepare_out_dir`).

    An earlier run's files (``names``) there are refused unless ``resume`` (kept) or ``overwrite``
    (removed, and only they: other files in ``out`` stay). ``inputs`` (``(flag, path)``) are never written.
    """
    return prepare_out_dir(out, names, overwrite=overwrite, resume=resume, can_resume=can_resume, inputs=inputs)


def check_loss_backend(backend: str, device: torch.device) -> None:
    """Refuse, before anything is loaded or written, a ``--loss-backend`` that cannot run on ``device`` (the rule of
    every front end: :func:`openrlhf_lopti.ops.fused_policy_loss.backend_cannot_run`)."""
    problem = backend_cannot_run(backend, device.type)
    if problem:
        raise UserError(f"--loss-backend {backend} {problem}; use --loss-backend auto")


class LocalTrainer:
    """Owns the policy, the frozen reference, the optimizer and the run directory of one run."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, overwrite: bool = False):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        check_loss_backend(cfg.loss_backend, self.device)
        check_model_dir(cfg.model)  # before the run folder is made
        # Every file the run reads: none may be an output (--overwrite would remove it before it is read).
        self.inputs = [("--model", cfg.model), ("--reward-file", cfg.reward_file)]
        for flag, paths in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
            self.inputs += [(flag, path.strip()) for path in (paths or "").split(",") if path.strip()]
        # Only checked here: --overwrite removes the earlier run once the first step is done (`_log`), so a run
        # that fails at start-up or in its first step (a typo, a reward error, out of memory) leaves it as it was.
        check_out_dir(cfg.out, RUN_OUTPUTS, overwrite=overwrite, resume=resume, can_resume=True, inputs=self.inputs)
        self.out, self._resume, self._overwrite = Path(cfg.out), resume, overwrite
        self.out.mkdir(parents=True, exist_ok=True)
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        self.policy, self.tokenizer, model_style = load_model(cfg.model, self.device, dtype)
        self.prompt_style = resolve_prompt_style(cfg.prompt_style, self.tokenizer, model_style)
        self._load_task()
        # The reference is the starting model, frozen; it needs no optimizer state and no checkpoint.
        self.ref = None
        if cfg.kl_coef != 0:
            self.ref = copy.deepcopy(self.policy).eval()
            self.ref.requires_grad_(False)
        # cfg.optimizer; with lopti_moments "per-phase", one per Lopti phase
        self.optimizers = build_optimizers(list(self.policy.parameters()), cfg)
        self.step = 0
        self.metrics_path = self.out / METRICS_FILE
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self._restore_or_start(resume)

    def _load_task(self) -> None:
        """The prompt datasets and the reward file, all checked before any step (errors name file and row)."""
        cfg = self.cfg
        self.reward = RewardFile(cfg.reward_file) if cfg.reward_file else None
        keys = (cfg.input_key, cfg.label_key, cfg.apply_chat_template, self.tokenizer, cfg.input_template)
        self.data: Optional[PromptSet] = load_prompt_set(cfg.data, "--data", *keys) if cfg.data else None
        self.eval_data: Optional[PromptSet] = None
        if cfg.eval_data:
            self.eval_data = load_prompt_set(cfg.eval_data, "--eval-data", *keys)
        if self.reward is not None:  # one call on the first prompts, so a reward file that fails fails now
            if self.data is not None:
                n = cfg.prompts_per_step
                check_once(self.reward, self.data.prompts[:n], self.data.labels[:n], "--data")
            else:
                _, prompts, labels = self.batch(0)
                check_once(self.reward, prompts, labels, "the K&K puzzles")

    def batch(self, step: int) -> tuple:
        """``(K&K records or None, prompt strings, labels)`` of step ``step`` (0-based); deterministic in
        ``(seed, step)``, so a resumed run samples what it would have sampled."""
        cfg = self.cfg
        if self.data is not None:
            rows = step_indices(len(self.data), cfg.seed, step, cfg.prompts_per_step)
            return None, [self.data.prompts[i] for i in rows], [self.data.labels[i] for i in rows]
        records = train_puzzles(cfg.seed, step, cfg.prompts_per_step, cfg.people)
        return records, self.prompts(records), [r["solution_text_format"] for r in records]

    def _restore_or_start(self, resume: bool) -> None:
        ckpt = load_checkpoint(self.out) if resume else None
        # A fresh run (or a resumed one that never checkpointed) writes config.json and a new metrics.jsonl
        # only when its first step is done (`_log`), so a run that fails at start-up leaves its folder reusable.
        self._fresh = ckpt is None
        self._backend_printed = False
        if ckpt is None:
            return
        # Fields that may change between a run and its resumption: the rest must match.
        free = ("steps", "progress", "out", "device", "loss_backend")
        # a field the checkpointed run's version did not have yet ran with its default
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
        # the checkpoint's settings read as config.json's are (an older version's stale eta dropped)
        saved = {k: v for k, v in {**defaults, **saved_settings(ckpt["config"])}.items() if k not in free}
        given = {k: v for k, v in self.cfg.to_dict().items() if k not in free}
        for settings in (saved, given):  # eta unset is the paper's 0.5: the same setting as --eta 0.5
            settings["eta"] = 0.5 if settings.get("eta") is None else settings["eta"]
        if saved != given:
            diff = sorted(k for k in saved if saved[k] != given.get(k))
            shown = ", ".join(f"--{k.replace('_', '-')} (run: {saved[k]!r}, now: {given.get(k)!r})" for k in diff)
            raise UserError(f"--resume: {shown} differ from the run in {self.out}: drop those flags to continue "
                            "it, or start a new run in another --out")  # fmt: skip
        # Every check before anything is written: a refused resume leaves config.json and metrics.jsonl as they were.
        if self.cfg.steps < ckpt["step"]:  # config.json would say fewer steps than the checkpoint holds
            raise UserError(f"--resume: the run in {self.out} has done {ckpt['step']} steps, more than --steps "
                            f"{self.cfg.steps}: give --steps {ckpt['step']} or more")  # fmt: skip
        if not self.metrics_path.is_file() or self.metrics_path.stat().st_size < ckpt["metrics_offset"]:
            raise UserError(f"--resume: {self.metrics_path} is missing or shorter than when step {ckpt['step']} was "
                            f"checkpointed ({ckpt['metrics_offset']} bytes): put it back, or start the run again with "
                            "--overwrite")  # fmt: skip
        try:
            self.policy.load_state_dict(ckpt["model"])
            for optimizer, state in zip(self.optimizers, optimizer_states(ckpt), strict=True):
                optimizer.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError) as e:  # the --model folder changed since the run started
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"--resume: the checkpoint in {self.out} does not fit --model {self.cfg.model} (changed "
                            f"since the run started?): {reason}") from None  # fmt: skip
        set_rng_state(ckpt["rng"])
        self.step = ckpt["step"]
        # Drop metrics logged after the checkpoint (the step that was in flight is redone).
        with open(self.metrics_path, "r+b") as f:
            f.truncate(ckpt["metrics_offset"])
        # The run now goes on with these settings (a longer --steps, another --device): config.json says so, or a
        # later plain --resume would read the old ones and stop at the old --steps as if the run were finished.
        self._write_config()

    def prompts(self, records: list) -> list:
        return [prompt_for(r, self.prompt_style, self.tokenizer) for r in records]

    def train_step(self) -> dict:
        """Run step ``self.step + 1``: sample, score, update. Returns its metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        records, prompts, labels = self.batch(self.step)
        reward = None
        if self.reward is not None:
            repeat = [i for i in range(len(prompts)) for _ in range(cfg.n_samples)]  # rollout row -> prompt

            def reward(rollout):
                queries = queries_of(rollout.sequences, rollout.attention_mask, self.tokenizer)
                return self.reward(queries, [prompts[i] for i in repeat], [labels[i] for i in repeat],
                                   f"step {self.step + 1}")  # fmt: skip

        exp = make_experience(self.policy, self.ref, self.tokenizer, records, prompts, cfg, reward)
        t1 = time.perf_counter()
        # Shuffling depends only on (seed, step), so a resumed step reshuffles identically.
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
        update = update_policy(self.policy, self.optimizers, exp, cfg, generator)
        t2 = time.perf_counter()
        backend = update.pop("loss_backend")
        if backend is not None and not self._backend_printed:  # once per run: which kernel trained it
            # stdout: stderr is where a failing run's one-line error goes
            print(f"[openrlhf-lopti] local trainer: loss head on the {backend} backend ({cfg.loss_backend} asked)")
            self._backend_printed = True

        mask = exp.rollout.action_mask
        tokens = mask.sum().clamp(min=1)
        metrics = {"step": self.step + 1, "reward": float(exp.rewards.mean())}
        if exp.correct is not None:  # K&K: every role right; a reward file: the mean of its scores
            metrics["accuracy"] = float(exp.correct.float().mean())
        if exp.format_ok is not None:
            metrics["format_rate"] = float(exp.format_ok.float().mean())
        metrics.update({f"reward/{k}": float(v.float().mean()) for k, v in exp.extra.items()})
        if self.data is not None:
            metrics["epoch"] = epochs_done(len(self.data), self.step + 1, cfg.prompts_per_step)
        metrics["response_tokens"] = float(mask.sum(-1).float().mean())
        if not cfg.lopti and cfg.eta != 0:  # eta None: the paper's 0.5
            # the share of tokens Lopti would put in its low phase, logged for every method so that runs compare
            diagnostic = plan_round(exp.old_log_probs, mask, lopti_settings(True, cfg.eta, cfg.lopti_order))
            metrics["lopti/low_token_frac"] = diagnostic.metrics["lopti/low_token_frac"]
        if exp.ref_log_probs is not None:
            kl = approx_kl(exp.old_log_probs, exp.ref_log_probs, cfg.kl_estimator)
            metrics["kl"] = float((kl * mask).sum() / tokens)
        metrics.update(update)
        metrics.update({"rollout_s": t1 - t0, "train_s": t2 - t1})
        if cfg.track_direction:
            # Paper Fig. 3 inside training: this step's tokens re-scored by the updated policy (the optimizer
            # state is training's own), by the same call and micro-batches that scored them at sampling time.
            micro = cfg.micro_batch_size or cfg.mini_batch_size
            new_log_probs = response_logprobs(self.policy, exp.rollout, cfg.temperature, micro,
                                              fused_lm_head=cfg.fused_lm_head, backend=cfg.loss_backend)  # fmt: skip
            counts = direction_counts(exp.old_log_probs, new_log_probs, exp.advantages, mask)
            metrics.update(direction_metrics(counts))
            metrics["direction_s"] = time.perf_counter() - t2
        self.step += 1
        if self.evaluates and cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
            metrics.update({f"eval_{k}": v for k, v in self.evaluate().items()})
        return metrics

    @property
    def evaluates(self) -> bool:
        """Whether the run has a held-out set: ``eval_prompts`` K&K puzzles or ``eval_data``."""
        return bool(self.cfg.eval_prompts) or self.eval_data is not None

    def evaluate(self) -> dict:
        """Held-out metrics: ``eval_data`` (its first ``eval_prompts`` rows; all for 0) or ``eval_prompts``
        fixed K&K puzzles, scored by the reward file if there is one, else by the paper's rule; greedy, or
        ``eval_n_samples`` responses per prompt sampled at ``temperature``."""
        cfg = self.cfg
        if self.eval_data is not None:
            rows = slice(0, cfg.eval_prompts or None)
            prompts, labels = self.eval_data.prompts[rows], self.eval_data.labels[rows]
            sources = self.eval_data.datasources[rows]
        else:
            records = eval_puzzles(cfg.eval_prompts, cfg.people)
            prompts = self.prompts(records)
            if self.reward is None:
                return kk_eval(self.policy, self.tokenizer, records, prompts, cfg.max_new_tokens,
                               n_samples=cfg.eval_n_samples, temperature=cfg.temperature)  # fmt: skip
            labels = [r["solution_text_format"] for r in records]
            sources = [f"kk_{len(r['names'])}ppl" for r in records]
        return reward_eval(self.policy, self.tokenizer, prompts, labels, sources, self.reward, cfg.max_new_tokens,
                           cfg.eval_n_samples, cfg.temperature)  # fmt: skip

    def _write_config(self) -> None:
        """``config.json``: the settings the run goes on with, replaced whole (a crash leaves the old or the new)."""
        tmp = self.out / f".{CONFIG_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        os.replace(tmp, self.out / CONFIG_FILE)

    def _log(self, metrics: dict) -> int:
        """Append one line to metrics.jsonl durably; returns the file size after it."""
        if self._fresh:  # the first step of a fresh run is done: the run's files start now
            check_run_dir(self.out, self._resume, self._overwrite, inputs=self.inputs)  # --overwrite removes now
            self._write_config()
            self.metrics_path.write_text("")
            self._fresh = False
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
            f.flush()
            os.fsync(f.fileno())
            return f.tell()

    def save(self, offset: int) -> None:
        save_checkpoint(
            self.out, model=self.policy, optimizer=self.optimizers, step=self.step, metrics_offset=offset,
            config=self.cfg.to_dict(),
        )  # fmt: skip

    def run(self, desc: Optional[str] = None) -> list:
        """Train until ``cfg.steps`` steps are done; returns all metrics rows of the run (resumed ones too)."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=self.step, desc=desc or cfg.method, disable=not cfg.progress, leave=True)
        while self.step < cfg.steps:
            metrics = self.train_step()
            if self.step == cfg.steps and self.evaluates:
                metrics.update({f"eval_{k}": v for k, v in self.evaluate().items()})
            offset = self._log(metrics)
            if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                self.save(offset)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward']:.2f}", acc=f"{metrics.get('accuracy', float('nan')):.2f}")
        bar.close()
        save_model(self.policy, self.tokenizer, self.out / FINAL_MODEL_DIR, self.prompt_style)
        rows = read_metrics(self.metrics_path)
        plot_runs({cfg.method: rows}, self.out / PLOT_FILE, title=f"{cfg.method} ({self.out.name})")
        return rows

