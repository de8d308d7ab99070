"""``openrlhf-lopti audit``: which tokens drive an RL update, and which ones it moves the right way.

On one sampled batch of K&K responses (GRPO advantages), binned by token probability (lowest bin first):

1. the mean per-token gradient norm of the loss w.r.t. the logits, and w.r.t. all parameters for a
   random sample of tokens per bin (paper Fig. 1(d));
2. from the same weights, one update under each method (GRPO, +AR, +Lopti, +AR+Lopti), then the fraction
   of positive-advantage tokens whose probability went up (paper Fig. 3).

Writes ``audit.json`` (``grad_norm_by_quartile``, ``param_grad_norm_by_quartile``,
``correct_direction_by_quartile`` = {method: 4 fractions}, counts, edges, settings) and ``audit.png``
into ``--out`` and prints the table. Without ``--model`` it first builds and warms up the demo's model
(about 20 s on 2 CPU cores) into ``--out/warmup_model``.

``--checkpoint RUN_DIR`` audits a ``train`` run where it stands: the checkpointed weights, the batch the
run would sample next, and an update with the run's own optimizer and its state (``--optimizer checkpoint``:
AdamW or SGD, as the run trained; one per phase for a ``--lopti-moments per-phase`` run), i.e. the update
training would make. Without it the update uses a fresh AdamW (``--optimizer fresh-adamw``: its
first step is about ``lr * sign(grad)`` per parameter, which erases the gradient-size imbalance the paper
is about) or SGD.
"""

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from openrlhf_lopti.algo.option_checks import check_temperature
from openrlhf_lopti.demo.warmup import build_warm_model, check_warmup_flags
from openrlhf_lopti.errors import ArgumentParser, UserError, run_command
from openrlhf_lopti.local.config import METHODS, SEED_LIMIT, ConfigError, TrainConfig, method_list, saved_settings
from openrlhf_lopti.local.experience import make_experience
from openrlhf_lopti.local.model import load_model, quiet_transformers
from openrlhf_lopti.local.task import prompt_for, resolve_prompt_style, train_puzzles
from openrlhf_lopti.local.checkpoint import CHECKPOINT_FILE, optimizer_states as checkpoint_optimizer_states
from openrlhf_lopti.local.checkpoint import read_checkpoint
from openrlhf_lopti.local.trainer import FINAL_MODEL_DIR, check_run_dir, resolve_device

from .measure import (
    OPTIMIZERS,
    bin_edges,
    bin_index,
    correct_direction,
    logit_grad_norms,
    param_grad_norms,
    per_bin_mean,
    sample_per_bin,
)
from .report import format_table, plot, write_json
from .study import parse_people


# What an audit writes into --out: exactly what --overwrite removes (other files there stay).
AUDIT_OUTPUTS = ("audit.json", "audit.png", "warmup_model", ".warmup_model.tmp-*", ".warmup_model.old-*")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="openrlhf-lopti audit", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local HF checkpoint (default: build and warm up the demo model)")
    p.add_argument("--checkpoint", default=None, metavar="RUN_DIR",
                   help="a `train` run directory: audit its checkpointed weights with its optimizer state, on the "
                   "batch the run would sample next, with the run's sizes and temperature unless given")  # fmt: skip
    p.add_argument("--out", default=None, help="output directory (default runs/audit-<timestamp>)")
    p.add_argument("--prompts", type=int, default=None, help="puzzles in the batch (default 32; the run's)")
    p.add_argument("--n-samples", type=int, default=None, help="responses per puzzle (default 8; the run's)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default 20 for the demo model, else 512; the run's")  # fmt: skip
    p.add_argument("--temperature", type=float, default=None, help="default 0.7; the run's")
    p.add_argument("--people", default=None, help="comma-separated K&K sizes (default 2; the run's)")
    p.add_argument("--prompt-style", default="auto", choices=("auto", "compact", "chat", "text"))
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate of the one update (default 5e-4; with --checkpoint the run's)")  # fmt: skip
    p.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                   help="optimizer of the one update: checkpoint (training's optimizer and state; the default with "
                   "--checkpoint), fresh-adamw (a new AdamW, whose first step is about lr * sign(grad); the default "
                   "otherwise) or sgd (the raw gradient direction)")  # fmt: skip
    p.add_argument("--eta", type=float, default=None, help="Lopti threshold (default 0.5; the run's)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods to update with")
    p.add_argument("--bins", default="fixed", choices=("fixed", "quantile"),
                   help="fixed: p in [0,.25) [.25,.5) [.5,.75) [.75,1]; quantile: equal token counts")  # fmt: skip
    p.add_argument("--param-grad-tokens", type=int, default=16,
                   help="tokens per bin whose parameter gradient is measured, one backward each (0: skip)")  # fmt: skip
    p.add_argument("--warmup-steps", type=int, default=600, help="demo model only: most warm-up steps")
    p.add_argument("--warmup-target", type=float, default=0.3, help="demo model only: warm-up stop accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--loss-backend", default="auto", choices=("auto", "triton", "cpp", "torch"))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's choice)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier audit's files in --out (only those; other files stay)")  # fmt: skip
    return p


