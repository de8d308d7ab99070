"""Lopti's training-time factor at a real decoder : lm_head ratio: one RL step's update of a random model with
Qwen2.5-0.5B's shapes, GRPO / AR / Lopti / AR+Lopti x logits path / fused lm_head, side by side in one run.

Why: ``bench_train_step`` measures a 2-layer, H = 128 decoder, where the loss head is a large share of the update;
Lopti must run the decoder body twice by construction (phase 2 runs on the weights phase 1 updated), so in a real
model, whose body dominates, its factor moves toward the paper's 2.0x. This script measures that factor where the
body : lm_head ratio is a real model's and splits the update into its stages, so the factor can be projected to
the paper's 1.5B / 3B / 7B models (``project``; the assumptions are in its docstring).

What runs: the model is built from a ``transformers`` ``Qwen2Config`` with Qwen2.5-0.5B's published shapes (24
layers, hidden 896, 14 heads / 2 KV heads, intermediate 4864, vocab 151,936, tied embeddings; random weights, no
download), fp32. One batch of experience is synthesised (generation is not timed: it is the same for every
method): ``--responses`` responses of ``--prompt-tokens`` + ``--response-tokens`` random token ids, every response
token trained on, GRPO advantages of random rewards (one group), and old-policy log-probs drawn so that a fraction
``--low-share`` of the tokens, spread uniformly at random over the responses, lies below Lopti's eta = 0.5 (a
random model's own probabilities are all about 1/V, which would put every token in Lopti's low phase);
the reference log-probs are the old ones (the k3 KL term is computed, at 0.001). Each round runs
:func:`openrlhf_lopti.local.update.update_policy` (the local trainer's update, its public API, unchanged) once per
(loss path, method), in an order rotated from round to round, on one model and one AdamW whose state persists (a
steady-state step; lr 1e-7 so the weights barely move). The first ``--warmup`` rounds are not counted.

Per update: wall and process-CPU seconds, Lopti's per-phase wall seconds (``lopti/<phase>/train_s``), and a stage split read
by hooks, without touching the update's code (:class:`StageClocks`): **body forward** (the decoder, final norm
included), **head** (from the decoder's output to the gradient of its last hidden state: lm_head forward, loss,
loss backward, lm_head backward), **body backward** (from there to the gradient of the input embeddings'
output), **optimizer** (AdamW ``step``), and **other** (the rest: the embedding's backward and the tied weight's
gradient accumulation, gradient clipping, ``zero_grad``, phase bookkeeping). Peak memory: the growth of the
process's peak RSS during the update (``bench_train_step.StepMemory``) over the RSS before it (model + AdamW state),
which is also recorded.

    python -m benchmarks.bench_real_shape --out benchmarks/results/real_shape          # Qwen2.5-0.5B shapes
    python -m benchmarks.bench_real_shape --shape tiny --out /tmp/rs                    # seconds: a smoke test
    python -m benchmarks.bench_real_shape --render benchmarks/results/real_shape/real_shape.json   # the tables again

Writes ``real_shape.json`` (settings, machine, every update's record, medians, factors, projection) and
``real_shape.md`` (the tables) into ``--out``.
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):  # run as a file: make `benchmarks` and `openrlhf_lopti` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_train_step import (  # noqa: E402
    LOCAL_LOSS_PATHS,
    LOPTI_PAIRS,
    PAPER_LOPTI_FACTOR,
    StepMemory,
    _csv,
    _fmt,
    machine,
    prepare_out_dir,
    rotated,
    spread,
)
from openrlhf_lopti.errors import ArgumentParser, UserError, run_command  # noqa: E402
from openrlhf_lopti.local.config import METHODS  # noqa: E402

OUTPUTS = ("real_shape.json", "real_shape.md")
LOSS_PATHS = ("logits_kernel", "fused_lm_head", "eager")  # the first two by default
# Qwen2.5 decoders' shapes, from their published config.json (Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct on the
# Hugging Face hub; the base models have the same): hidden, intermediate, layers, heads, KV heads, vocab, tied.
# All use q/k/v biases, RMSNorm, SwiGLU, rope_theta 1e6. "tiny" is for tests only.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True),
}  # fmt: skip
PROJECT_TO = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")
STAGES = ("body_fwd", "head", "body_bwd", "optimizer", "other")


# ---------------------------------------------------------------------------------------------- shapes and FLOPs
def qwen2_config(shape: str):
    """A ``Qwen2Config`` with ``SHAPES[shape]`` and Qwen2.5's other settings (no download)."""
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       hidden_act="silu", use_sliding_window=False, bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip


def parameter_counts(shape: str) -> dict:
    """``{"body", "embedding", "lm_head", "total"}``: parameters of a Qwen2 decoder of ``SHAPES[shape]`` (arithmetic,
    checked against the built model in the tests). ``body`` = the layers + final norm; with tied embeddings the
    lm_head is the embedding and ``total`` counts it once."""
    s = SHAPES[shape]
    h, i, n = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    kv = s["num_key_value_heads"] * (h // s["num_attention_heads"])
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k and v (+biases), o
    layer = attention + 3 * h * i + 2 * h  # + SwiGLU MLP + two RMSNorms
    body = n * layer + h
    embedding = s["vocab_size"] * h
    return {"body": body, "embedding": embedding, "lm_head": embedding,
            "total": body + embedding * (1 if s["tie_word_embeddings"] else 2)}  # fmt: skip


def token_flops(shape: str, context: int) -> dict:
    """Forward FLOPs per token: ``body`` (2 x the layers' matmul weights + attention's scores and values at a causal
    context of ``context`` tokens, i.e. 2 x 2 x layers x hidden x context / 2 on average) and ``head`` (2 x V x H).
    Training (forward + backward) is about 3x both; the fused lm_head's backward recomputes the logits (4x)."""
    s = SHAPES[shape]
    p = parameter_counts(shape)
    attention = 2 * s["num_hidden_layers"] * s["hidden_size"] * context  # QK^T and AV, causal mean context / 2
    return {"body": 2 * p["body"] + attention, "head": 2 * p["lm_head"]}


def project(split: dict, measured_shape: str, context: int, targets=PROJECT_TO) -> dict:
    """Lopti's update factor at other shapes, from the stage split measured at ``measured_shape``.

    ``split``: ``{"grpo": {stage: s}, "lopti": {stage: s}}``, median seconds of the measured shape's GRPO and Lopti
    updates per stage (:data:`STAGES`). Each stage of both methods is scaled to the target by:

    - body forward / backward: the body's forward FLOPs per token (:func:`token_flops`, at the same ``context``);
    - head: the lm_head's FLOPs per token (V x H). This also scales the loss kernel, whose cost grows with V only,
      by H: at a larger H it overstates the head, i.e. understates the factor;
    - optimizer and other: the parameter count (AdamW's step, clipping, ``zero_grad`` and the embedding's gradient
      are per-parameter work), at the same tokens per optimizer step as measured.

    Same batch, same tokens, same per-FLOP speed of body and head matmuls (so same hardware efficiency for both,
    which a GPU need not give: a real run's attention kernels, communication, memory-bound parts and
    rematerialisation are not modelled). Returns ``{target: {"factor", "factor_compute", "body_share",
    "head_share", ...}}``: ``factor`` = Lopti's update / GRPO's update with every stage, ``factor_compute`` = the
    same with body and head only (the limit when an optimizer step covers many more tokens than here).
    """
    base_f, base_p = token_flops(measured_shape, context), parameter_counts(measured_shape)
    out = {}
    for target in targets:
        f, p = token_flops(target, context), parameter_counts(target)
        scale = {"body_fwd": f["body"] / base_f["body"], "body_bwd": f["body"] / base_f["body"],
                 "head": f["head"] / base_f["head"], "optimizer": p["total"] / base_p["total"],
                 "other": p["total"] / base_p["total"]}  # fmt: skip
        scaled = {m: {k: split[m][k] * scale[k] for k in STAGES} for m in ("grpo", "lopti")}
        compute = ("body_fwd", "head", "body_bwd")
        total = {m: sum(scaled[m].values()) for m in scaled}
        total_c = {m: sum(scaled[m][k] for k in compute) for m in scaled}
        out[target] = {
            "factor": total["lopti"] / total["grpo"],
            "factor_compute": total_c["lopti"] / total_c["grpo"],
            "body_share": (scaled["grpo"]["body_fwd"] + scaled["grpo"]["body_bwd"]) / total["grpo"],
            "head_share": scaled["grpo"]["head"] / total["grpo"],
            "body_to_head_flops": f["body"] / f["head"],
            "parameters": p["total"],
            "scale": scale,
        }
    return out


# ---------------------------------------------------------------------------------------------- the model and batch
def build_model(shape: str, seed: int, device: str = "cpu", dtype: str = "float32"):
    """A random ``Qwen2ForCausalLM`` of ``SHAPES[shape]`` in ``dtype``, built on ``device`` (a 3B model's random
    initialisation on a GPU takes seconds, on CPU minutes), in train mode (dropout is 0 in Qwen2)."""
    import torch
    from transformers import Qwen2ForCausalLM

    config = qwen2_config(shape)
    config.dtype = dtype
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(getattr(torch, dtype)).train()


def synthetic_experience(vocab: int, responses: int, prompt_tokens: int, response_tokens: int, low_share: float,
                         eta: float, seed: int, device: str = "cpu"):  # fmt: skip
    """One batch of experience for ``update_policy`` (see the module docstring): random ids, every response token
    trained on, one GRPO group of random rewards, old log-probs with a share ``low_share`` of tokens below ``eta``
    (uniform in [0.05, eta) below, [eta, 1) above; which tokens, uniformly at random), reference = old."""
    import torch

    from openrlhf_lopti.local.advantages import grpo_advantages
    from openrlhf_lopti.local.experience import Experience
    from openrlhf_lopti.local.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(2, vocab, (responses, prompt_tokens + response_tokens), generator=g)
    attention = torch.ones_like(sequences)
    action = torch.ones(responses, response_tokens, dtype=torch.bool)
    low = torch.rand(responses, response_tokens, generator=g) < low_share
    u = torch.rand(responses, response_tokens, generator=g)
    p = torch.where(low, 0.05 + u * (eta - 0.05), eta + u * (1 - eta) * 0.999)
    old = p.log()
    rewards = torch.randn(responses, generator=g)
    if device != "cpu":
        sequences, attention, action, old, rewards = (t.to(device) for t in (sequences, attention, action, old, rewards))
    rollout = Rollout(sequences, attention, action, prompt_tokens, [""] * responses)
    return Experience(rollout, old, old.clone(), grpo_advantages(rewards, responses, action), rewards, None, None)


def update_config(args, method: str, loss_path: str):
    """The ``TrainConfig`` fields ``update_policy`` reads: the benchmark's sizes, bench_train_step's loss settings."""
    from openrlhf_lopti.local.config import TrainConfig, method_settings

    return TrainConfig(
        model="(synthetic)", out="(none)", prompts_per_step=1, n_samples=args.responses,
        max_new_tokens=args.response_tokens, temperature=0.7, lr=1e-7, mini_batch_size=args.mini_batch_size,
        micro_batch_size=args.micro_batch_size, kl_coef=0.001, kl_estimator="k3", eps_low=0.2, eps_high=0.24,
        eta=args.eta, seed=args.seed, device=args.device, dtype=args.dtype, progress=False, **LOCAL_LOSS_PATHS[loss_path],
        **method_settings(method),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- stage clocks
class StageClocks:
    """Wall seconds of an update's stages (:data:`STAGES`), read by hooks on the model and the optimizer.

    Forward hooks on the decoder (``get_decoder()``, which both loss paths call) time the body's forward and put a
    gradient hook on its output; the head's window runs from the decoder's output to that gradient (lm_head and
    loss, forward and backward); the body's backward from there to the gradient of the input embeddings' output
    (a hook put on it in the embedding's forward). The optimizer's step pre/post hooks time AdamW. ``other`` is
    the update's wall time minus the rest. On CPU every op is synchronous, so the stamps are the ops' times.
    """

    def __init__(self, model, optimizer, sync: Callable[[], None] = lambda: None):
        self.model, self.optimizer, self.sync = model, optimizer, sync
        self.seconds = dict.fromkeys(STAGES[:-1], 0.0)
        self._mark: dict = {}

    def _now(self) -> float:
        self.sync()  # on CUDA: the stamp after the queued kernels (the synchronisations cost a little time)
        return time.perf_counter()

    def _add(self, stage: str, since: str) -> None:
        now = self._now()
        if since in self._mark:
            self.seconds[stage] += now - self._mark.pop(since)

    def __enter__(self) -> "StageClocks":
        import torch

        decoder, embed = self.model.get_decoder(), self.model.get_input_embeddings()

        def body_start(module, args, kwargs=None):
            self._mark["fwd"] = self._now()

        def body_end(module, args, output):
            self._add("body_fwd", "fwd")
            hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            if torch.is_grad_enabled() and hidden.requires_grad:
                self._mark["head"] = self._now()
                hidden.register_hook(lambda g: self._hidden_grad())

        def embed_out(module, args, output):
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(lambda g: self._add("body_bwd", "bwd"))

        def opt_start(opt, args, kwargs):
            self._mark["opt"] = self._now()

        def opt_end(opt, args, kwargs):
            self._add("optimizer", "opt")

        self.handles = [
            decoder.register_forward_pre_hook(body_start), decoder.register_forward_hook(body_end),
            embed.register_forward_hook(embed_out), self.optimizer.register_step_pre_hook(opt_start),
            self.optimizer.register_step_post_hook(opt_end),
        ]  # fmt: skip
        return self

    def _hidden_grad(self) -> None:
        self._add("head", "head")
        self._mark["bwd"] = self._now()

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def _rss_mib() -> Optional[float]:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_update(model, optimizer, exp, cfg) -> dict:
    """One ``update_policy`` call under the clocks and the memory window; returns its record."""
    import torch

    from openrlhf_lopti.local.update import update_policy

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    rss = torch.cuda.memory_allocated(device) / 2**20 if cuda else _rss_mib()
    generator = torch.Generator().manual_seed(cfg.seed)
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    with StepMemory(device) as memory, StageClocks(model, optimizer, sync) as clocks:
        metrics = update_policy(model, optimizer, exp, cfg, generator)
        sync()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stages = dict(clocks.seconds)
    stages["other"] = wall - sum(stages.values())
    record = {"train_s": wall, "train_cpu_s": cpu, **{f"{k}_s": v for k, v in stages.items()},
              "compute_s": stages["body_fwd"] + stages["head"] + stages["body_bwd"],
              "optimizer_steps": metrics["optimizer_steps"], "peak_growth_mib": memory.growth / 2**20,
              "rss_before_mib": rss, "loss_backend": metrics["loss_backend"]}  # fmt: skip
    if cfg.lopti:
        record.update(lopti_phase_metrics(metrics))
    return record


def lopti_phase_metrics(metrics: dict) -> dict:
    """``{"train_low_s", "train_high_s", "low_tokens", "high_tokens"}`` from ``update_policy``'s metrics
    ``lopti/<phase>/train_s`` and ``lopti/<phase>/tokens`` (None when absent)."""
    out = {}
    for name in ("low", "high"):
        out[f"train_{name}_s"] = metrics.get(f"lopti/{name}/train_s")
        out[f"{name}_tokens"] = metrics.get(f"lopti/{name}/tokens")
    return out


# ---------------------------------------------------------------------------------------------- summary
RECORD_FIELDS = ("train_s", "train_cpu_s", *(f"{k}_s" for k in STAGES), "compute_s", "train_low_s", "train_high_s", "low_tokens",
                 "high_tokens", "optimizer_steps", "peak_growth_mib", "rss_before_mib")  # fmt: skip


def summarize(records: list) -> dict:
    """``{loss_path: {method: {field: spread}}}`` over the counted records."""
    out: dict = {}
    for r in records:
        out.setdefault(r["loss_path"], {}).setdefault(r["method"], []).append(r)
    return {path: {m: {f: spread([r.get(f) for r in rows]) for f in RECORD_FIELDS} for m, rows in ms.items()}
            for path, ms in out.items()}  # fmt: skip


def factors(records: list) -> dict:
    """``{loss_path: {method: {"train" | "train_cpu" | "compute" | stage: spread}}}``: Lopti's factor, round by round
    (a Lopti method's update over the same method's without Lopti in the same round), for the whole update (wall and
    CPU seconds), its body + head stages ("compute") and each stage."""
    by = {(r["loss_path"], r["method"], r["round"]): r for r in records}
    out: dict = {}
    for (path, method, round_), r in by.items():
        base = by.get((path, LOPTI_PAIRS.get(method), round_))
        if method not in LOPTI_PAIRS or base is None:
            continue
        d = out.setdefault(path, {}).setdefault(method, {})
        for field in ("train_s", "train_cpu_s", "compute_s", *(f"{k}_s" for k in STAGES)):
            if base.get(field):
                d.setdefault(field[:-2], []).append(r[field] / base[field])
    return {p: {m: {k: spread(v) for k, v in d.items()} for m, d in ms.items()} for p, ms in out.items()}


def split_clock(report: dict) -> str:
    """``"cpu"`` on CPU (stage seconds apportioned to the update's process-CPU seconds, :func:`stage_seconds`),
    ``"wall"`` on CUDA (the clocks synchronise the device, and the process's CPU seconds are not the GPU's work)."""
    return "wall" if report["settings"].get("device", "cpu") != "cpu" else "cpu"


def stage_seconds(record: dict, clock: str) -> dict:
    """One update's stage seconds: the clocks' wall seconds, or (``clock="cpu"``) each stage's share of the update's
    wall time times the update's process-CPU seconds. On a machine shared with other jobs the process waits for a
    core for long stretches (wall 1.4 to 3.4x its CPU seconds in the committed run), which scatters each stage's
    wall seconds from round to round; a stage's share of its own update moves far less, and the CPU seconds are
    the work done. (It assumes the waiting is spread over the update's stages in proportion to their length.)"""
    if clock == "wall":
        return {k: record[f"{k}_s"] for k in STAGES}
    return {k: record[f"{k}_s"] / record["train_s"] * record["train_cpu_s"] for k in STAGES}


def splits(report: dict) -> dict:
    """``{loss_path: {pair: {"grpo": {stage: s}, "lopti": {stage: s}}}}``: median stage seconds (:func:`split_clock`)
    of each (Lopti method, its base) pair, and ``"pooled"``: both Lopti methods against both without Lopti (AR only
    changes the loss's per-token weights, not the work, so GRPO's and AR's updates are samples of one cost, and
    Lopti's and AR+Lopti's: twice the samples per median)."""
    clock = split_clock(report)
    out: dict = {}
    for path in report["results"]:
        rows = [r for r in report.get("records", []) if r["loss_path"] == path]
        groups = {f"{lopti}/{base}": ([r for r in rows if r["method"] == base], [r for r in rows if r["method"] == lopti])
                  for lopti, base in LOPTI_PAIRS.items()}  # fmt: skip
        groups["pooled"] = ([r for r in rows if r["method"] in LOPTI_PAIRS.values()],
                            [r for r in rows if r["method"] in LOPTI_PAIRS])  # fmt: skip
        for pair, (base, lopti) in groups.items():
            if pair == "pooled" and len(out.get(path, {})) < len(LOPTI_PAIRS):
                continue  # only one pair measured: pooling adds nothing
            if base and lopti:
                out.setdefault(path, {})[pair] = {
                    name: {k: spread([stage_seconds(r, clock)[k] for r in group])["median"] for k in STAGES}
                    for name, group in (("grpo", base), ("lopti", lopti))
                }  # fmt: skip
    return out


def projection(report: dict) -> dict:
    """``{loss_path: {pair: project(...)}}`` from :func:`splits`."""
    context = report["settings"]["prompt_tokens"] + report["settings"]["response_tokens"]
    shape = report["settings"]["shape"]
    targets = PROJECT_TO if shape in PROJECT_TO else (shape,)
    return {path: {pair: project(split, shape, context, targets) for pair, split in pairs.items()}
            for path, pairs in splits(report).items()}  # fmt: skip


def markdown(report: dict) -> str:
    """The update table (medians (min-max)), the factor table and the projection table."""
    s = report["settings"]
    lines = [
        "| loss path | method | update s | update CPU s | body fwd s | head s | body bwd s | optimizer s | other s "
        "| low / high phase s | opt. steps | peak growth GiB | Lopti factor: update (CPU) | body + head |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path, methods in report["results"].items():
        for method in METHODS:
            if method not in methods:
                continue
            r = methods[method]
            f = report["factors"].get(path, {}).get(method, {})
            factor = f"{_fmt(f['train'])}x ({_fmt(f['train_cpu'])}x) | {_fmt(f['compute'])}x" if "train" in f else " |"
            phases = f"{_fmt(r['train_low_s'])} / {_fmt(r['train_high_s'])}" if METHODS[method][1] else ""
            growth = {k: (v / 1024 if k != "n" and v is not None else v) for k, v in r["peak_growth_mib"].items()}
            lines.append(
                f"| {path} | {method} | {_fmt(r['train_s'])} | {_fmt(r['train_cpu_s'])} | {_fmt(r['body_fwd_s'])} "
                f"| {_fmt(r['head_s'])} | {_fmt(r['body_bwd_s'])} | {_fmt(r['optimizer_s'])} | {_fmt(r['other_s'])} "
                f"| {phases} | {_fmt(r['optimizer_steps'], 0)} | {_fmt(growth)} | {factor} |"
            )
    clock = split_clock(report)
    lines += ["", f"Stage split, median seconds ({'wall, device synchronised' if clock == 'wall' else 'each stage apportioned to the update CPU seconds'}; `bench_real_shape.stage_seconds`), Lopti's over the same stage without it:", "",
              "| loss path | pair | method | body fwd | head | body bwd | optimizer | other | update | body + head |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for path, pairs in splits(report).items():
        for pair, split in pairs.items():
            total = {m: sum(split[m].values()) for m in split}
            compute = {m: split[m]["body_fwd"] + split[m]["head"] + split[m]["body_bwd"] for m in split}
            for m in ("grpo", "lopti"):
                cells = [f"{split[m][k]:.2f}" + (f" ({split[m][k] / split['grpo'][k]:.2f}x)" if m == "lopti" else "")
                         for k in STAGES]  # fmt: skip
                ratio = (f" ({total[m] / total['grpo']:.2f}x)", f" ({compute[m] / compute['grpo']:.2f}x)") if m == "lopti" else ("", "")
                lines.append(f"| {path} | {pair} | {'without Lopti' if m == 'grpo' else 'with Lopti'} | " + " | ".join(cells)
                             + f" | {total[m]:.2f}{ratio[0]} | {compute[m]:.2f}{ratio[1]} |")  # fmt: skip
    lines += ["", "Projection (arithmetic from the stage split above; assumptions in `bench_real_shape.project`):", "",
              "| loss path | pair | model | parameters | body : head FLOPs/token | GRPO update: body share | head share "
              "| Lopti factor, every stage | body + head only |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for path, pairs in report["projection"].items():
        for pair, targets in pairs.items():
            for target, p in targets.items():
                lines.append(f"| {path} | {pair} | {target} | {p['parameters'] / 1e9:.2f} B "
                             f"| {p['body_to_head_flops']:.1f} | {p['body_share']:.0%} | {p['head_share']:.0%} "
                             f"| {p['factor']:.2f}x | {p['factor_compute']:.2f}x |")  # fmt: skip
    early = "" if report.get("complete", True) else f" (stopped early: {report['rounds_counted']} counted)"
    head = (f"Shape {s['shape']} ({report['parameters'] / 1e6:.0f} M parameters), {s['responses']} responses x "
            f"({s['prompt_tokens']} prompt + {s['response_tokens']} response tokens), {s['dtype']} on {s['device']}, mini-batch {s['mini_batch_size']}, "
            f"micro-batch {s['micro_batch_size']}, low share {s['low_share']}; {report['machine']['cpu']}, "
            f"torch {report['machine']['torch']} ({report['machine']['torch_threads']} threads); load average "
            f"{report['load']['before']:.1f} -> {report['load']['after']:.1f}; {s['warmup']} warm-up + {s['repeats']} counted "
            f"rounds{early}; took {report['wall_s']:.0f} s. Medians (min-max); paper: {PAPER_LOPTI_FACTOR}x.")  # fmt: skip
    return head + "\n\n" + "\n".join(lines)


# ---------------------------------------------------------------------------------------------- command line
def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="bench_real_shape", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/real_shape", help="folder for real_shape.json/.md")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs already in --out (only those)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen2.5-0.5b",
                   help="the model's shapes (default qwen2.5-0.5b; tiny: tests)")
    p.add_argument("--methods", type=_csv(tuple(METHODS)), default=list(METHODS), help="default all four")
    p.add_argument("--loss-paths", type=_csv(LOSS_PATHS), default=["logits_kernel", "fused_lm_head"],
                   help="logits_kernel,fused_lm_head,eager (default the first two)")
    p.add_argument("--responses", type=int, default=8, help="responses in the batch, one GRPO group (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per response (default 64)")
    p.add_argument("--response-tokens", type=int, default=256, help="response tokens per response (default 256)")
    p.add_argument("--mini-batch-size", type=int, default=8, help="responses per optimizer step (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="responses per forward (default 2)")
    p.add_argument("--low-share", type=float, default=0.2, help="share of tokens below eta (default 0.2)")
    p.add_argument("--eta", type=float, default=0.5, help="Lopti's threshold (default 0.5, the paper's)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted rounds first, each one update per loss path of "
                   "the first method: AdamW's state and the allocator's pools exist before the counted ones (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="counted rounds (default 3)")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads (default 1, least disturbed by other "
                   "jobs on a shared machine; 0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="the model's dtype (default float32 on CPU, where bf16 matmuls are slow; bfloat16 on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    return p


def resolve_args(argv: Optional[list]):
    args = build_parser().parse_args(argv)
    for name in ("responses", "prompt_tokens", "response_tokens", "mini_batch_size", "micro_batch_size", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.threads < 0:
        raise UserError("--warmup and --threads must be >= 0")
    if args.responses < 2:
        raise UserError(f"--responses must be >= 2 for GRPO's group normalisation, got {args.responses}")
    if args.responses % args.mini_batch_size or args.mini_batch_size % args.micro_batch_size:
        raise UserError(f"--mini-batch-size {args.mini_batch_size} must divide --responses {args.responses} and "
                        f"--micro-batch-size {args.micro_batch_size} must divide it")  # fmt: skip
    if not 0 < args.low_share < 1:
        raise UserError(f"--low-share must be in (0, 1) so that both Lopti phases hold tokens, got {args.low_share}")
    if not 0 < args.eta < 1:
        raise UserError(f"--eta must be in (0, 1), got {args.eta}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise UserError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return args


def build_report(args, info: dict, parameters: int, load_before, loads: list, records: list, started: float,
                 complete: bool) -> dict:
    """The JSON report of the counted ``records`` so far (``complete``: every counted round ran)."""
    report = {
        "benchmark": "bench_real_shape", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "complete": complete,
        "rounds_counted": len({r["round"] for r in records}),
        "machine": info, "parameters": parameters, "parameter_counts": parameter_counts(args.shape),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")},
        "paper_lopti_factor": PAPER_LOPTI_FACTOR,
        "load": {"before": load_before, "after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                 "per_update": spread([v for v in loads if v is not None])},
        "results": summarize(records), "factors": factors(records), "records": records,
    }  # fmt: skip
    report["projection"] = projection(report)
    report["wall_s"] = time.perf_counter() - started
    return report


def render(path: str) -> int:
    """Print the tables of a saved ``real_shape.json`` (its projection recomputed from its records)."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"--render {path}: cannot read a report ({exc})") from None
    report["projection"] = projection(report)
    print(markdown(report))
    return 0


def main(argv: Optional[list] = None, log: Callable[[str], None] = None) -> int:
    """Run the benchmark; prints the tables and writes ``real_shape.json/.md`` into ``--out``."""
    if argv and argv[0] == "--render":
        if len(argv) != 2:
            raise UserError("--render takes one real_shape.json and nothing else")
        return render(argv[1])
    args = resolve_args(argv)
    out = prepare_out_dir(args.out, OUTPUTS, overwrite=args.overwrite)
    import torch

    started = time.perf_counter()
    log = log or (lambda message: print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True))
    if args.device != "cpu" and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: no CUDA device visible to torch {torch.__version__}")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    info = machine()
    model = build_model(args.shape, args.seed, args.device, args.dtype)
    parameters = sum(p.numel() for p in model.parameters())
    log(f"built {args.shape}: {parameters / 1e6:.1f} M parameters, {args.dtype} on {args.device}, RSS "
        f"{_rss_mib():.0f} MiB")  # fmt: skip
    exp = synthetic_experience(SHAPES[args.shape]["vocab_size"], args.responses, args.prompt_tokens,
                               args.response_tokens, args.low_share, args.eta, args.seed, args.device)  # fmt: skip
    from openrlhf_lopti.local.update import build_optimizers

    configs = {(p, m): update_config(args, m, p) for p in args.loss_paths for m in args.methods}
    # One AdamW for every variant: its state persists (a steady-state step, no first-step allocation in the timed
    # window); the lr is 1e-7 for all (the methods' lr does not change the work).
    (optimizer,) = build_optimizers([p for p in model.parameters() if p.requires_grad], configs[next(iter(configs))])
    records, loads = [], []
    for round_ in range(args.warmup + args.repeats):
        counted = round_ >= args.warmup
        for path in rotated(args.loss_paths, round_):
            for method in rotated(args.methods, round_) if counted else args.methods[:1]:
                record = run_update(model, optimizer, exp, configs[(path, method)])
                record.update(loss_path=path, method=method, round=round_, counted=counted,
                              load_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)  # fmt: skip
                loads.append(record["load_1m"])
                log(f"{path:<13} {method:<8} round {round_ + 1}{'' if counted else ' (warm-up)'}: update "
                    f"{record['train_s']:.2f} s (CPU {record['train_cpu_s']:.2f}), body fwd {record['body_fwd_s']:.2f}"
                    f" head {record['head_s']:.2f} body bwd {record['body_bwd_s']:.2f} opt {record['optimizer_s']:.2f}"
                    f" other {record['other_s']:.2f}; peak +{record['peak_growth_mib']:.0f} MiB; load "
                    f"{record['load_1m']}")  # fmt: skip
                if counted:
                    records.append(record)
        if counted:  # after every counted round: a run stopped early keeps its finished rounds
            report = build_report(args, info, parameters, load_before, loads, records, started,
                                  complete=round_ == args.warmup + args.repeats - 1)  # fmt: skip
            table = markdown(report)
            (out / "real_shape.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
            (out / "real_shape.md").write_text(table + "\n", encoding="utf-8")
    print(table)
    print(f"wrote {out / 'real_shape.json'}, real_shape.md")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("bench_real_shape", main, sys.argv[1:]))
