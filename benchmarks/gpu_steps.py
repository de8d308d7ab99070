"""The Python steps of ``benchmarks/gpu_session.sh`` (one GPU session, one report): each prints a few lines.

    python -m benchmarks.gpu_steps probe                      # versions, device, what is importable
    python -m benchmarks.gpu_steps loss-head --json PATH      # bench_policy_loss at N=8192, V=151936, bf16
    python -m benchmarks.gpu_steps trl --steps 4              # LoptiGRPOTrainer steps on the GPU, bf16
    python -m benchmarks.gpu_steps local --steps 3            # local-trainer steps on the GPU, bf16
    python -m benchmarks.gpu_steps trl-shapes --json PATH     # TRL's GRPOTrainer vs ours at Qwen2.5-0.5B's shapes

``loss-head`` runs ``benchmarks/bench_policy_loss.py`` with every backend that imports here: our torch reference
and Triton kernel always, OpenRLHF 0.11.2's eager loss when ``openrlhf.models.loss`` imports, Liger-Kernel's GRPO
loss when ``liger_kernel`` does. OpenRLHF's loss functions are plain torch, but ``openrlhf.models`` imports
DeepSpeed (and flash-attn) at module top; on an image without DeepSpeed (which has no wheel to carry) a stand-in
module lets that import go through (:func:`deepspeed_stand_in`; any use of it raises), and the report says so.
"""

import argparse
import gc
import importlib.machinery
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a file: make `benchmarks` and `openrlhf_lopti` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def first_error_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def deepspeed_stand_in() -> bool:
    """Register an import-only ``deepspeed`` module when the real one is missing; True when it did. Any attribute
    use raises ``RuntimeError`` (OpenRLHF's loss functions never touch it)."""
    try:
        import deepspeed  # noqa: F401

        return False
    except ImportError:
        pass

    def unavailable(name):
        if name.startswith("__"):  # module machinery (__file__, __version__, ...): absent, as for a namespace
            raise AttributeError(name)
        raise RuntimeError(f"deepspeed.{name}: gpu_steps' import-only stand-in (DeepSpeed is not installed)")

    for name in ("deepspeed", "deepspeed.utils"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__getattr__ = unavailable
        sys.modules[name] = module
    sys.modules["deepspeed"].utils = sys.modules["deepspeed.utils"]
    return True


def flash_attn_stand_ins() -> None:
    """Our import-only flash-attn stand-ins (``openrlhf_lopti/openrlhf/cpu/stubs.py``, a no-op when flash-attn is
    installed), loaded from the file: the package ``openrlhf_lopti.openrlhf`` needs Ray, which the image lacks."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "openrlhf_lopti" / "openrlhf" / "cpu" / "stubs.py"
    spec = importlib.util.spec_from_file_location("_gpu_steps_flash_attn_stubs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install_cpu_stubs()


def openrlhf_loss_status() -> str:
    """"ok", "ok (deepspeed stand-in)" or why OpenRLHF's eager loss cannot be imported."""
    try:
        stand_in = deepspeed_stand_in()
        flash_attn_stand_ins()
        from openrlhf.models.loss import PolicyLoss  # noqa: F401
        from openrlhf.models.utils import compute_approx_kl, log_probs_from_logits  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the report says why
        return "not importable (" + first_error_line(exc) + ")"
    return "ok (deepspeed stand-in)" if stand_in else "ok"


def liger_status() -> str:
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return "not importable (" + first_error_line(exc) + ")"
    return "ok"


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return "-"


def probe(args) -> int:
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), " + ", ".join(
        f"{n} {_version(n)}" for n in ("triton", "transformers", "accelerate", "trl", "datasets", "liger-kernel",
                                        "openrlhf", "peft")))  # fmt: skip
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"device: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
    else:
        print("device: no CUDA device visible")
    print(f"openrlhf eager loss: {openrlhf_loss_status()}; liger-kernel GRPO loss: {liger_status()}")
    return 0


def loss_head(args) -> int:
    from benchmarks.bench_policy_loss import main as bench

    # ours three ways: checks read at once, at the step, and the one-pass head
    backends = ["torch", "triton", "triton-step", "triton-onepass"]
    status = {"openrlhf": openrlhf_loss_status(), "liger": liger_status()}
    for name in ("openrlhf", "liger"):
        if status[name].startswith("ok"):
            backends.insert(0 if name == "openrlhf" else len(backends), name)
        print(f"loss-head: {name}: {status[name]}")
    flags = ["--device", "cuda", "--n", str(args.n), "--v", str(args.v), "--dtype", "bf16", "--backends",
             ",".join(backends), "--json", args.json, "--overwrite", "--repeats", str(args.repeats)]  # fmt: skip
    return bench(flags)