# Settings of the audited batch and update when neither a flag nor a checkpointed run gives them.
DEFAULTS = {"prompts": 32, "n_samples": 8, "temperature": 0.7, "people": [2], "lr": 5e-4, "eta": 0.5}
# A run's settings that --checkpoint takes only at these values: the audit's batch is K&K puzzles scored by the
# paper's rule with GRPO advantages, and its Lopti methods split by eta, low phase first.
AUDITED = {"data": None, "reward_file": None, "estimator": "grpo", "lopti_quantile": None, "lopti_order": "low_first"}


def load_checkpointed_run(run_dir: str | os.PathLike, device: torch.device) -> tuple:
    """``(model, tokenizer, prompt style, run config, checkpoint payload)`` of a ``train`` run directory:
    the model (float32) carries the checkpoint's weights; the payload holds the optimizer state and step.

    Reads ``checkpoint.pt`` without touching the directory, so a run still training is safe to audit.
    """
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT_FILE
    if not path.is_file():
        raise UserError(f"--checkpoint {str(run_dir)!r}: no {CHECKPOINT_FILE} in it (not a `train` run directory, "
                         "or a run that has not saved a checkpoint yet)")  # fmt: skip
    ckpt = read_checkpoint(path, "--checkpoint", "pass the folder of a `train` run that has saved a checkpoint")
    try:  # read as `train --resume` reads it (an older version's stale eta dropped)
        run_cfg = TrainConfig.from_dict(saved_settings(ckpt["config"]))
    except ValueError as e:  # a run of another version, whose settings this one does not take
        raise UserError(f"--checkpoint {str(run_dir)!r}: its settings are not this version's ({e})") from None
    differs = [f"--{k.replace('_', '-')} {getattr(run_cfg, k)}" for k, v in AUDITED.items() if getattr(run_cfg, k) != v]
    if differs:  # audited as if it had trained as the audit does, the numbers would describe another update
        raise UserError(f"--checkpoint {str(run_dir)!r}: the run trained with {', '.join(differs)}, which the audit "
                        "cannot reproduce (it samples K&K puzzles scored by the paper's rule, with GRPO advantages and "
                        "Lopti by eta, low first): audit its final_model/ with --model instead (the audit's own batch "
                        "and optimizer)")  # fmt: skip
    # The architecture and tokenizer come from the run's starting model, or from its final model if that moved.
    base = Path(run_cfg.model) if Path(run_cfg.model).is_dir() else run_dir / FINAL_MODEL_DIR
    if not base.is_dir():
        raise UserError(f"--checkpoint {str(run_dir)!r}: its starting model {run_cfg.model!r} is gone and the run "
                         f"has no {FINAL_MODEL_DIR}/ to take the architecture from")  # fmt: skip
    model, tokenizer, style = load_model(base, device)
    model.load_state_dict(ckpt["model"])
    return model, tokenizer, style, run_cfg, ckpt


