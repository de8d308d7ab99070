"""``openrlhf-lopti train``: the one-process GRPO / REINFORCE++ trainer with AR and Lopti on any local HF model.

Every :class:`.config.TrainConfig` field is a flag (``--prompts-per-step`` for ``prompts_per_step``).
Precedence: the field's default < the saved ``config.json`` (with ``--resume``) < ``--method``'s preset
< flags given explicitly. Example (the demo's warmed-up model, AR + Lopti)::

    openrlhf-lopti train --model runs/demo-X/warmup_model --out runs/arlopti --method ar+lopti --steps 50
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command

from .config import METHODS, ConfigError, TrainConfig, method_settings, saved_settings
from .model import quiet_transformers
from .task import people_sizes

HELP = {
    "model": "local Hugging Face checkpoint directory (required unless resuming)",
    "out": "run directory (default runs/train-<timestamp>)",
    "estimator": "grpo (group-normalised) or reinforce++ (batch-whitened, k1 KL in the reward)",
    "alpha": "Advantage Reweighting strength in [0, 1] (0 = off; paper: 0.3 K&K, 0.1 math)",
    "lopti": "Low-Probability Token Isolation: update low-p tokens, then high-p tokens",
    "eta": "Lopti threshold on the rollout probability (default: the paper's 0.5; not with --lopti-quantile)",
    "lopti_order": "low_first (Lopti) or high_first (the paper's collapsing ablation)",
    "lopti_quantile": "use this quantile of the batch's token probabilities as the threshold (turns Lopti on by "
    "itself; not with --eta)",
    "lopti_moments": "shared (the paper's: both phases step one optimizer, so phase 2 carries the moments phase 1 "
    "just filled) or per-phase (opt-in: each phase its own optimizer state; measured worse, README study); "
    "no effect without Lopti",
    "lopti_lr_scale": "Lopti's phases step at lr times this (opt-in; the paper's is 1; 0.5 makes Lopti's two AdamW "
    "steps about as long as GRPO's one); no effect without Lopti",
    "steps": "RL steps (one batch of rollouts each)",
    "prompts_per_step": "prompts (puzzles or --data rows) per step",
    "n_samples": "responses per puzzle (GRPO group size)",
    "max_new_tokens": "response length cap, tokens",
    "temperature": "sampling temperature (also divides the logits in the loss)",
    "people": "comma-separated K&K sizes cycled over prompts, e.g. 3,4,5",
    "prompt_style": "K&K prompts: auto, compact (demo model), chat (chat template), text (plain)",
    "data": "prompt dataset instead of K&K puzzles: jsonl, json, parquet or a datasets save_to_disk folder "
    "(comma-separated: concatenated), as OpenRLHF's --data.prompt_dataset; needs --reward-file",
    "eval_data": "held-out prompt dataset scored with --reward-file (as OpenRLHF's --eval.dataset)",
    "input_key": "dataset field of the prompt (OpenRLHF's --data.input_key)",
    "label_key": "dataset field passed to reward_func as the label ('' = none; OpenRLHF's --data.label_key)",
    "apply_chat_template": "render the prompt field (a string or chat messages) with the tokenizer's chat template "
    "(OpenRLHF's --data.apply_chat_template)",
    "input_template": "format string for plain-text prompts, e.g. 'User: {}\\nAssistant:' (OpenRLHF's "
    "--data.input_template)",
    "reward_file": "a .py file with OpenRLHF's reward_func(queries, prompts, labels) (what --reward.remote_url "
    "takes), e.g. tasks/reward_math.py; default with K&K: the paper's rule",
    "eval_n_samples": "responses per held-out prompt: 1 = greedy, more = sampled at --temperature",
    "optimizer": "adamw, or sgd (plain gradient steps: the update is the clipped gradient times --lr)",
    "lr": "learning rate",
    "momentum": "sgd momentum (0: none)",
    "weight_decay": "weight decay (AdamW: decoupled; sgd: L2, the same for plain SGD)",
    "mini_batch_size": "responses per optimizer step",
    "micro_batch_size": "responses per forward pass (gradient accumulation; 0 = the mini-batch)",
    "epochs": "passes over each batch (per Lopti phase)",
    "grad_clip": "max global gradient norm (0 = off)",
    "kl_coef": "KL weight: loss term for grpo, reward penalty for reinforce++ (0 = no reference model)",
    "kl_estimator": "k1, k2 or k3",
    "eps_low": "PPO clip below: ratio >= 1 - eps_low",
    "eps_high": "PPO clip above: ratio <= 1 + eps_high",
    "seed": "seed of sampling, shuffling and puzzle choice",
    "device": "auto, cpu, cuda, cuda:N",
    "dtype": "float32 or bfloat16",
    "loss_backend": "fused_policy_loss backend: auto, triton, cpp, torch",
    "fused_lm_head": "run the lm_head with the loss chunk by chunk from the last hidden states (training step and "
    "log-prob passes): the model's [tokens, vocab] logits are never made; costs one extra lm_head matmul in backward",
    "save_every": "steps between checkpoints (1: a crash loses at most one step)",
    "eval_every": "steps between held-out evaluations (0: only at the end)",
    "eval_prompts": "held-out K&K puzzles per evaluation (0: none); with --eval-data its first N rows (0: all)",
    "progress": "tqdm progress bar",
    "track_direction": "after each update, log per probability bin the share of positive-advantage tokens whose "
    "log-prob rose and of negative ones whose log-prob fell (direction/*, paper Fig. 3; one extra forward pass)",
}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="openrlhf-lopti train",
        description="One-process GRPO / REINFORCE++ with Advantage Reweighting and Lopti, on generated Knights "
        "and Knaves puzzles or on any prompt dataset with an OpenRLHF reward file.",
        argument_default=argparse.SUPPRESS,  # only flags given on the command line reach the config
    )
    p.add_argument("--method", choices=tuple(METHODS), help="preset for alpha and lopti (flags override it)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name == "people":
            p.add_argument(flag, type=people_list, help=HELP[f.name])
        elif isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=HELP[f.name])
        elif f.name in ("eta", "lopti_quantile"):  # None by default: unset
            p.add_argument(flag, type=float, help=HELP[f.name])
        else:
            kind = type(default) if default is not None else str
            text = HELP[f.name] if default is None else f"{HELP[f.name]} (default {default})"
            p.add_argument(flag, type=kind, help=text)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default 1, as the demo: on a machine busy with other work more threads "
                   "spin-wait for each other, several times slower; 0: torch's choice, faster for a larger model on "
                   "idle cores)")  # fmt: skip
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    mode.add_argument("--overwrite", action="store_true",
                      help="replace an earlier run's files in --out (only those; other files stay), once the new "
                      "run's first step is done: a run that fails before that leaves them as they were")  # fmt: skip
    return p


def people_list(text: str) -> list:
    """``--people 3,4,5`` -> ``[3, 4, 5]`` (:func:`.task.people_sizes`: ``3,,4`` is refused, not read as 3,4)."""
    try:
        return people_sizes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated K&K sizes, e.g. 3,4,5, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Merge defaults, the saved config (when resuming), the method preset and explicit flags."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    if "out" not in given:
        if getattr(args, "resume", False):
            raise UserError("--resume needs --out (the run folder to continue)")
        import time

        given["out"] = time.strftime("runs/train-%Y%m%d-%H%M%S")
    values = {}
    saved = Path(given["out"]) / "config.json"
    if getattr(args, "resume", False) and saved.exists():
        try:
            values = json.loads(saved.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"--resume: {saved} line {e.lineno} is not valid JSON ({e.msg})") from None
        except UnicodeDecodeError:
            raise UserError(f"--resume: {saved} is not a text file; it should hold the run's settings") from None
        if not isinstance(values, dict):  # valid JSON but [1, 2] or null: not the settings train writes
            raise UserError(f"--resume: {saved} holds a JSON {type(values).__name__}, not the run's settings (an "
                            "object of flag names and values, as train writes it); --overwrite to start again")  # fmt: skip
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(TrainConfig)})
        if unknown:
            raise UserError(f"--resume: {saved} has settings this version does not know: {unknown}")
        values = saved_settings(values)  # an older version's stale eta dropped, as the trainer reads its checkpoint
    if getattr(args, "method", None):
        values.update(method_settings(args.method))
    values.update(given)
    if "model" not in values:
        resuming = getattr(args, "resume", False)  # else told only to name a model: say the folder holds no run
        none_there = f"; --resume found no run in {given['out']} (no config.json)" if resuming else ""
        raise UserError(f"--model is required (a local Hugging Face checkpoint folder){none_there}")
    try:
        return TrainConfig.from_dict(values)
    except ConfigError as e:  # the config names its field; the user typed a flag
        raise e.as_flag_error() from None


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_transformers()
    if args.threads is not None and args.threads < 0:
        raise UserError(f"--threads must be >= 0 (0: torch's choice), got {args.threads}")
    cfg = config_from_args(args)
    import torch

    if args.threads is None and torch.get_num_threads() > 1:  # the default, told: a many-core user may want more
        print(f"train: 1 torch thread (the default, as the demo's); --threads 0 gives torch's choice, "
              f"{torch.get_num_threads()} here, faster for a larger model on idle cores")  # fmt: skip
    threads = 1 if args.threads is None else args.threads
    if threads:
        torch.set_num_threads(threads)
    from .trainer import LocalTrainer

    trainer = LocalTrainer(cfg, resume=getattr(args, "resume", False), overwrite=getattr(args, "overwrite", False))
    rows = trainer.run()
    last = rows[-1] if rows else {}
    summary = ", ".join(f"{k} {last[k]:.3f}" for k in ("reward", "accuracy", "eval_accuracy") if k in last)
    print(f"train: {cfg.method}, {len(rows)} steps in {trainer.out}; last step: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("openrlhf-lopti train", main, sys.argv[1:]))
