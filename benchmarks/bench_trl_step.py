"""What a TRL user gains: TRL's own ``GRPOTrainer`` against ``LoptiGRPOTrainer`` (AR off / AR / AR+Lopti, logits path
and fused lm_head) training one batch, side by side in one run, at Qwen2.5-0.5B's shapes on CPU in fp32.

Each variant is a real trainer (``trl.GRPOTrainer`` or ours) running ``train()`` on one model (a random
``Qwen2ForCausalLM`` of ``bench_real_shape.SHAPES``, built once, no download) and the same batch: TRL's own
``rollout_func`` hook returns one fixed synthetic generation batch (``--responses`` responses of ``--prompt-tokens`` +
``--response-tokens`` random ids, no EOS, one GRPO group) at every step, so generation costs nothing and every
variant trains the same tokens; the reward is a fixed function of the completion's text with spread in the group.
Everything else of the step is the trainer's: TRL's scoring (our trainer always computes ``old_per_token_logps``:
one extra no-grad forward in TRL's on-policy case, where TRL skips it), the loss, backward, the optimizer step.

A batch's update is one optimizer step without Lopti and a round of two with it (low phase, then high phase;
``lopti_quantile=--low-share`` puts that share of the tokens in the low phase, as a random model's probabilities
are all about 1/V and would put every token below eta = 0.5). Per batch, from a callback around every optimizer
step (``on_step_begin`` .. ``on_step_end``, which covers TRL's ``_prepare_inputs`` too): wall and process-CPU
seconds, and the peak RSS growth (``bench_train_step.StepMemory``: ``clear_refs`` / ``VmHWM``) over the RSS before
it. The first ``--warmup`` batches of each variant are not counted.

The optimizer is SGD (``optim="sgd"``, lr 1e-7, the weights barely move): AdamW's two fp32 moments of a 0.5B model are
3.7 GiB more RSS for every variant alike, beyond what this shared machine's budget allows a benchmark process; its
step time is the same for every variant. TRL's defaults are kept otherwise (``loss_type="dapo"``, ``beta=0``: no
reference model, gradient checkpointing on) except ``bf16=False`` (fp32: CPU bf16 matmuls are slow).

    python -m benchmarks.bench_trl_step --out benchmarks/results/trl_step          # Qwen2.5-0.5B shapes, niced
    python -m benchmarks.bench_trl_step --shape tiny --out /tmp/trl_step           # seconds: a smoke test

Writes ``trl_step.json`` (settings, machine, every batch's record, medians, ratios) and ``trl_step.md`` into ``--out``.
"""

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):  # run as a file: make `benchmarks` and `openrlhf_lopti` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_real_shape import SHAPES, _rss_mib, build_model  # noqa: E402
from benchmarks.bench_train_step import StepMemory, _csv, _fmt, _malloc_trim, machine, spread  # noqa: E402
from openrlhf_lopti.errors import ArgumentParser, UserError, run_command  # noqa: E402
from openrlhf_lopti.runs import prepare_out_dir  # noqa: E402

OUTPUTS = ("trl_step.json", "trl_step.md")
# name -> (trainer, loss path, method, our config's options); "trl" is TRL's own GRPOTrainer and GRPOConfig
VARIANTS = {
    "trl": ("TRL GRPOTrainer", "TRL's loss (logits)", "grpo", None),
    "grpo_logits": ("LoptiGRPOTrainer", "logits path", "grpo", {}),
    "ar_logits": ("LoptiGRPOTrainer", "logits path", "ar", {"ar": True}),
    "ar+lopti_logits": ("LoptiGRPOTrainer", "logits path", "ar+lopti", {"ar": True, "lopti": True}),
    "grpo_fused": ("LoptiGRPOTrainer", "fused lm_head", "grpo", {"fused_lm_head": True}),
    "ar_fused": ("LoptiGRPOTrainer", "fused lm_head", "ar", {"ar": True, "fused_lm_head": True}),
    "ar+lopti_fused": ("LoptiGRPOTrainer", "fused lm_head", "ar+lopti",
                       {"ar": True, "lopti": True, "fused_lm_head": True}),
}  # fmt: skip
BASELINE = "trl"