def run_audit(args: argparse.Namespace, out: Path) -> dict:
    """Everything but the argument handling: returns the result dict (also written to ``out``)."""
    device = resolve_device(args.device)
    defaults, optimizer_states, batch_step, run_seed = dict(DEFAULTS), None, 0, args.seed
    run_optimizer = {}  # the run's optimizer settings (checkpoint); a fresh audit's TrainConfig defaults otherwise
    if args.checkpoint:
        model, tokenizer, style, run_cfg, ckpt = load_checkpointed_run(args.checkpoint, device)
        model_path = run_cfg.model
        defaults.update(
            prompts=run_cfg.prompts_per_step, n_samples=run_cfg.n_samples, temperature=run_cfg.temperature,
            people=run_cfg.people, eta=run_cfg.eta or DEFAULTS["eta"], max_new_tokens=run_cfg.max_new_tokens,
            lr=run_cfg.lr,
        )  # fmt: skip
        style = style if args.prompt_style != "auto" or run_cfg.prompt_style == "auto" else run_cfg.prompt_style
        # The batch the run would sample next, and the state its optimizer(s) have now.
        optimizer_states, batch_step, run_seed = checkpoint_optimizer_states(ckpt), ckpt["step"], run_cfg.seed
        run_optimizer = {k: getattr(run_cfg, k) for k in ("optimizer", "momentum", "lopti_moments", "lopti_lr_scale")}
        weight_decay = run_cfg.weight_decay
    else:
        model_path = args.model
        if model_path is None:
            model_path = str(out / "warmup_model")
            print(f"audit: no --model, building and warming up the demo model into {model_path}")
            build_warm_model(model_path, args.seed, args.warmup_steps, args.warmup_target, device=device,
                             progress=False)  # fmt: skip
        model, tokenizer, style = load_model(model_path, device)
        weight_decay = 0.0
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if isinstance(args.people, str):
        args.people = parse_people(args.people)
    args.optimizer = args.optimizer or ("checkpoint" if args.checkpoint else "fresh-adamw")
    style = resolve_prompt_style(args.prompt_style, tokenizer, style)
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (20 if style == "compact" else 512)
    people = args.people
    cfg = TrainConfig(
        model=str(model_path), out=str(out), prompts_per_step=args.prompts, n_samples=args.n_samples,
        max_new_tokens=max_new, temperature=args.temperature, people=people, prompt_style=style, lr=args.lr,
        weight_decay=weight_decay, eta=args.eta, kl_coef=0.0, seed=args.seed, device=str(device),
        loss_backend=args.loss_backend, mini_batch_size=args.prompts * args.n_samples, progress=False, **run_optimizer,
    )  # fmt: skip
    methods = method_list(args.methods)
    if args.optimizer == "checkpoint" and cfg.lopti_moments == "per-phase":
        plain = [m for m in methods if not METHODS[m][1]]
        if plain:
            raise UserError(f"--checkpoint {args.checkpoint}: the run kept one optimizer state per Lopti phase "
                            f"(--lopti-moments per-phase), which a method without Lopti ({', '.join(plain)}) cannot "
                            "step with: pass --methods lopti,ar+lopti, or --optimizer fresh-adamw or sgd")  # fmt: skip

    torch.manual_seed(args.seed)
    records = train_puzzles(run_seed, batch_step, args.prompts, people)
    prompts = [prompt_for(r, style, tokenizer) for r in records]
    exp = make_experience(model, None, tokenizer, records, prompts, cfg)
    rows = exp.rollout.action_mask
    old_log_probs = exp.old_log_probs[rows]
    advantages = exp.advantages[rows]
    edges = bin_edges(old_log_probs, args.bins)
    bins = bin_index(old_log_probs, edges)
    carries = advantages != 0  # tokens of groups whose rewards all tie have no gradient at all

    grad = logit_grad_norms(model, exp, cfg)
    result = {
        "model": str(model_path),
        "bins": args.bins,
        "bin_edges": edges,
        "tokens": int(rows.sum()),
        "token_count_by_quartile": [int((bins == k).sum()) for k in range(4)],
        "positive_count_by_quartile": [int(((bins == k) & (advantages > 0)).sum()) for k in range(4)],
        "nonzero_advantage_count_by_quartile": [int(((bins == k) & carries).sum()) for k in range(4)],
        "grad_norm_by_quartile": per_bin_mean(grad, bins, carries),
        "param_grad_norm_by_quartile": None,
    }
    if args.param_grad_tokens > 0:
        picked = sample_per_bin(bins, carries, args.param_grad_tokens, args.seed)
        norms = param_grad_norms(model, exp, cfg, picked.to(bins.device))
        result["param_grad_norm_by_quartile"] = per_bin_mean(norms, bins[picked.to(bins.device)].cpu())
        result["param_grad_tokens_by_quartile"] = [int((bins[picked] == k).sum()) for k in range(4)]
    fractions, _ = correct_direction(model, exp, cfg, bins, methods, args.optimizer, optimizer_states)
    result["correct_direction_by_quartile"] = fractions
    result["batch"] = {
        "reward": float(exp.rewards.mean()),
        "accuracy": float(exp.correct.float().mean()),
        "responses": len(exp.rollout),
    }
    result["settings"] = {
        k: getattr(args, k)
        for k in ("prompts", "n_samples", "temperature", "optimizer", "lr", "eta", "seed", "param_grad_tokens")
    } | {"max_new_tokens": max_new, "people": people, "prompt_style": style, "alpha_ar": METHODS["ar"][0]}
    if args.checkpoint:
        result["checkpoint"] = {"run_dir": str(args.checkpoint), "step": batch_step, "run_seed": run_seed,
                                **run_optimizer}  # fmt: skip
    return result


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_transformers()
    for name, least in (("prompts", 1), ("n_samples", 2), ("max_new_tokens", 1), ("threads", 0)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            raise UserError(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    if args.temperature is not None:  # before a model is built: the loss's own check (float32 holds 1 / T)
        try:
            check_temperature(args.temperature)
        except ValueError as e:
            raise UserError(f"--{e}") from None
    if args.checkpoint and args.model:
        raise UserError("give --model or --checkpoint, not both")
    if args.optimizer == "checkpoint" and not args.checkpoint:
        raise UserError("--optimizer checkpoint needs --checkpoint RUN_DIR (a `train` run directory)")
    if args.param_grad_tokens < 0:
        raise UserError("--param-grad-tokens must be >= 0")
    if args.model is None and args.checkpoint is None:  # the demo model is warmed up first: demo's checks
        check_warmup_flags(args.warmup_steps, args.warmup_target, args.seed)
    elif not abs(args.seed) < SEED_LIMIT:  # before a model is loaded (TrainConfig checks it after)
        raise UserError(f"--seed must be an integer with |seed| < 2**40, got {args.seed}")
    if args.people is not None:
        args.people = parse_people(args.people)  # before a model is built or loaded
    method_list(args.methods)  # checked before a model is built or loaded
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or time.strftime("runs/audit-%Y%m%d-%H%M%S"))
    inputs = [("--model", args.model), ("--checkpoint", getattr(args, "checkpoint", None))]
    out = check_run_dir(out, resume=False, overwrite=args.overwrite, names=AUDIT_OUTPUTS, can_resume=False,
                        inputs=inputs)  # fmt: skip
    try:
        result = run_audit(args, out)
    except ConfigError as e:  # the update's settings come from audit's flags, which carry the field's name
        raise UserError("--" + e.field.replace("_", "-") + str(e)[len(e.field) :]) from None
    write_json(result, out / "audit.json")
    plot(result, out / "audit.png")
    print(format_table(result))
    print(f"\naudit: {result['tokens']} response tokens; wrote {out / 'audit.json'} and {out / 'audit.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("openrlhf-lopti audit", main, sys.argv[1:]))
