"""The Python steps of ``benchmarks/gpu_session.sh`` (one GPU session, one report): each prints a few lines.

    python -m benchmarks.gpu_steps probe                      # versions, device, what is importable
    python -m benchmarks.gpu_steps loss-head --json PATH      # bench_policy_loss at N=8192, V=151936, bf16
    python -m benchmarks.gpu_steps trl --steps 4              # LoptiGRPOTrainer steps on the GPU, bf16
    python -m benchmarks.gpu_steps local --steps 3            # local-trainer steps on the GPU, bf16

``loss-head`` runs ``benchmarks/bench_policy_loss.py`` with every backend that imports here: our torch reference
and Triton kernel always, OpenRLHF 0.11.2's eager loss when ``openrlhf.models.loss`` imports, Liger-Kernel's GRPO
loss when ``liger_kernel`` does. OpenRLHF's loss functions are plain torch, but ``openrlhf.models`` imports
DeepSpeed (and flash-attn) at module top; on an image without DeepSpeed (which has no wheel to carry) a stand-in
module lets that import go through (:func:`deepspeed_stand_in`; any use of it raises), and the report says so.
"""

import argparse
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

    backends = ["torch", "triton"]
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

            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            import torch

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
    for name in ("trl", "local"):
        s = sub.add_parser(name, help=f"a few {name} steps on the GPU in bf16")
        s.add_argument("--steps", type=int, default=4 if name == "trl" else 3)
        s.add_argument("--hidden", type=int, default=512)
        s.add_argument("--layers", type=int, default=4)
        s.add_argument("--max-new-tokens", type=int, default=64)
    return p


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.step != "probe":
        import torch

        if not torch.cuda.is_available():
            print(f"gpu_steps {args.step}: no CUDA device visible to torch {torch.__version__}")
            return 2
    return {"probe": probe, "loss-head": loss_head, "trl": trl_steps, "local": local_steps}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