# ---------------------------------------------------------------------------------------------- the batch
def synthetic_batch(tokenizer, responses: int, prompt_tokens: int, response_tokens: int, seed: int) -> dict:
    """What ``rollout_func`` returns: ``prompt_ids`` / ``completion_ids`` (lists of token ids, drawn from the
    tokenizer's ordinary ids, so no EOS ends a completion early) and ``logprobs`` (unused without vLLM)."""
    import torch

    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    g = torch.Generator().manual_seed(seed)
    pick = lambda n: ordinary[torch.randint(len(ordinary), (n,), generator=g)].tolist()  # noqa: E731
    prompts = pick(prompt_tokens)  # one prompt, one GRPO group
    return {
        "prompt_ids": [list(prompts) for _ in range(responses)],
        "completion_ids": [pick(response_tokens) for _ in range(responses)],
        "logprobs": [[-1.0] * response_tokens for _ in range(responses)],
    }


def reward_of_text(completions: list, **kwargs) -> list:
    """A fixed function of the completion's text with spread inside the group (so the advantages are not zero)."""
    return [float(sum(map(ord, text)) % 7) for text in completions]


# ---------------------------------------------------------------------------------------------- the clock
def step_clock(records: list, device):
    """A ``TrainerCallback`` appending ``{"step", "wall_s", "cpu_s", "peak_mib", "rss_before_mib"}`` to ``records``
    per optimizer step (``peak_mib``: the window's peak RSS, absolute)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            gc.collect()
            _malloc_trim()
            self.rss = _rss_mib()
            self.memory = StepMemory(device).__enter__()
            self.wall, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
            self.memory.__exit__(None, None, None)
            records.append({"step": state.global_step, "wall_s": wall, "cpu_s": cpu, "rss_before_mib": self.rss,
                            "peak_mib": self.rss + self.memory.growth / 2**20})  # fmt: skip

    return StepClock()


# ---------------------------------------------------------------------------------------------- one variant
def run_variant(name: str, model, tokenizer, batch: dict, args, work: str, log: Callable[[str], None]) -> list:
    """Train ``--warmup + --repeats`` batches with variant ``name`` (trainer files under ``work``, saved nothing);
    returns one record per batch."""
    import torch
    from datasets import Dataset

    trainer_name, _, method, options = VARIANTS[name]
    lopti = bool(options and options.get("lopti"))
    steps_per_batch = 2 if lopti else 1
    batches = args.warmup + args.repeats
    settings = dict(
        output_dir=os.path.join(work, name), use_cpu=True, seed=args.seed, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, bf16=False, optim="sgd", learning_rate=1e-7,
        lr_scheduler_type="constant", max_grad_norm=1.0, per_device_train_batch_size=args.micro_batch_size,
        num_generations=args.responses, steps_per_generation=args.responses // args.micro_batch_size,
        gradient_accumulation_steps=args.responses // args.micro_batch_size,
        max_completion_length=args.response_tokens, max_steps=batches * steps_per_batch,
        gradient_checkpointing=args.gradient_checkpointing,
    )  # fmt: skip
    if options is None:
        from trl import GRPOConfig, GRPOTrainer

        trainer_cls, config = GRPOTrainer, GRPOConfig(**settings)
    else:
        from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer

        ours = {"ar_alpha": args.ar_alpha if options.get("ar") else 0.0,
                "fused_lm_head": bool(options.get("fused_lm_head")),
                "lopti_quantile": args.low_share if lopti else None}
        trainer_cls, config = LoptiGRPOTrainer, LoptiGRPOConfig(**settings, **ours)
    dataset = Dataset.from_list([{"prompt": "x"}] * (batches * args.responses))
    steps: list = []
    trainer = trainer_cls(model=model, reward_funcs=reward_of_text, args=config, train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=lambda prompts, trainer: batch,
                          callbacks=[step_clock(steps, torch.device("cpu"))])  # fmt: skip
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # every step's metrics on stdout (disable_tqdm's printer): ours is enough
    from openrlhf_lopti.ops import backends_ran

    before = backends_ran()
    trainer.train()
    after = backends_ran()
    ran = sorted(name for name in after if after[name] > before.get(name, 0))  # our loss head's backends, if it ran
    history = trainer.state.log_history
    del trainer
    gc.collect()
    if len(steps) != batches * steps_per_batch:
        raise RuntimeError(f"{name}: {len(steps)} optimizer steps timed, expected {batches * steps_per_batch}")
    records = []
    for i in range(batches):
        window = steps[i * steps_per_batch : (i + 1) * steps_per_batch]
        record = {
            "variant": name, "trainer": trainer_name, "method": method, "batch": i, "counted": i >= args.warmup,
            "optimizer_steps": len(window), "wall_s": sum(s["wall_s"] for s in window),
            "cpu_s": sum(s["cpu_s"] for s in window), "rss_before_mib": window[0]["rss_before_mib"],
            "peak_growth_mib": max(s["peak_mib"] for s in window) - window[0]["rss_before_mib"],
            "load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "loss_backend": ran or None,
        }  # fmt: skip
        if lopti:  # the round's phases: tokens per phase, from the trainer's own metrics
            logged = [h for h in history if "lopti/low/tokens" in h]
            record["low_tokens"] = logged[i]["lopti/low/tokens"] if i < len(logged) else None
            record["high_tokens"] = logged[i]["lopti/high/tokens"] if i < len(logged) else None
        records.append(record)
        log(f"{name:<16} batch {i + 1}{'' if record['counted'] else ' (warm-up)'}: {record['optimizer_steps']} step(s) "
            f"{record['wall_s']:.2f} s (CPU {record['cpu_s']:.2f}), peak +{record['peak_growth_mib']:.0f} MiB over "
            f"{record['rss_before_mib']:.0f} MiB; load {record['load_1m']}")  # fmt: skip
    return records


# ---------------------------------------------------------------------------------------------- summary
FIELDS = ("wall_s", "cpu_s", "peak_growth_mib", "rss_before_mib", "optimizer_steps")


def summarize(records: list) -> dict:
    """``{variant: {field: spread}}`` over the counted records, and each variant's ratios to TRL's
    (``cpu_ratio``, ``wall_ratio``, ``peak_ratio``: medians over medians)."""
    out = {}
    for name in VARIANTS:
        rows = [r for r in records if r["variant"] == name and r["counted"]]
        if rows:
            out[name] = {f: spread([r.get(f) for r in rows]) for f in FIELDS}
    base = out.get(BASELINE)
    for name, stats in out.items():
        if base:
            for field, key in (("cpu_s", "cpu_ratio"), ("wall_s", "wall_ratio"), ("peak_growth_mib", "peak_ratio")):
                stats[key] = stats[field]["median"] / base[field]["median"] if base[field]["median"] else None
    return out


def markdown(report: dict) -> str:
    s, m = report["settings"], report["machine"]
    lines = [
        f"Shape {s['shape']} ({report['parameters'] / 1e6:.1f} M parameters), fp32 on CPU, one GRPO group of "
        f"{s['responses']} responses x ({s['prompt_tokens']} prompt + {s['response_tokens']} response tokens), "
        f"micro-batch {s['micro_batch_size']} (one optimizer step per batch, two with Lopti), SGD, gradient "
        f"checkpointing {'on' if s['gradient_checkpointing'] else 'off'}, AR alpha {s['ar_alpha']}, Lopti low share "
        f"{s['low_share']}; {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads); load "
        f"average {report['load']['before']:.1f} -> {report['load']['after']:.1f}; {s['warmup']} warm-up + "
        f"{s['repeats']} counted batches per variant; took {report['wall_s']:.0f} s. Medians (min-max).",
        "",
        "| trainer | loss path | method | opt. steps | batch CPU s | batch wall s | peak growth GiB | CPU vs TRL "
        "| wall vs TRL | peak vs TRL |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        trainer, path, method, _ = VARIANTS[name]
        growth = {k: (v / 1024 if k != "n" and v is not None else v) for k, v in r["peak_growth_mib"].items()}
        ratio = lambda key: f"{r[key]:.2f}x" if r.get(key) is not None else "n/a"  # noqa: E731
        lines.append(f"| {trainer} | {path} | {method} | {_fmt(r['optimizer_steps'], 0)} | {_fmt(r['cpu_s'])} "
                     f"| {_fmt(r['wall_s'])} | {_fmt(growth)} | {ratio('cpu_ratio')} | {ratio('wall_ratio')} "
                     f"| {ratio('peak_ratio')} |")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- command line
def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="bench_trl_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/trl_step", help="folder for trl_step.json/.md")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs already in --out (only those)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen2.5-0.5b", help="model shapes (tiny: tests)")
    p.add_argument("--variants", type=_csv(tuple(VARIANTS)), default=list(VARIANTS), help="default all seven")
    p.add_argument("--responses", type=int, default=8, help="responses in the batch, one GRPO group (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=8, help="prompt tokens per response (default 8)")
    p.add_argument("--response-tokens", type=int, default=32, help="response tokens per response (default 32)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="responses per forward (default 4)")
    p.add_argument("--ar-alpha", type=float, default=0.3, help="AR's alpha where AR is on (default 0.3)")
    p.add_argument("--low-share", type=float, default=0.2, help="Lopti's lopti_quantile (default 0.2)")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                   help="turn off TRL's default gradient checkpointing")
    p.add_argument("--warmup", type=int, default=1, help="uncounted batches per variant first (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="counted batches per variant (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    return p


def resolve_args(argv: Optional[list]):
    args = build_parser().parse_args(argv)
    for name in ("responses", "prompt_tokens", "response_tokens", "micro_batch_size", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.threads < 0:
        raise UserError("--warmup and --threads must be >= 0")
    if args.responses < 2 or args.responses % args.micro_batch_size:
        raise UserError(f"--responses must be >= 2 and a multiple of --micro-batch-size {args.micro_batch_size}, "
                        f"got {args.responses}")  # fmt: skip
    if not 0 < args.low_share < 1:
        raise UserError(f"--low-share must be in (0, 1) so that both Lopti phases hold tokens, got {args.low_share}")
    if not 0 <= args.ar_alpha <= 1:
        raise UserError(f"--ar-alpha must be in [0, 1], got {args.ar_alpha}")
    return args


def main(argv: Optional[list] = None, log: Callable[[str], None] = None) -> int:
    """Run the benchmark; prints the table and writes ``trl_step.json/.md`` into ``--out``."""
    args = resolve_args(argv)
    out = prepare_out_dir(args.out, OUTPUTS, overwrite=args.overwrite)
    import torch

    from openrlhf_lopti.demo.tiny_model import build_word_tokenizer

    started = time.perf_counter()
    log = log or (lambda message: print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True))
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" notice, once per trainer
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    info = machine()
    tokenizer = build_word_tokenizer()
    model = build_model(args.shape, args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    log(f"built {args.shape}: {parameters / 1e6:.1f} M parameters, fp32, RSS {_rss_mib():.0f} MiB")
    batch = synthetic_batch(tokenizer, args.responses, args.prompt_tokens, args.response_tokens, args.seed)
    records = []
    work = tempfile.TemporaryDirectory(prefix="bench_trl_step_")  # the trainers' output_dir: nothing is kept
    for name in args.variants:
        records += run_variant(name, model, tokenizer, batch, args, work.name, log)
        report = {
            "benchmark": "bench_trl_step", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "complete": name == args.variants[-1], "machine": info, "parameters": parameters,
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")},
            "load": {"before": load_before, "after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
            "results": summarize(records), "records": records, "wall_s": time.perf_counter() - started,
        }  # fmt: skip
        table = markdown(report)  # after every variant: a run stopped early keeps what it measured
        (out / "trl_step.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (out / "trl_step.md").write_text(table + "\n", encoding="utf-8")
    work.cleanup()
    print(table)
    print(f"wrote {out / 'trl_step.json'}, trl_step.md")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("bench_trl_step", main, sys.argv[1:]))
