"""Knights & Knaves with TRL: GRPO + AR + Lopti, the paper's best K&K setting (alpha = 0.3, eta = 0.5).

On GPUs (after ``python -m openrlhf_lopti data kk --out data/kk``), one process per GPU:

    accelerate launch --num_processes 8 examples/trl/train_kk_grpo_ar_lopti.py --model Qwen/Qwen2.5-3B-Instruct \
        --data data/kk/train.jsonl --output-dir runs/trl-kk-ar-lopti [--vllm]

A rehearsal on CPU with a tiny Llama briefly warmed up on K&K's answer format (no download), one process, or two
processes over gloo (``torchrun``; ``accelerate launch --cpu`` starts one process whatever ``--num_processes`` says):

    python examples/trl/train_kk_grpo_ar_lopti.py --cpu --output-dir runs/trl-kk-cpu
    torchrun --nproc_per_node 2 examples/trl/train_kk_grpo_ar_lopti.py --cpu --output-dir runs/trl-kk-cpu-2

Paper settings (PAPER_NOTES.md section 5): temperature 0.7, 8 responses per prompt, 64 prompts (512 responses)
per generation, updates of 256 responses (2 optimizer steps per generation and Lopti phase), AdamW lr 1e-6,
k3 KL coefficient 0.001, clip 0.2 / 0.24, token-mean loss over the batch (TRL's ``dapo``), 4096 response tokens.
The batch shape assumes 8 processes (``--per-device-batch 4 --grad-accum 8``): 4 x 8 x 8 = 256 responses per
optimizer step; change the two for another count so that their product times the processes stays 256.
Files shared by the processes (the CPU rehearsal's starting model, the final model) are written by the main
process only.
"""

import argparse
import math
import os
import re
import sys
from pathlib import Path

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command

PROG = "train_kk_grpo_ar_lopti.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen/Qwen2.5-3B-Instruct", help="model name or path")
    p.add_argument("--data", default=None, help="train.jsonl of `python -m openrlhf_lopti data kk` (prompt, label)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --output-dir that holds files already (its initial/, checkpoints and model "
                   "are replaced); without it such a folder is refused")  # fmt: skip
    p.add_argument("--ar-alpha", type=float, default=0.3, help="AR alpha (0 = off; paper K&K 0.3)")
    p.add_argument("--lopti-eta", type=float, default=0.5, help="Lopti eta (paper 0.5); a negative value = off")
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (-1: --epochs over the data)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--vllm", action="store_true", help="generate with vLLM (colocated), TRL's use_vllm")
    p.add_argument("--fused-lm-head", action="store_true", help="fused_linear_policy_loss: no [N, V] logits")
    p.add_argument("--cpu", action="store_true", help="rehearse on CPU: tiny warmed-up Llama, generated puzzles")
    p.add_argument("--warmup-steps", type=int, default=30, help="--cpu: supervised warm-up steps of the tiny Llama")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def check_args(args) -> None:
    """Refuse, before any process writes anything, what the run would get wrong (every process checks the same)."""
    from openrlhf_lopti.runs import check_can_write

    if not math.isfinite(args.lopti_eta):  # NaN >= 0 is False: it turned Lopti off without a word
        raise UserError(f"--lopti-eta {args.lopti_eta}: expected a number in (0, 1] (a negative value turns Lopti off)")
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out}: is a file; --output-dir takes a folder")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        shown = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        raise UserError(f"--output-dir {out} holds files already ({shown}): an earlier run's initial/ and model "
                        "would be replaced; pass --overwrite to write there anyway, or choose another --output-dir")  # fmt: skip
    check_can_write(out, "--output-dir")


def cpu_settings(args) -> dict:
    """The CPU rehearsal's TRL settings."""
    return dict(
        use_cpu=True, bf16=False, per_device_train_batch_size=8, num_generations=8, gradient_accumulation_steps=1,
        steps_per_generation=2, max_completion_length=24, max_steps=args.max_steps if args.max_steps > 0 else 4,
        learning_rate=1e-3, logging_steps=1, use_vllm=args.vllm, vllm_mode="colocate",
        # the CPU colocate path (docs/TRL.md): an fp32 engine, whose sampled log-probs are the trainer's
        vllm_dtype="float32" if args.vllm else "auto",
    )  # fmt: skip


