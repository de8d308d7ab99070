"""Peak memory and time of one step's loss head at a big vocabulary, three paths side by side in one run:

- ``openrlhf``: OpenRLHF 0.11.2's actor path, with its own functions: ``lm_head`` in the model dtype, then
  ``logits.to(float32)`` and ``div_(T)`` (``models/actor.py``), ``compute_entropy`` (``torch.compile``d as
  upstream ships it), ``log_probs_from_logits``, ``PolicyLoss`` + ``kl_coef * masked_mean(compute_approx_kl)``
  ``- entropy_coef * masked_mean(entropy)`` (``trainer/ray/ppo_actor.py``);
- ``logits_kernel``: ``lm_head`` in the model dtype, then our ``fused_policy_loss`` on those logits;
- ``fused_linear``: our ``fused_linear_policy_loss`` (lm_head + loss block by block; no ``[N, V]`` logits);
- ``liger_flce``: Liger-Kernel's fused linear GRPO loss (``LigerFusedLinearGRPOLoss``, chunked torch, compiled),
  when installed: its KL is a loss term of its own, its loss is ``bnpo`` (a token mean: the same at one sequence);
- ``cce``: Apple's Cut Cross-Entropy (``linear_cross_entropy``, ``impl="cce", filter_eps=None``: nothing filtered)
  for the log-probs, when installed and on CUDA, then our per-token loss on those ``[N]`` log-probs
  (``algo.policy_loss_from_logp``). It computes no entropy: run with ``--entropy-coef 0`` to compare it.

Every row records the backend its op reports it ran (ours: ``LossHeadOutput.backend``); a row whose backend is not
the one expected (``--backend``: ``triton`` on CUDA, ``cpp`` / ``torch`` on CPU) is refused and the run exits 1.

One step's loss head = the forward-only passes (old-policy and reference log-probs from the hidden states,
as experience making does; no entropy there, as upstream) + the training step's forward and backward,
with gradients to the hidden states and the lm_head weight, through loss, KL (via logp) and an entropy bonus.
All three compute the same math (alpha = 0, k3 KL, clip-higher, temperature, all N tokens unmasked); the
table prints each path's loss so that can be seen.

Peak memory: one step after a warm-up step, per path; the growth over what the inputs (hidden states, lm_head
weight, per-token vectors) take, the returned gradients included (also shown without them): on CPU the peak RSS of
a fresh process per path (Linux: reset through /proc/self/clear_refs, read as VmHWM), on GPU
``torch.cuda.max_memory_allocated``, reset per step, all paths in this process (exact per path; no process starts
to pay for). Time: all paths in one process on the same inputs, a warm-up step each (which also compiles
upstream's entropy), then ``--repeats`` rounds running every path once in a rotated order; the medians, and the
time goals as the median of the per-round ratios (robust to a shared machine); on GPU also each path's train
TFLOP/s against torch's own GEMM at the shape. A path that fails (a peer's API change, an OOM) is a row saying
so; the others still run, and the JSON is rewritten after each path's memory step (``"complete": false`` until
the end), so a run stopped by a time limit keeps what it measured.

    python benchmarks/bench_memory.py                  # CPU: N=2048, H=896, V=151936, fp32 (heavy: minutes)
    python benchmarks/bench_memory.py --device cuda    # GPU: N=16384, H=2048, bf16
    python benchmarks/bench_memory.py --n 256 --h 64 --v 4096 --repeats 1     # a quick check

It also prints the arithmetic bytes of each path's dominant buffers at N=32768, H=4096 (bf16 on GPU).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's memory and CPU helpers
from bench_cpu_policy_loss import _cpu_model, _peak_growth, _start_peak_window  # noqa: E402
from gpu_steps import first_error_line  # noqa: E402

from openrlhf_lopti.errors import UserError  # noqa: E402
from openrlhf_lopti.runs import prepare_out_file  # noqa: E402

PATHS = ("openrlhf", "logits_kernel", "fused_linear", "liger_flce", "cce")
DEFAULT_PATHS = ("openrlhf", "logits_kernel", "fused_linear")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Same loss options in every path: clip-higher, k3 KL, entropy bonus, sampling temperature (no AR: upstream has none).
EPS_LOW, EPS_HIGH, KL_COEF, ENTROPY_COEF, TEMPERATURE = 0.2, 0.28, 0.001, 0.001, 0.7
FORWARD_ONLY_PASSES = 2  # old-policy and reference log-probs
GOALS = {"memory_vs_openrlhf": 10.0, "memory_vs_logits_kernel": 3.0, "time_vs_logits_kernel": 1.3}


def expected_backends(device: str, backend: str) -> dict:
    """The backend each path must report for its figures to be that path's: ours run ``backend`` (``auto``: Triton
    on CUDA; on CPU the C++ kernel for the logits, torch block ops for the fused lm_head)."""
    if backend == "auto":
        logits, fused = ("triton", "triton") if device == "cuda" else ("cpp", "torch")
    else:
        logits, fused = backend, ("torch" if backend == "cpp" else backend)
    return {"openrlhf": "openrlhf", "logits_kernel": logits, "fused_linear": fused, "liger_flce": "liger",
            "cce": "cce"}
DEFAULTS = {
    "cpu": dict(n=2048, h=896, v=151936, dtype="float32"),  # Qwen2.5-0.5B's hidden size
    "cuda": dict(n=16384, h=2048, v=151936, dtype="bfloat16"),  # Qwen2.5-3B's
}


def _make_inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """hidden [N, H], weight [V, H] (logits of std ~2.5, as a trained lm_head's), labels drawn from the model,
    old/ref log-probs = the current ones plus noise (ratios on both sides of the clip)."""
    from openrlhf_lopti.ops import linear_log_probs

    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=device).to(dtype)
    weight = (torch.randn(v, h, generator=g, device=device) * (2.5 / h**0.5)).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    logp, _ = linear_log_probs(hidden, weight, labels, temperature=TEMPERATURE)
    noise = lambda s: s * torch.randn(n, generator=g, device=device)  # noqa: E731
    return dict(hidden=hidden.requires_grad_(True), weight=weight.requires_grad_(True), labels=labels,
                old=(logp + noise(0.3)).clamp(max=0.0), ref=logp + noise(0.5),  # old: a log-prob, <= 0
                adv=torch.randn(n, generator=g, device=device),
                mask=torch.ones(n, dtype=torch.bool, device=device))  # fmt: skip


class Steps(NamedTuple):
    """One path's forward-only passes and training forward (the caller backpropagates), and the backends its ops
    reported running (filled as they run)."""

    forward_only: Callable
    train: Callable
    ran: set
    note: str = ""  # what the row's figures are, where not all the path's own (in the JSON and the table)


def _openrlhf_steps(data: dict, options: dict) -> Steps:
    from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

    install_cpu_stubs()  # openrlhf.models imports flash-attn; a no-op where it is installed
    from openrlhf.models.loss import PolicyLoss
    from openrlhf.models.utils import compute_approx_kl, compute_entropy, log_probs_from_logits, masked_mean

    policy_loss = PolicyLoss(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH)
    labels, mask = data["labels"][None], data["mask"][None].float()  # OpenRLHF's [B, T] layout, B = 1

    def actor_logits(hidden, weight):  # models/actor.py: model output, fp32 upcast, temperature in place
        logits = (hidden @ weight.t())[None].to(torch.float32)
        logits.div_(TEMPERATURE)
        return logits

    def forward_only():
        with torch.no_grad():
            return [log_probs_from_logits(actor_logits(data["hidden"], data["weight"]), labels)
                    for _ in range(FORWARD_ONLY_PASSES)][-1][0]  # fmt: skip

    def train():
        logits = actor_logits(data["hidden"], data["weight"])
        entropy = compute_entropy(logits)
        logp = log_probs_from_logits(logits, labels)
        del logits
        loss = policy_loss(logp, data["old"][None], data["adv"][None], action_mask=mask)[0]
        kl = compute_approx_kl(logp, data["ref"][None], kl_estimator="k3")
        return loss + KL_COEF * masked_mean(kl, mask, dim=None) - options["entropy_coef"] * masked_mean(entropy, mask,
                                                                                                    dim=None)

    return Steps(forward_only, train, {"openrlhf"})


def _our_options(data: dict, options: dict) -> dict:
    """Our loss's settings, the token mean's weights up front (the one-pass head where the backend has one) and, with
    an entropy bonus, its weights; value checks at the step (what our trainers do)."""
    weights = data["mask"].float() / data["mask"].sum()
    entropy = -options["entropy_coef"] * weights if options["entropy_coef"] else None
    return dict(ref_log_probs=data["ref"], eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=KL_COEF, kl_estimator="k3",
                temperature=TEMPERATURE, backend=options["backend"], check="step", loss_weights=weights,
                entropy_weights=entropy)  # fmt: skip


def _logits_kernel_steps(data: dict, options: dict) -> Steps:
    from openrlhf_lopti.ops import StepChecks, fused_policy_loss

    zeros = torch.zeros_like(data["old"])
    ran, checks = set(), StepChecks()

    def forward_only():
        with torch.no_grad():
            for _ in range(FORWARD_ONLY_PASSES):
                logits = data["hidden"] @ data["weight"].t()
                out = fused_policy_loss(logits, data["labels"], zeros, zeros, data["mask"], temperature=TEMPERATURE,
                                        backend=options["backend"])  # fmt: skip
                ran.add(out.backend)
                logp = out.logp
                del logits
        return logp

    def train():
        logits = data["hidden"] @ data["weight"].t()
        out = fused_policy_loss(logits, data["labels"], data["old"], data["adv"], data["mask"],
                                grad_in_logits=True, **_our_options(data, options))  # fmt: skip
        ran.add(out.backend)
        checks.add(out.status, "train")
        del logits
        return out.reduced

    return Steps(forward_only, train, ran)


def _fused_linear_steps(data: dict, options: dict) -> Steps:
    from openrlhf_lopti.ops import fused_linear_policy_loss, linear_log_probs

    ran = set()

    def forward_only():
        for _ in range(FORWARD_ONLY_PASSES):
            logp, _ = linear_log_probs(data["hidden"], data["weight"], data["labels"], temperature=TEMPERATURE,
                                       backend=options["backend"])  # fmt: skip
        return logp

    def train():
        out = fused_linear_policy_loss(data["hidden"], data["weight"], data["labels"], data["old"], data["adv"],
                                       data["mask"], **_our_options(data, options))  # fmt: skip
        ran.add(out.backend)
        return out.reduced

    return Steps(forward_only, train, ran)


def _liger_steps(data: dict, options: dict) -> Steps:
    """Liger-Kernel's fused linear GRPO loss over the N tokens as one sequence (its [B, T] layout, B = 1)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=KL_COEF, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, loss_type="bnpo",
                                       temperature=TEMPERATURE, use_ref_model=True)  # fmt: skip
    ids, mask = data["labels"][None], data["mask"][None].long()
    seq_adv = data["adv"][:1]  # one advantage per sequence

    def forward_only():
        from openrlhf_lopti.ops import linear_log_probs  # Liger has no forward-only pass: ours stands in, as equal

        with torch.no_grad():
            for _ in range(FORWARD_ONLY_PASSES):
                logp, _ = linear_log_probs(data["hidden"], data["weight"], data["labels"], temperature=TEMPERATURE)
        return logp

    def train():
        loss, _ = loss_fn(data["hidden"][None], data["weight"], ids, mask, seq_adv,
                          ref_per_token_logps=data["ref"][None], old_per_token_logps=data["old"][None])  # fmt: skip
        return loss

    return Steps(forward_only, train, {"liger"}, "forward-only passes: ours (Liger has none); compare train times")