def _timed_callback():
    from transformers import TrainerCallback

    class Times(TrainerCallback):
        def __init__(self):
            self.times, self.logs, self.start = [], [], None

        def on_step_begin(self, args, state, control, **kw):
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    return Times()


def trl_steps(args) -> int:
    """LoptiGRPOTrainer (AR + Lopti, our fused loss) on the GPU in bf16: a tiny random Llama, K&K prompts."""
    import torch
    from datasets import Dataset

    try:  # openrlhf_lopti.demo since the package's re-layering, openrlhf_lopti.local.model before
        from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
    except ImportError:
        from openrlhf_lopti.local.model import build_tiny_llama, build_word_tokenizer
    from openrlhf_lopti.local.task import compact_prompt, puzzles
    from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer, kk_reward

    tok = build_word_tokenizer()
    records = puzzles(0, 0, 16, [2])
    dataset = Dataset.from_list([{"prompt": compact_prompt(r), "label": r["solution_text_format"]} for r in records])
    failures = 0
    for fused_lm_head in (False, True):
        model = build_tiny_llama(tok, hidden_size=args.hidden, num_layers=args.layers, num_heads=8, seed=0)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # peaked logits: token probabilities on both sides of eta = 0.5
        with tempfile.TemporaryDirectory() as tmp:
            # a path, as TRL users pass it: with beta > 0 TRL loads the reference model from the policy's
            # config._name_or_path, which is "" for a model built in memory (the H100 session's first error)
            model_dir = Path(tmp) / "model"
            model.save_pretrained(model_dir)
            tok.save_pretrained(model_dir)
            cfg = LoptiGRPOConfig(
                output_dir=tmp, seed=0, report_to="none", logging_steps=1, save_strategy="no", bf16=True,
                per_device_train_batch_size=8, num_generations=8, max_completion_length=args.max_new_tokens,
                gradient_accumulation_steps=2, steps_per_generation=2, max_steps=args.steps, learning_rate=1e-5,
                beta=0.001, epsilon=0.2, epsilon_high=0.28, ar_alpha=0.3, lopti_eta=0.5, loss_backend="auto",
                fused_lm_head=fused_lm_head, model_init_kwargs={"dtype": torch.bfloat16},
            )  # fmt: skip
            times = _timed_callback()
            label = f"trl LoptiGRPOTrainer ar+lopti, fused_lm_head={fused_lm_head}"
            try:
                trainer = LoptiGRPOTrainer(model=str(model_dir), reward_funcs=[kk_reward], args=cfg, train_dataset=dataset,
                                           processing_class=tok, callbacks=[times])  # fmt: skip
                trainer.train()
            except Exception as exc:  # noqa: BLE001 - the next variant still runs
                failures += 1
                print(f"{label}: FAILED {first_error_line(exc)}")
                continue
            keys = ("loss", "lopti/low_token_frac", "ar/mean_weight", "reward", "kl")
            last = next((log for log in reversed(times.logs) if "loss" in log), {})
            print(f"{label}: {len(times.times)} optimizer steps, step s " + ", ".join(f"{t:.2f}" for t in times.times)
                  + "; last log " + ", ".join(f"{k} {last[k]:.4g}" for k in keys if k in last)
                  + f"; params {next(trainer.model.parameters()).dtype} on {next(trainer.model.parameters()).device}")
    return 1 if failures else 0


QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
                  rope_theta=1e6)  # fmt: skip
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=2048, max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip


def _full_vocab_tokenizer(vocab_size: int):
    """The demo's word tokenizer padded with ``w<i>`` words up to the model's vocabulary, so every id the random
    model samples decodes (no model hub here: the shapes are Qwen2.5-0.5B's, the weights random)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from openrlhf_lopti.demo.tiny_model import build_word_tokenizer

    base = build_word_tokenizer()
    vocab = dict(base.get_vocab())
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    core = Tokenizer(models.WordLevel(vocab, unk_token=base.unk_token))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **{k: getattr(base, k) for k in (
        "unk_token", "pad_token", "eos_token", "bos_token") if getattr(base, k, None)})  # fmt: skip
    tok.chat_template = base.chat_template
    return tok


def trl_shapes(args) -> int:
    """TRL's ``GRPOTrainer`` against ``LoptiGRPOTrainer`` at Qwen2.5-0.5B's shapes (random weights from its config),
    bf16, the same seed and batch: GRPO (TRL's, ours fused, ours fused lm_head), AR + Lopti (fused, fused lm_head,
    TRL's loss path). Per variant: seconds per generation batch (a GRPO step or a Lopti round, after the first),
    peak memory, the memory still held when it started (``start_gib``, after a collection: should be ~0), the
    device and the backend our loss head ran on (``backend_ran``, from ``ops.backends_ran``). Lopti's factor:
    AR + Lopti fused over our GRPO."""
    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from openrlhf_lopti.local.task import compact_prompt, puzzles
    from openrlhf_lopti.ops import backends_ran
    from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer

    shape = TINY if args.shape == "tiny" else QWEN25_05B
    device_cuda = torch.cuda.is_available() and not args.cpu
    tok = _full_vocab_tokenizer(shape["vocab_size"])
    records = puzzles(0, 0, 16, [2])
    dataset = Dataset.from_list([{"prompt": compact_prompt(r)} for r in records])

    def reward(prompts, completions, **kwargs):  # varies between random completions: nonzero advantages
        return [float(len(set(c.split()))) for c in completions]

    # On a GPU the process's first trainer pays CUDA's, cuBLAS's and generate's first-call costs (20 s on the H100,
    # in TRL's row then): a one-round run first, not compared
    warm_ups = [("warm-up: trl GRPOTrainer, one round (not compared)", GRPOTrainer, None)] if device_cuda else []
    variants = warm_ups + [  # (label, trainer class, our options or None for TRL's config)
        ("trl GRPOTrainer grpo", GRPOTrainer, None),
        ("ours grpo (fused)", LoptiGRPOTrainer, dict()),
        ("ours grpo (fused lm_head)", LoptiGRPOTrainer, dict(fused_lm_head=True)),  # TRL 1.16's own head is fused
        ("ours ar+lopti (fused)", LoptiGRPOTrainer, dict(ar_alpha=0.3, lopti_eta=0.5)),
        ("ours ar+lopti (fused lm_head)", LoptiGRPOTrainer, dict(ar_alpha=0.3, lopti_eta=0.5, fused_lm_head=True)),
        ("ours ar+lopti (TRL's loss)", LoptiGRPOTrainer, dict(ar_alpha=0.3, lopti_eta=0.5, fused_loss=False)),
    ]
    rows, failures = [], 0

    def write_json(factor=None):  # after every variant: a step stopped by its time budget keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(dict(shape=args.shape, device="cuda" if device_cuda else "cpu",
                                                       gpu=torch.cuda.get_device_name() if device_cuda else None,
                                                       rows=rows, lopti_factor=factor), indent=2) + "\n")  # fmt: skip

    for label, cls, ours in variants:
        lopti = bool(ours and ours.get("lopti_eta"))
        warm_up = label.startswith("warm-up")
        common = dict(
            output_dir=tempfile.mkdtemp(), seed=0, report_to="none", logging_steps=1, save_strategy="no",
            bf16=device_cuda, use_cpu=not device_cuda, per_device_train_batch_size=args.batch, num_generations=8,
            max_completion_length=args.completion, gradient_accumulation_steps=1, steps_per_generation=1,
            max_steps=1 if warm_up else (2 if lopti else 1) * args.rounds, learning_rate=1e-6, beta=0.0, epsilon=0.2,
            epsilon_high=0.28, loss_type="dapo",
        )  # fmt: skip
        config = GRPOConfig(**common) if ours is None else LoptiGRPOConfig(**common, loss_backend="auto", **ours)
        gc.collect()  # the previous variant's trainer holds reference cycles: free it before this one is measured
        start_gib = None
        if device_cuda:
            torch.cuda.empty_cache()
            start_gib = torch.cuda.memory_allocated() / 2**30  # what is still held (should be ~0): in the row
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
        if device_cuda:
            model = model.to(torch.bfloat16)
        times = _timed_callback()
        before = backends_ran()
        try:
            trainer = cls(model=model, reward_funcs=[reward], args=config, train_dataset=dataset, processing_class=tok,
                          callbacks=[times])  # fmt: skip
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - the next variant still runs
            failures += 1
            print(f"{label}: FAILED {first_error_line(exc)}")
            rows.append(dict(variant=label, status=f"failed: {first_error_line(exc)}"))
            write_json()
            continue
        per_round = [sum(times.times[i : i + (2 if lopti else 1)]) for i in range(0, len(times.times), 2 if lopti else 1)]
        later = per_round[1:] or per_round
        after = backends_ran()
        # our loss head's backends in this variant (none: TRL's own loss ran), and where: no fallback passes unseen
        ran = sorted(name for name in after if after[name] > before.get(name, 0))
        row = dict(variant=label, status="warm-up" if warm_up else "ok", backend_ran=",".join(ran) or "none (TRL's loss)",
                   device=torch.cuda.get_device_name() if device_cuda else "cpu", optimizer_steps=len(times.times),
                   round_s=per_round, round_s_after_first=sum(later) / len(later), start_gib=start_gib,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device_cuda else None)  # fmt: skip
        rows.append(row)
        peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.2f} GiB"
        print(f"{label}: {row['optimizer_steps']} optimizer steps, s per generation batch "
              + ", ".join(f"{t:.2f}" for t in per_round) + f"; peak {peak}; backend {row['backend_ran']}")  # fmt: skip
        write_json()
        del trainer, model
    ok = {r["variant"]: r for r in rows if r["status"] == "ok"}
    grpo, lopti_row = ok.get("ours grpo (fused)"), ok.get("ours ar+lopti (fused)")
    factor = lopti_row["round_s_after_first"] / grpo["round_s_after_first"] if grpo and lopti_row else None
    trl_row = ok.get("trl GRPOTrainer grpo")
    if factor is not None:
        print(f"Lopti's factor (ar+lopti fused / grpo fused, s per generation batch): {factor:.2f}x")
    if trl_row and grpo and device_cuda:
        print(f"peak memory, ours grpo (fused) / TRL's GRPOTrainer: {grpo['peak_gib'] / trl_row['peak_gib']:.2f}")
    write_json(factor)
    return 1 if failures else 0


def local_steps(args) -> int:
    """The local trainer (``LocalTrainer.train_step``) on the GPU in bf16, GRPO and AR+Lopti x both loss paths."""
    import torch

    from benchmarks.bench_train_step import build_bench_model
    from openrlhf_lopti.local.config import TrainConfig, method_settings
    from openrlhf_lopti.local.trainer import LocalTrainer

    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_bench_model(Path(tmp) / "model", args.hidden, args.layers, 8, None, 3.5)
        for fused_lm_head in (False, True):
            for method in ("grpo", "ar+lopti"):
                label = f"local {method}, fused_lm_head={fused_lm_head}"
                try:
                    cfg = TrainConfig(
                        model=str(model_dir), out=str(Path(tmp) / f"run-{method}-{fused_lm_head}"), steps=args.steps,
                        prompts_per_step=8, n_samples=8, max_new_tokens=args.max_new_tokens, mini_batch_size=32,
                        micro_batch_size=16, lr=1e-5, device="cuda", dtype="bfloat16", fused_lm_head=fused_lm_head,
                        progress=False, **method_settings(method),
                    )  # fmt: skip
                    trainer = LocalTrainer(cfg)
                    times, metrics = [], {}
                    for _ in range(args.steps):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        metrics = trainer.train_step()
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                except Exception as exc:  # noqa: BLE001 - the next variant still runs
                    failures += 1
                    print(f"{label}: FAILED {first_error_line(exc)}")
                    continue
                keys = ("loss", "reward", "low_token_fraction", "optimizer_steps", "response_tokens")
                print(f"{label}: step s " + ", ".join(f"{t:.2f}" for t in times) + "; last step "
                      + ", ".join(f"{k} {metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), (int, float)))
                      + f"; peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")  # fmt: skip
                del trainer
                torch.cuda.empty_cache()
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_steps", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    sub.add_parser("probe", help="versions, the device, what is importable")
    s = sub.add_parser("loss-head", help="bench_policy_loss with every backend that imports")
    s.add_argument("--n", type=int, default=8192)
    s.add_argument("--v", type=int, default=151936)
    s.add_argument("--repeats", type=int, default=10)
    s.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpu_loss_head.json"))
    s = sub.add_parser("trl-shapes", help="TRL's GRPOTrainer vs LoptiGRPOTrainer at Qwen2.5-0.5B's shapes")
    s.add_argument("--shape", choices=("qwen2.5-0.5b", "tiny"), default="qwen2.5-0.5b")
    s.add_argument("--batch", type=int, default=16, help="completions per step (per_device_train_batch_size)")
    s.add_argument("--completion", type=int, default=128, help="max completion tokens")
    s.add_argument("--rounds", type=int, default=2, help="generation batches per variant")
    s.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke run of the step, tiny shape)")
    s.add_argument("--json", default=None)
    for name in ("trl", "local"):
        s = sub.add_parser(name, help=f"a few {name} steps on the GPU in bf16")
        s.add_argument("--steps", type=int, default=4 if name == "trl" else 3)
        s.add_argument("--hidden", type=int, default=512)
        s.add_argument("--layers", type=int, default=4)
        s.add_argument("--max-new-tokens", type=int, default=64)
    return p


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.step != "probe" and not getattr(args, "cpu", False):
        import torch

        if not torch.cuda.is_available():
            print(f"gpu_steps {args.step}: no CUDA device visible to torch {torch.__version__}")
            return 2
    steps = {"probe": probe, "loss-head": loss_head, "trl": trl_steps, "local": local_steps, "trl-shapes": trl_shapes}
    return steps[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