def cpu_setup(args):
    """A tiny word-level Llama, teacher-forced for ``--warmup-steps`` on K&K answers (the local demo's warm-up) so
    that its rewards spread and its token probabilities fall on both sides of eta; compact K&K prompts."""
    from accelerate import PartialState
    from datasets import Dataset

    from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
    from openrlhf_lopti.demo.warmup import supervised_warmup
    from openrlhf_lopti.local.task import compact_prompt, puzzles

    tok = build_word_tokenizer()
    model = os.path.join(args.output_dir, "initial")  # a path: TRL loads the KL reference model from it
    state = PartialState(cpu=True)  # the launcher's processes (one without a launcher), over gloo
    if state.is_main_process:  # one writer; the others wait for it below
        tiny = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=2, seed=args.seed)
        supervised_warmup(tiny, tok, args.warmup_steps, batch_size=16, seed=args.seed, progress=False)
        tiny.save_pretrained(model)
        tok.save_pretrained(model)
    state.wait_for_everyone()
    records = puzzles(0, 0, 64, [2])
    data = Dataset.from_list([{"prompt": compact_prompt(r), "label": r["solution_text_format"]} for r in records])
    return model, tok, data


def gpu_settings(args) -> dict:
    if not args.data:
        raise UserError("--data is required without --cpu (python -m openrlhf_lopti data kk --out data/kk)")
    return dict(
        bf16=True, per_device_train_batch_size=args.per_device_batch, gradient_accumulation_steps=args.grad_accum,
        steps_per_generation=2 * args.grad_accum, num_generations=8, max_completion_length=4096,
        max_steps=args.max_steps, num_train_epochs=args.epochs, learning_rate=1e-6, gradient_checkpointing=True,
        use_vllm=args.vllm, vllm_mode="colocate", logging_steps=1, save_steps=50,
    )  # fmt: skip


def gpu_setup(args):
    from datasets import load_dataset

    data = load_dataset("json", data_files=args.data, split="train").select_columns(["prompt", "label"])
    return args.model, None, data


# The config's fields this example sets from its flags: its refusals name them, the user typed the flags.
FLAG_OF = {"ar_alpha": "--ar-alpha", "lopti_eta": "--lopti-eta", "max_steps": "--max-steps",
           "gradient_accumulation_steps": "--grad-accum", "per_device_train_batch_size": "--per-device-batch",
           "fused_lm_head": "--fused-lm-head"}  # fmt: skip


def build_config(args, settings: dict):
    """The run's ``LoptiGRPOConfig``; its refusals (``ValueError``) as one line naming the flags."""
    from openrlhf_lopti.trl import LoptiGRPOConfig

    try:
        return LoptiGRPOConfig(
            output_dir=args.output_dir,
            seed=args.seed,
            temperature=0.7,
            beta=0.001,
            use_bias_correction_kl=False,  # the paper's k3 KL loss (TRL's default multiplies it by the ratio)
            epsilon=0.2,
            epsilon_high=0.24,
            loss_type="dapo",
            optim="adamw_torch",
            report_to=os.environ.get("REPORT_TO", "none"),
            ar_alpha=args.ar_alpha,  # the two options a TRL user adds
            lopti_eta=args.lopti_eta if args.lopti_eta >= 0 else None,
            fused_lm_head=args.fused_lm_head,
            **settings,
        )
    except ValueError as e:
        text = re.sub(r"(?<![-\w])(" + "|".join(FLAG_OF) + r")(?!\w)", lambda m: FLAG_OF[m.group(1)], str(e))
        raise UserError(text) from None


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    from openrlhf_lopti.trl import LoptiGRPOTrainer, kk_reward

    if args.cpu:
        from accelerate import PartialState

        PartialState(cpu=True)  # the launcher's processes over gloo, before the config sets up its own state
    # The config is checked before anything is written (the CPU rehearsal's initial/ model, minutes of warm-up).
    config = build_config(args, cpu_settings(args) if args.cpu else gpu_settings(args))
    model, tok, data = cpu_setup(args) if args.cpu else gpu_setup(args)
    trainer = LoptiGRPOTrainer(
        model=model, reward_funcs=[kk_reward], args=config, train_dataset=data, processing_class=tok
    )
    accelerator = trainer.accelerator
    if accelerator.is_main_process:  # says how many processes the launcher really started
        print(f"training on {accelerator.num_processes} process(es), backend {accelerator.state.backend}", flush=True)
    trainer.train()
    trainer.save_model(args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(PROG, main, sys.argv[1:]))