def _cce_steps(data: dict, options: dict) -> Steps:
    """Cut Cross-Entropy's exact kernel for the log-probs (``-loss`` per token), our per-token loss on them."""
    from cut_cross_entropy import linear_cross_entropy

    from openrlhf_lopti.algo import policy_loss_from_logp

    def logp_of(hidden):
        # filter_eps=None: no gradient entry filtered (exact); cut-cross-entropy 25.1.1 has no "cce_exact" impl
        return -linear_cross_entropy(hidden / TEMPERATURE, data["weight"], data["labels"], reduction="none",
                                     impl="cce", filter_eps=None)  # fmt: skip

    def forward_only():
        with torch.no_grad():
            for _ in range(FORWARD_ONLY_PASSES):
                logp = logp_of(data["hidden"])
        return logp

    def train():
        out = policy_loss_from_logp(logp_of(data["hidden"]), data["old"], data["adv"], data["mask"],
                                    ref_log_probs=data["ref"], eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=KL_COEF)
        return out.loss.sum() / data["mask"].sum()

    return Steps(forward_only, train, {"cce"})


STEPS = {"openrlhf": _openrlhf_steps, "logits_kernel": _logits_kernel_steps, "fused_linear": _fused_linear_steps,
         "liger_flce": _liger_steps, "cce": _cce_steps}


class _Peak:
    """Peak memory growth over the level at ``start()``: CUDA allocator statistics, or the CPU process's RSS."""

    def __init__(self, device: str):
        self.device = device

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.method, self.base = _start_peak_window()

    def growth(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _peak_growth(self.method, self.base)


def _setup(device: str, n: int, h: int, v: int, dtype_name: str) -> dict:
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", 0)) or os.cpu_count() or 1)
    return _make_inputs(n, h, v, getattr(torch, dtype_name), device)


def _step(data: dict, forward_only, train, device: str, peak: Optional["_Peak"] = None) -> dict:
    """One step's loss head: the forward-only passes, then the training forward + backward (gradients to the
    hidden states and the lm_head weight). Times each part; with ``peak``, also its peak memory growth."""
    import gc

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    result = {}
    gc.collect()
    if peak:
        peak.start()
    t0, c0 = time.perf_counter(), time.process_time()
    logp = forward_only()
    sync()
    result["forward_only_s"], result["forward_only_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    if peak:
        result["forward_only_peak_bytes"] = peak.growth()
    del logp
    gc.collect()
    if peak:
        peak.start()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = train()
    grad_hidden, grad_weight = torch.autograd.grad(loss, [data["hidden"], data["weight"]])
    sync()
    result["train_s"], result["train_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    if peak:
        result["train_peak_bytes"] = peak.growth()
    result.update(loss=float(loss.detach()), grad_hidden_norm=float(grad_hidden.float().norm()),
                  grad_weight_norm=float(grad_weight.float().norm()),
                  grad_bytes=grad_hidden.nbytes + grad_weight.nbytes)  # fmt: skip
    return result


def _memory_worker(path: str, options: dict, device: str, n: int, h: int, v: int, dtype_name: str) -> dict:
    """One path: a warm-up step, then one step whose peak memory is measured (a fresh process on CPU). A failure
    of any kind is the row's status ("not installed (...)", "failed: ..."): the other paths still run."""
    data = _setup(device, n, h, v, dtype_name)
    try:
        steps = STEPS[path](data, options)
        _step(data, steps.forward_only, steps.train, device)  # warm-up: dispatch, torch.compile of upstream's entropy
        out = dict(path=path, status="ok", **_step(data, steps.forward_only, steps.train, device, _Peak(device)))
    except ImportError as error:
        return dict(path=path, status=f"not installed ({error.name or error})")
    except Exception as error:  # noqa: BLE001 - a peer's API change or an OOM loses its row, not the others'
        return dict(path=path, status=f"failed: {first_error_line(error)[:300]}")
    out["peak_bytes"] = max(out["forward_only_peak_bytes"], out["train_peak_bytes"])
    out["backend_ran"] = sorted(steps.ran)
    if steps.note:
        out["note"] = steps.note
    return out



def _time_worker(paths: list, options: dict, device: str, n: int, h: int, v: int, dtype_name: str,
                 repeats: int) -> dict:  # fmt: skip
    """All paths in one process on the same inputs, interleaved: one warm-up step each, then ``repeats`` rounds
    that run every path once, in an order rotated each round, so a change of machine load hits all paths."""
    data = _setup(device, n, h, v, dtype_name)
    steps, failed = {}, {}
    for path in paths:
        try:
            steps[path] = STEPS[path](data, options)
            _step(data, steps[path].forward_only, steps[path].train, device)
        except Exception as error:  # noqa: BLE001 - timed without it; its row says why
            steps.pop(path, None)
            failed[path] = f"failed in the timing worker: {first_error_line(error)[:300]}"
    paths = [path for path in paths if path in steps]
    rounds = []
    for r in range(repeats):
        order = paths[r % len(paths) :] + paths[: r % len(paths)]
        rounds.append({path: _step(data, steps[path].forward_only, steps[path].train, device) for path in order})
        rounds[-1]["loadavg_1min"] = os.getloadavg()[0]  # other jobs on the machine, for the record
    out = dict(rounds=rounds, threads=torch.get_num_threads(), backend_ran={p: sorted(s.ran) for p, s in steps.items()},
               failed=failed)  # fmt: skip
    if device == "cpu":
        from openrlhf_lopti.ops.cpp_policy_loss import cpp_available, cpp_isa

        out["cpp_isa"] = cpp_isa() if cpp_available() else "unavailable (torch backend)"
    else:
        out["gpu"] = torch.cuda.get_device_name()
        out["gemm_tflops"] = _gemm_tflops(data["hidden"].detach(), data["weight"].detach())
    return out


def _gemm_tflops(hidden: torch.Tensor, weight: torch.Tensor, repeats: int = 5) -> float:
    """TFLOP/s of torch's own ``hidden [N, H] @ weight.T [H, V]`` on this GPU at this shape and dtype (median of
    ``repeats`` after a warm-up, CUDA events): the ceiling the fused lm_head's GEMMs can be held against."""
    times = []
    for i in range(repeats + 1):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        product = hidden @ weight.t()
        stop.record()
        stop.synchronize()
        del product
        if i:
            times.append(start.elapsed_time(stop) / 1e3)
    n, h = hidden.shape
    return 2 * n * h * weight.shape[0] / statistics.median(times) / 1e12


def arithmetic_bytes(n: int, h: int, v: int, itemsize: int) -> dict:
    """Each path's training-step peak from its dominant buffers (bytes), by the structure the CPU measurement
    shows: OpenRLHF holds four fp32 ``[N, V]`` buffers at its peak (upcast logits, entropy and log-softmax
    temporaries, gradients), plus the lm_head's low-precision gradient when the model is bf16/fp16; the logits
    kernel holds the logits and their gradient (one buffer: the one-pass head writes the gradient over them), or
    the logits and the lm_head's gradients; the fused lm_head holds one ``[R, Vb]`` block of logits
    (``DEFAULT_BLOCK_BYTES``), the fp32 ``[N, H]`` accumulator of the hidden states' gradient and a product in the
    model dtype, beside the gradients every path returns."""
    from openrlhf_lopti.ops.fused_linear_policy_loss import DEFAULT_BLOCK_BYTES

    nv, vh, nh = n * v, v * h, n * h
    low = itemsize != 4
    grads = (vh + nh) * itemsize
    return {
        "openrlhf": 16 * nv + (itemsize * nv if low else 0),
        "logits_kernel": itemsize * nv + grads,
        "fused_linear": min(DEFAULT_BLOCK_BYTES, itemsize * nv) + 4 * nh + itemsize * nh + grads,
    }


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


PARTS = ("forward_only", "train", "total")


def _seconds(run: dict, part: str, clock: str = "") -> float:
    """Wall (``clock=""``) or process CPU (``clock="cpu_"``) seconds of a part of one step."""
    if part == "total":
        return _seconds(run, "forward_only", clock) + _seconds(run, "train", clock)
    return run[f"{part}_{clock}s"]


# The datasheet's dense bf16 tensor-core rate (FLOP/s) by a substring of the device name (first match wins).
TENSOR_PEAK = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def summarize(memory: list, timing: dict, shape: Optional[dict] = None) -> dict:
    """Per path: peak bytes (from its memory step) and median wall times (from the interleaved rounds). fused_linear
    against each other path that ran: its peak over fused_linear's (``memory_vs_<path>``, also without the gradients
    every path returns) and fused_linear's time over its (``<part>_time_vs_<path>``), three ways: the median over
    rounds of the per-round wall ratio, the ratio of the fastest rounds (least disturbed by other jobs), and the
    median per-round process-CPU ratio. Against ``liger_flce`` the train part only (its forward-only passes are ours).
    With ``shape`` (and a GPU's ``gemm_tflops`` in ``timing``): each path's train TFLOP/s (the 6NHV of a fwd+bwd),
    against torch's GEMM at this shape and the datasheet's rate."""
    rounds = timing["rounds"]
    paths = {m["path"]: dict(m) for m in memory if m["status"] == "ok"}
    for path, row in paths.items():
        for part in PARTS:
            row[f"{part}_s"] = statistics.median(_seconds(r[path], part) for r in rounds)
    ratios = {}
    if "fused_linear" in paths:
        fl = paths["fused_linear"]
        without = lambda row: row["peak_bytes"] - row["grad_bytes"]  # noqa: E731
        ratio = lambda a, b: a / b if b > 0 else float("nan")  # noqa: E731  (a tiny shape can grow by 0 bytes)
        for other in (p for p in PATHS if p in paths and p != "fused_linear"):
            row = paths[other]
            ratios[f"memory_vs_{other}"] = ratio(row["peak_bytes"], fl["peak_bytes"])
            ratios[f"memory_vs_{other}_without_grads"] = ratio(without(row), without(fl))
            for part in ("train",) if other == "liger_flce" else PARTS:
                fused = [_seconds(r["fused_linear"], part) for r in rounds]
                theirs = [_seconds(r[other], part) for r in rounds]
                cpu = [_seconds(r["fused_linear"], part, "cpu_") / _seconds(r[other], part, "cpu_") for r in rounds]
                ratios[f"{part}_time_vs_{other}"] = {
                    "median_of_round_ratios": statistics.median(f / g for f, g in zip(fused, theirs)),
                    "fastest_rounds": min(fused) / min(theirs),
                    "median_of_round_cpu_ratios": statistics.median(cpu),
                }
    throughput = {}
    if shape and timing.get("gemm_tflops"):
        flops = 6 * shape["n"] * shape["h"] * shape["v"]  # logits, grad of the hidden states, grad of the weight
        peak = next((rate for key, rate in TENSOR_PEAK if key in timing.get("gpu", "")), None)
        throughput = dict(gemm_tflops=timing["gemm_tflops"], datasheet_tflops=peak and peak / 1e12)
        for path, row in paths.items():
            row["train_tflops"] = flops / row["train_s"] / 1e12
            row["train_share_of_gemm"] = row["train_tflops"] / timing["gemm_tflops"]
            row["train_share_of_datasheet"] = peak and row["train_tflops"] * 1e12 / peak
    skipped = [dict(m) for m in memory if m["status"] != "ok"]
    return dict(paths=list(paths.values()), skipped=skipped, ratios=ratios, throughput=throughput,
                loadavg=[r["loadavg_1min"] for r in rounds])  # fmt: skip


def format_report(summary: dict) -> str:
    lines = [
        "| path | backend | forward-only passes: time (s) | peak (GiB) | train fwd+bwd: time (s) | peak (GiB) "
        "| step time (s) | step peak (GiB) | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["paths"]:
        lines.append(
            f"| {r['path']} | {','.join(r['backend_ran'])} | {r['forward_only_s']:.4f} "
            f"| {_gib(r['forward_only_peak_bytes'])} | {r['train_s']:.4f} | {_gib(r['train_peak_bytes'])} "
            f"| {r['total_s']:.4f} | {_gib(r['peak_bytes'])} | {r['loss']:.6f} |"
            + (f" {r['note']}" if r.get("note") else "")
        )
    for r in summary.get("skipped", []):
        lines.append(f"| {r['path']} | {r['status']} |")
    q = summary["ratios"]
    if q:
        others = [p for p in PATHS if f"memory_vs_{p}" in q]
        grads = _gib(summary["paths"][0]["grad_bytes"])
        goal = lambda key: f" (goal >= {GOALS[key]:.0f}x)" if key in GOALS else ""  # noqa: E731
        lines += [
            "",
            "fused_linear peak: " + ", ".join(f"{q[f'memory_vs_{p}']:.1f}x less than {p}{goal(f'memory_vs_{p}')}"
                                              for p in others),  # fmt: skip
            f"  without the {grads} GiB of gradients every path returns: "
            + ", ".join(f"{q[f'memory_vs_{p}_without_grads']:.1f}x ({p})" for p in others),
            f"fused_linear time / each path's time (goal against logits_kernel, the step: <= "
            f"{GOALS['time_vs_logits_kernel']}x):",
        ]
        for p in others:
            for part in PARTS:
                t = q.get(f"{part}_time_vs_{p}")
                if t:
                    lines.append(f"  vs {p}, {part}: {t['median_of_round_ratios']:.2f}x (median of rounds), "
                                 f"{t['fastest_rounds']:.2f}x (fastest rounds), {t['median_of_round_cpu_ratios']:.2f}x "
                                 "(process CPU time)")  # fmt: skip
    t = summary.get("throughput")
    if t:
        sheet = f", the datasheet's {t['datasheet_tflops']:.0f}" if t.get("datasheet_tflops") else ""
        lines.append(f"train fwd+bwd TFLOP/s (6NHV over the train time; torch's GEMM at this shape: "
                     f"{t['gemm_tflops']:.0f}{sheet}): "
                     + ", ".join(f"{r['path']} {r['train_tflops']:.0f} ({100 * r['train_share_of_gemm']:.0f}% of the "
                                 "GEMM's)" for r in summary["paths"]))  # fmt: skip
    lines.append("1-min load average at the end of each timed round: "
                 + ", ".join(f"{x:.1f}" for x in summary["loadavg"]))  # fmt: skip
    return "\n".join(lines)


def format_arithmetic(n: int, h: int, v: int, itemsize: int) -> str:
    b = arithmetic_bytes(n, h, v, itemsize)
    dtype = {2: "bf16", 4: "fp32"}[itemsize]
    return (f"arithmetic, training step at N={n}, H={h}, V={v}, {dtype} model (dominant buffers, GiB): "
            + ", ".join(f"{k} {_gib(x)}" for k, x in b.items())
            + f"; fused_linear {b['openrlhf'] / b['fused_linear']:.1f}x less than openrlhf, "
            f"{b['logits_kernel'] / b['fused_linear']:.1f}x less than logits_kernel")  # fmt: skip


def _subprocess(args: list) -> dict:
    """A worker in a fresh process (CPU: a process's peak RSS is what measures one path); its stderr goes to ours, so
    a log shows its progress and its error."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args[1]} exited {proc.returncode} (its error is above)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _worker(spec: str, options: dict, dims: tuple, repeats: int) -> dict:
    """The result of worker ``spec`` ("memory:<path>" or "time:<paths>"), run in this process."""
    mode, what = spec.split(":")
    if mode == "memory":
        return _memory_worker(what, options, *dims)
    return _time_worker(what.split(","), options, *dims, repeats)


def _write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--n", type=int, help="tokens (default: 2048 on CPU, 16384 on GPU)")
    parser.add_argument("--h", type=int, help="hidden size (default: 896 on CPU, 2048 on GPU)")
    parser.add_argument("--v", type=int, help="vocab size (default 151936, Qwen2.5's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="model dtype (default: float32 on CPU, bfloat16 on GPU; bf16 GEMMs on CPU are slow)")
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"comma-separated subset of {PATHS}")
    parser.add_argument("--backend", choices=("auto", "triton", "cpp", "torch"), default="auto",
                        help="our kernels' backend; a path whose op reports another one is refused (exit 1)")
    parser.add_argument("--entropy-coef", type=float, default=ENTROPY_COEF,
                        help=f"entropy bonus in every path (default {ENTROPY_COEF}; 0 to compare cce, which has none)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (every path once each), after a warm-up")
    parser.add_argument("--json", help="write the results here (default benchmarks/results/bench_memory_<device>.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing JSON file")
    parser.add_argument("--threads", type=int, help="CPU threads (default: all cores); 1 is least disturbed by "
                        "other jobs on a shared machine")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "memory:<path>" or "time:<paths>"
    args = parser.parse_args(argv)
    for flag in ("n", "h", "v", "repeats", "threads"):  # `is None`, not `or`: a 0 given is refused, not replaced
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be an integer >= 1, got {getattr(args, flag)}")
    if not math.isfinite(args.entropy_coef):
        parser.error(f"--entropy-coef must be a finite number, got {args.entropy_coef}")
    shape = {k: DEFAULTS[args.device][k] if getattr(args, k) is None else getattr(args, k)
             for k in ("n", "h", "v", "dtype")}  # fmt: skip
    dims = (args.device, shape["n"], shape["h"], shape["v"], shape["dtype"])
    options = dict(backend=args.backend, entropy_coef=args.entropy_coef)
    if args.worker:
        print(json.dumps(_worker(args.worker, options, dims, args.repeats)))
        return 0
    paths = [p for p in args.paths.split(",") if p]
    if not paths or set(paths) - set(PATHS):
        parser.error(f"--paths must be a comma-separated subset of {PATHS}, got {args.paths!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    json_path = Path(args.json or RESULTS_DIR / f"bench_memory_{args.device}.json")
    try:  # before the run, not after it: a path that cannot be written would lose every figure
        prepare_out_file(json_path, overwrite=args.overwrite, out_flag="--json")
    except UserError as error:
        parser.error(str(error))

    if args.threads:
        os.environ["BENCH_THREADS"] = str(args.threads)  # read by the worker processes
    started = time.perf_counter()
    common = ["--device", args.device, "--n", str(shape["n"]), "--h", str(shape["h"]), "--v", str(shape["v"]),
              "--dtype", shape["dtype"], "--repeats", str(args.repeats), "--backend", args.backend,
              "--entropy-coef", str(args.entropy_coef)]  # fmt: skip
    # CPU: each worker in a fresh process (peak RSS is per process). CUDA: here, one after the other (the allocator's
    # peak statistics, reset per step, are exact per path; a process per path cost ~14 s of start, self-check and
    # compiles each on the H100, and the GPU session's step ran out of time before its last path).
    run_worker = (lambda spec: _worker(spec, options, dims, args.repeats)) if args.device == "cuda" else (
        lambda spec: _subprocess(["--worker", spec, *common]))  # fmt: skip
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else _cpu_model()  # in every partial JSON too
    report = dict(shape=shape, device=args.device, device_name=device_name, backend=args.backend,
                  entropy_coef=args.entropy_coef, complete=False, memory=[])  # fmt: skip
    expected = expected_backends(args.device, args.backend)
    for path in paths:
        try:
            row = run_worker(f"memory:{path}")
        except RuntimeError as error:  # the worker process died (its error went to stderr): this path's row says so
            row = dict(path=path, status=f"failed: {error}")
        # every figure says what ran: a path whose op ran another backend is not that path's figure
        if row["status"] == "ok" and row["backend_ran"] != [expected[row["path"]]]:
            row["status"] = f"refused: the op ran {row['backend_ran']}, {expected[row['path']]} expected"
        report["memory"].append(row)
        peak = f", peak {_gib(row['peak_bytes'])} GiB, ran {row['backend_ran']}" if row["status"] == "ok" else ""
        print(f"memory: {path}: {row['status']}{peak}", file=sys.stderr, flush=True)
        _write_json(json_path, report)  # a step cut short by its time budget keeps the rows it measured
    memory = report["memory"]
    running = [row["path"] for row in memory if row["status"] == "ok"]
    timing = run_worker(f"time:{','.join(running)}") if running else dict(rounds=[])
    for path, why in timing.get("failed", {}).items():
        next(r for r in memory if r["path"] == path)["status"] = why
    for path, ran in timing.get("backend_ran", {}).items():
        if ran != [expected[path]]:
            row = next(r for r in memory if r["path"] == path)
            row["status"] = f"refused: the op ran {ran} in the timed rounds, {expected[path]} expected"
    summary = (summarize(memory, timing, shape) if timing["rounds"]
               else dict(paths=[], skipped=memory, ratios={}, loadavg=[]))  # fmt: skip
    if args.device == "cuda":
        where = f"GPU: {timing.get('gpu', torch.cuda.get_device_name())}"
    else:
        where = f"CPU: {_cpu_model()}, {os.cpu_count()} cores, torch threads {timing['threads']}"
        where += f", cpp kernel {timing.get('cpp_isa', '-')}"
    print(where)
    peaks = "in this process, reset per step" if args.device == "cuda" else "one fresh process per path"
    print(f"N={shape['n']}, H={shape['h']}, V={shape['v']}, {shape['dtype']}; {FORWARD_ONLY_PASSES} forward-only "
          f"passes + one training fwd+bwd. Peaks: {peaks}, a step after a warm-up step. Times: "
          f"median of {args.repeats} interleaved rounds in one process, after a warm-up step per path")  # fmt: skip
    print(format_report(summary))
    itemsize = 4 if shape["dtype"] == "float32" else 2
    print(format_arithmetic(shape["n"], shape["h"], shape["v"], itemsize))
    print(format_arithmetic(32768, 4096, 151936, 2))
    print(f"(bench took {time.perf_counter() - started:.0f} s)")
    report.update(where=where, summary=summary, timing=timing, complete=True)
    _write_json(json_path, report)
    print(f"wrote {json_path}")
    refused = [row["path"] for row in memory if row["status"].startswith("refused")]
    if refused:
        print(f"refused paths (their op ran another backend): {', '.join(refused)}", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
