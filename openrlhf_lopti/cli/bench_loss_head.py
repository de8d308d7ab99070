"""``openrlhf-lopti bench``: the fused policy loss against OpenRLHF 0.11.2's actor path, side by side on the same
inputs in one run (the loss-head benchmark; ``check-gpu`` runs it too, so it lives in the package, and
``benchmarks/bench_policy_loss.py`` is the same program run from a source checkout).

Backends (``--backends``, comma-separated):

- ``openrlhf``: (a) what OpenRLHF's actor does: ``logits.to(float32)`` (and ``div_(T)``), its
  ``log_probs_from_logits``, ``PolicyLoss`` (ppo) + ``kl_coef * masked_mean(compute_approx_kl(k3))``.
- ``torch``: (b) our eager reference (``openrlhf_lopti.algo.policy_loss_from_logits``).
- ``triton``: (c) our fused kernel, value checks read in the call (``check="eager"``: one 4-byte read).
  ``triton-step``: the same with the checks read once after the backward, as a trainer reads them before its
  optimizer step (``check="step"``: no host sync in the call). ``triton-onepass``: the one-pass head (the token
  mean's weights given up front: the forward writes the gradient, the backward scales it), checks at the step.
  On CPU they run under ``TRITON_INTERPRET=1`` (numpy emulation): those rows show they run and agree, their time
  and memory are not kernel figures.
- ``liger``: (d) Liger-Kernel's Triton GRPO loss (``triton_grpo_loss``, loss_type="bnpo", alpha = 0), when
  installed and on CUDA. Its inputs are laid out ``[B, L+1, V]`` as it requires (a separate buffer).
- ``cpp``: our C++ kernel, when built (``benchmarks/bench_cpu_policy_loss.py`` is its own benchmark).

Every row of ours records ``backend_ran``, the backend the op reports it ran (``LossHeadOutput.backend``), and a row
whose backend differs from its label (``auto`` falling back, say) is refused: its status says so and the run exits
1. ``syncs_free`` records whether one ``triton-step`` / ``triton-onepass`` call (forward and backward, its checks
left for the step) made no host sync: on a GPU under ``torch.cuda.set_sync_debug_mode("error")``, on CPU by the ATen
ops it dispatched (none may read a device value on the host).

Each row is one forward + backward of the token-mean loss w.r.t. the logits. Time: median of ``--repeats``
runs after ``--warmup`` (``time.perf_counter``, with ``torch.cuda.synchronize`` on GPU). Peak memory: on
GPU ``torch.cuda.max_memory_allocated`` minus what was allocated before the step (inputs excluded, the
logits gradient included); on CPU the peak of torch's allocation events recorded by ``torch.profiler`` (no
allocator statistics exist there; memory the triton interpreter takes through numpy is not seen).
Bandwidth: the bytes the job must move (logits read twice, the gradient written once, per-token vectors)
over the time; its share of the device's peak needs a known GPU (table below), else it is None. ``+AR``
rows rerun our backends with ``alpha=--ar-alpha``. The issue's goals are evaluated on GPU runs only.

    openrlhf-lopti bench                                         # GPU: N=16384, V=151936, bf16
    openrlhf-lopti bench --device cpu                            # CPU: N=256, V=4096
    python -m openrlhf_lopti bench --n 4096 --v 32000 --backends openrlhf,triton
    python -m benchmarks.bench_policy_loss                       # the same, from a source checkout
"""

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command
from openrlhf_lopti.algo import check_options


def default_results_dir() -> Path:
    """``benchmarks/results`` of the source checkout this package runs from (where benchmarks/RESULTS.md's JSON
    files live), else ``bench_results`` in the current folder (an installed package has no benchmarks/)."""
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    return benchmarks / "results" if (benchmarks / "bench_policy_loss.py").is_file() else Path("bench_results")


RESULTS_DIR = default_results_dir()
ALL_BACKENDS = ("openrlhf", "torch", "triton", "triton-step", "triton-onepass", "liger", "cpp")
OURS = ("torch", "triton", "triton-step", "triton-onepass", "cpp")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Peak memory bandwidth in bytes/s, by a substring of torch.cuda.get_device_name (first match wins).
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM (HBM3); "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-40GB", 1.555e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("A100", 2.0e12),
)
# The issues' goals on an H100 (benchmarks/RESULTS.md; issue 44 for the last three): measured on our fastest row.
GOALS = {
    "speedup_vs_openrlhf": 5.0,
    "memory_reduction_vs_openrlhf": 4.0,
    "speedup_vs_liger": 1.5,
    "bandwidth_share_of_peak": 0.85,
    "ar_cost_fraction": 0.01,
    "share_of_one_pass_floor": 0.8,
}


@dataclass
class Config:
    n: int
    v: int
    dtype: torch.dtype
    device: str
    seq_len: int
    keep_fraction: float
    alpha: float
    ar_alpha: float
    kl_coef: float
    eps_low: float
    eps_high: float
    temperature: float
    seed: int


def make_inputs(cfg: Config) -> dict:
    """Random GRPO-like inputs: per-sequence advantages, old/ref log-probs near the current policy.

    Built ``1024`` rows at a time so no fp32 ``[N, V]`` temporary exists (the peak stays the logits).
    Shapes: ``logits [N, V]``, every other tensor ``[N]``; ``N = B * seq_len`` (``B`` sequences).
    """
    g = torch.Generator().manual_seed(cfg.seed)
    n, v, device = cfg.n, cfg.v, cfg.device
    g_logits = torch.Generator(device=device).manual_seed(cfg.seed)  # on the device: fast at 16384 x 151936
    logits = torch.empty(n, v, dtype=cfg.dtype, device=device)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    logp = torch.empty(n, device=device)
    for start in range(0, n, 1024):
        stop = min(n, start + 1024)
        rows = (torch.randn(stop - start, v, generator=g_logits, device=device) * 2.0).to(cfg.dtype)
        logits[start:stop] = rows
        lsm = torch.log_softmax(rows.float() / cfg.temperature, -1)
        logp[start:stop] = lsm.gather(-1, labels[start:stop, None]).squeeze(-1)
        del rows, lsm
    b = n // cfg.seq_len
    adv_seq = torch.randn(b, generator=g)
    # Right padding: each sequence keeps its first round(keep_fraction * L) tokens, at least one.
    kept = max(1, round(cfg.keep_fraction * cfg.seq_len))
    mask = (torch.arange(cfg.seq_len)[None, :] < kept).expand(b, -1).reshape(n)
    return {
        "logits": logits,
        "labels": labels,
        "old_log_probs": (logp + (torch.randn(n, generator=g) * 0.2).to(device)).clamp(max=0.0),  # log-probs: <= 0
        "ref_log_probs": logp + (torch.randn(n, generator=g) * 0.3).to(device),
        "advantages": adv_seq.repeat_interleave(cfg.seq_len).to(device),
        "advantages_per_sequence": adv_seq.to(device),
        "mask": mask.to(device),
    }


def required_bytes(cfg: Config, n_kept: int, reads: int = 2) -> int:
    """Bytes an implementation moves: kept rows' logits read ``reads`` times (2: forward and backward; 1: the
    one-pass floor, each row read once while its gradient is written), the gradient written once (all rows), and
    per token: label 8, old/ref log-prob and advantage 4 each, mask 1, loss 4."""
    element = torch.finfo(cfg.dtype).bits // 8
    return (reads * n_kept + cfg.n) * cfg.v * element + cfg.n * (8 + 4 + 4 + 4 + 1 + 4)


def peak_bandwidth(device_name: str) -> Optional[float]:
    """Peak memory bandwidth (bytes/s) of a known GPU from its name, else None."""
    for key, value in PEAK_BANDWIDTH:
        if key in device_name:
            return value
    return None


# --------------------------------------------------------------------------------------------- backends
def _openrlhf_functions() -> dict:
    # On a CPU install openrlhf.models needs our flash-attn stand-ins to import (no-op on a GPU install). Not when a
    # flash_attn module is loaded already: benchmarks/gpu_steps.py registers the stand-ins from their file on an
    # image without Ray, where importing openrlhf_lopti.openrlhf (it needs Ray) would lose the row.
    if "flash_attn" not in sys.modules:
        from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

        install_cpu_stubs()
    from openrlhf.models.loss import PolicyLoss
    from openrlhf.models.utils import compute_approx_kl, log_probs_from_logits, masked_mean

    return dict(PolicyLoss=PolicyLoss, kl=compute_approx_kl, log_probs=log_probs_from_logits, mean=masked_mean)


def _flash_attn_cross_entropy() -> bool:
    """Whether OpenRLHF's ``log_probs_from_logits`` will take flash-attn's Triton cross-entropy (fp32 logits)."""
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # noqa: F401
    except ImportError:
        return False
    return True


def _step_openrlhf(cfg: Config, data: dict) -> Callable:
    fns = _openrlhf_functions()
    policy_loss = fns["PolicyLoss"](clip_eps_low=cfg.eps_low, clip_eps_high=cfg.eps_high)
    mask = data["mask"].float()

    def step(logits):
        # openrlhf/models/actor.py: upcast the whole [N, V] to fp32, scale in place, then log-probs.
        logits32 = logits.to(torch.float32)
        if cfg.temperature != 1.0:
            logits32.div_(cfg.temperature)
        log_probs = fns["log_probs"](logits32, data["labels"]) * mask
        loss = policy_loss(log_probs, data["old_log_probs"], data["advantages"], action_mask=mask)[0]
        kl = fns["kl"](log_probs, data["ref_log_probs"], kl_estimator="k3")
        loss = loss + cfg.kl_coef * fns["mean"](kl, mask, dim=None)
        loss.backward()
        return loss.detach()

    return step


def _step_ours(cfg: Config, data: dict, name: str, alpha: float, ran: list, read_checks: bool = True) -> Callable:
    """One step of our variant ``name`` (``<backend>[-step|-onepass]``); appends the backend that ran to ``ran``.
    ``read_checks=False``: a ``step``-policy variant leaves its value checks unread (the one host read a trainer
    makes before its optimizer step, not part of the call whose syncs :func:`sync_free` counts)."""
    from openrlhf_lopti.ops import StepChecks, fused_policy_loss

    backend, _, variant = name.partition("-")
    check = "eager" if not variant else "step"
    tokens = data["mask"].sum()
    weights = data["mask"].float() / tokens if variant == "onepass" else None

    def step(logits):
        checks = StepChecks()
        out = fused_policy_loss(
            logits, data["labels"], data["old_log_probs"], data["advantages"], data["mask"],
            ref_log_probs=data["ref_log_probs"], alpha=alpha, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
            kl_coef=cfg.kl_coef, kl_estimator="k3", temperature=cfg.temperature, backend=backend, check=check,
            loss_weights=weights,
        )  # fmt: skip
        checks.add(out.status, "the benchmark's step")
        loss = out.reduced if weights is not None else out.loss.sum() / tokens
        loss.backward()
        if check == "step" and read_checks:
            checks.raise_if_bad()  # what a trainer reads before its optimizer step
        ran.append(out.backend)
        return loss.detach()

    return step


# ATen ops that copy a device value to the host (a sync on a GPU): .item() / int() / bool() / .tolist() reach
# _local_scalar_dense; nonzero sizes its output from the data; equal and is_nonzero answer on the host.
HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item"})


class _HostReads(TorchDispatchMode):
    """The ATen ops dispatched inside it that read a device value on the host (:data:`HOST_READS`)."""

    def __init__(self):
        super().__init__()
        self.reads: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_READS:
            self.reads.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def sync_free(step: Callable, leaf: torch.Tensor) -> bool:
    """Whether one ``step`` (forward and backward) makes no host sync. On CUDA: it runs under
    ``torch.cuda.set_sync_debug_mode("error")`` (every sync the runtime makes raises). Elsewhere: no ATen op it
    dispatches reads a device value on the host (:data:`HOST_READS`: what would sync on a GPU; a Triton kernel
    launched under the interpreter is no ATen op and reads nothing)."""
    leaf.grad = None
    if not leaf.is_cuda:
        with _HostReads() as ops:
            step(leaf)
        return not ops.reads
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(leaf)
    except RuntimeError as error:
        if "synchroniz" not in str(error):
            raise
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return True


def _liger_loss_fn() -> Callable:
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    return triton_grpo_loss


def _step_liger(cfg: Config, data: dict, logits3d: torch.Tensor) -> Callable:
    grpo_loss = _liger_loss_fn()
    b, length = cfg.n // cfg.seq_len, cfg.seq_len
    as2d = lambda x: x.reshape(b, length).contiguous()  # noqa: E731
    old, ref, ids = as2d(data["old_log_probs"]), as2d(data["ref_log_probs"]), as2d(data["labels"])
    mask = as2d(data["mask"].to(torch.int32))

    def step(_logits):
        # Same math at alpha = 0 except Liger's k3 KL is not clamped to [-10, 10] (inactive on these inputs).
        loss, _ = grpo_loss(
            logits3d, old, ref, ids, data["advantages_per_sequence"], mask, temperature=cfg.temperature,
            beta=cfg.kl_coef, eps_low=cfg.eps_low, eps_high=cfg.eps_high, inplace=False, loss_type="bnpo",
            reduce=True,
        )  # fmt: skip
        loss.backward()
        return loss.detach()

    return step


# ------------------------------------------------------------------------------------------- measuring
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _measure_peak(step: Callable, leaf: torch.Tensor, device: str) -> tuple:
    """``(peak bytes above the pre-step level, method)`` for one step."""
    leaf.grad = None
    if device.startswith("cuda"):
        _sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(leaf)
        _sync(device)
        return torch.cuda.max_memory_allocated() - base, "torch.cuda.max_memory_allocated"
    # CPU: torch has no allocator statistics there; replay the profiler's allocation events in time order.
    # Each op's own (self) allocations count at its start, so a buffer freed inside the op that made it is
    # netted out: a lower bound of the true peak, exact for everything that outlives its op.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step(leaf)
    events = sorted(
        (e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage
    )
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak, "torch.profiler allocation events (CPU allocator)"


def _time(step: Callable, leaf: torch.Tensor, device: str, warmup: int, repeats: int) -> tuple:
    """``(median seconds, min seconds, loss)`` of ``repeats`` steps after ``warmup`` (gradients reset)."""
    for _ in range(warmup):
        leaf.grad = None
        step(leaf)
    times = []
    loss = None
    for _ in range(repeats):
        leaf.grad = None
        _sync(device)
        start = time.perf_counter()
        loss = step(leaf)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), float(loss)


def run_backend(name: str, cfg: Config, data: dict, args, alpha: float) -> dict:
    """One row of the table; failures (missing package, OOM, no device) become a ``status`` string."""
    row = {"backend": name, "alpha": alpha, "status": "ok", "note": None}
    if name == "liger":
        try:
            _liger_loss_fn()
        except ImportError:
            return dict(row, status="not installed (pip install liger-kernel)")
        if not cfg.device.startswith("cuda"):
            return dict(row, status="n/a: Liger-Kernel's kernels need CUDA")
    if name == "cpp":
        from openrlhf_lopti.ops.cpp_policy_loss import cpp_available

        if not cpp_available():
            return dict(row, status="n/a: C++ extension not built")
    if name == "openrlhf":
        row["note"] = "log-probs: " + (
            "flash-attn Triton cross-entropy" if _flash_attn_cross_entropy() else "torch fallback, no flash-attn"
        )
    if name.startswith("triton") and not cfg.device.startswith("cuda"):
        row["note"] = "TRITON_INTERPRET=1 (numpy emulation on CPU): time and memory are not kernel figures"

    leaf = data["logits"].detach().requires_grad_(True)
    extra = None
    ran: list = []
    try:
        if name == "openrlhf":
            step = _step_openrlhf(cfg, data)
        elif name == "liger":
            b = cfg.n // cfg.seq_len
            extra = torch.zeros(b, cfg.seq_len + 1, cfg.v, dtype=cfg.dtype, device=cfg.device)
            extra[:, : cfg.seq_len] = data["logits"].view(b, cfg.seq_len, cfg.v)
            leaf = extra.requires_grad_(True)
            step = _step_liger(cfg, data, leaf)
        else:
            step = _step_ours(cfg, data, name, alpha, ran)
        median, best, loss = _time(step, leaf, cfg.device, args.warmup, args.repeats)
        peak, method = _measure_peak(step, leaf, cfg.device)
        if name in ("triton-step", "triton-onepass"):  # the step policy: the call itself reads nothing
            row["syncs_free"] = sync_free(_step_ours(cfg, data, name, alpha, [], read_checks=False), leaf)
    except ImportError as error:  # an installed package without that backend's extra (openrlhf, triton)
        return dict(row, status=f"not installed ({error.name or error})")
    except torch.cuda.OutOfMemoryError:
        return dict(row, status="out of memory")
    except (RuntimeError, TypeError) as error:  # e.g. an incompatible liger-kernel version
        return dict(row, status=f"failed: {type(error).__name__}: {str(error)[:200]}")
    finally:
        leaf.grad = None
        del extra
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
    row.update(time_s=median, time_min_s=best, loss=loss, peak_bytes=peak, memory_method=method)
    if name in OURS:
        label = name.partition("-")[0]
        row["backend_ran"] = sorted(set(ran))
        if row["backend_ran"] != [label]:  # a figure must say what ran: a fallback is not this row's figure
            return dict(row, status=f"refused: the op ran {row['backend_ran']}, this row is labelled {label}")
    else:  # a peer's row calls that library's own op, with no fallback of ours on its way
        row["backend_ran"] = [name]
    return row


def copy_bandwidth(device: str, gib: float = 4.0, repeats: int = 10) -> Optional[float]:
    """Bytes/s a device-to-device copy of ``gib`` GiB moves (read + write counted), median of ``repeats`` after a
    warm-up: the ceiling this GPU reaches in practice (an H200's datasheet says 4.8 TB/s, a copy moved ~4.3 here),
    None off CUDA."""
    if not device.startswith("cuda"):
        return None
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * int(gib * 2**30) / statistics.median(times)


def summarize(rows: list, cfg: Config, device_name: str, n_kept: int, copy_Bps: Optional[float] = None) -> dict:
    """Bandwidth per row and the issue's goals (ratios against rows (a) and (d), AR overhead). The goals' shares
    are of the datasheet's bandwidth (:data:`PEAK_BANDWIDTH`, as the issue states them); ``copy_Bps``
    (:func:`copy_bandwidth`) adds each row's share of what a plain copy moved on this GPU."""
    needed = required_bytes(cfg, n_kept)
    peak_bw = peak_bandwidth(device_name) if cfg.device.startswith("cuda") else None
    for row in rows:
        if row["status"] == "ok":
            row["bandwidth_Bps"] = needed / row["time_s"]
            row["bandwidth_share"] = None if peak_bw is None else row["bandwidth_Bps"] / peak_bw
            row["bandwidth_share_of_copy"] = None if copy_Bps is None else row["bandwidth_Bps"] / copy_Bps
    ok = {(r["backend"], r["alpha"]): r for r in rows if r["status"] == "ok"}
    base = ok.get(("openrlhf", cfg.alpha))
    ours = [ok[(name, cfg.alpha)] for name in ("triton", "triton-step", "triton-onepass") if (name, cfg.alpha) in ok]
    kernel = min(ours, key=lambda r: r["time_s"]) if ours else None  # our fastest Triton variant
    liger = ok.get(("liger", cfg.alpha))
    kernel_ar = ok.get((kernel["backend"], cfg.ar_alpha)) if kernel else None
    floor_s = None if peak_bw is None else required_bytes(cfg, n_kept, reads=1) / peak_bw
    if not cfg.device.startswith("cuda"):  # CPU figures say nothing about the GPU goals
        base = kernel = liger = kernel_ar = None
    measured = {
        "speedup_vs_openrlhf": base["time_s"] / kernel["time_s"] if base and kernel else None,
        "memory_reduction_vs_openrlhf": (
            base["peak_bytes"] / kernel["peak_bytes"]
            if base and kernel and base["peak_bytes"] and kernel["peak_bytes"]
            else None
        ),
        "speedup_vs_liger": liger["time_s"] / kernel["time_s"] if liger and kernel else None,
        "bandwidth_share_of_peak": kernel.get("bandwidth_share") if kernel else None,
        "ar_cost_fraction": (
            kernel_ar["time_s"] / kernel["time_s"] - 1.0 if kernel and kernel_ar and kernel_ar is not kernel else None
        ),
        "share_of_one_pass_floor": floor_s / kernel["time_s"] if kernel and floor_s else None,
    }
    goals = {}
    for key, target in GOALS.items():
        value = measured[key]
        met = None if value is None else (value < target if key == "ar_cost_fraction" else value >= target)
        goals[key] = {"target": target, "measured": value, "met": met}
    return {"required_bytes": needed, "peak_bandwidth_Bps": peak_bw, "one_pass_floor_s": floor_s,
            "copy_bandwidth_Bps": copy_Bps,
            "one_pass_floor_at_copy_s": None if copy_Bps is None else required_bytes(cfg, n_kept, reads=1) / copy_Bps,
            "fastest_triton_variant": kernel["backend"] if kernel else None, "goals": goals}


def format_table(rows: list, summary: dict) -> str:
    header = (f"{'row':<15} {'ran':<7} {'alpha':>5} {'fwd+bwd ms':>11} {'peak MiB':>9} {'GB/s':>8} {'% peak':>7} "
              f"{'loss':>11}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['backend']:<15} {'':<7} {r['alpha']:>5} {r['status']}")
            continue
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        share = "n/a" if r.get("bandwidth_share") is None else f"{100 * r['bandwidth_share']:.1f}"
        ran = ",".join(r.get("backend_ran", [r["backend"]]))
        syncs = {True: "; no host sync", False: "; HOST SYNC"}.get(r.get("syncs_free"), "")
        note = "; ".join(x for x in (r["note"], syncs.lstrip("; ")) if x)
        lines.append(
            f"{r['backend']:<15} {ran:<7} {r['alpha']:>5} {1e3 * r['time_s']:>11.3f} {peak:>9} "
            f"{r['bandwidth_Bps'] / 1e9:>8.2f} {share:>7} {r['loss']:>11.6f}" + (f"   ({note})" if note else "")
        )
    lines.append("")
    if summary.get("fastest_triton_variant"):
        floor = summary.get("one_pass_floor_s")
        lines.append(f"our fastest Triton row: {summary['fastest_triton_variant']}"
                     + (f"; the one-pass floor here: {1e3 * floor:.3f} ms" if floor else ""))  # fmt: skip
    if summary.get("copy_bandwidth_Bps"):
        fastest = next((r for r in rows if r["status"] == "ok" and r["backend"] == summary["fastest_triton_variant"]),
                       None)  # fmt: skip
        lines.append(f"a device-to-device copy moved {summary['copy_bandwidth_Bps'] / 1e9:.0f} GB/s; at that rate the "
                     f"one-pass floor is {1e3 * summary['one_pass_floor_at_copy_s']:.3f} ms"
                     + (f", our fastest row {100 * fastest['bandwidth_share_of_copy']:.1f}% of the copy's rate"
                        if fastest else ""))  # fmt: skip
    for key, goal in summary["goals"].items():
        value = goal["measured"]
        shown = "n/a" if value is None else f"{value:.3f}"
        verdict = {None: "not measured (GPU goal)", True: "met", False: "NOT met"}[goal["met"]]
        lines.append(f"goal {key:<30} target {goal['target']:<6} measured {shown:<8} {verdict}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI
COMMAND = "openrlhf-lopti bench"
SEED_MAX = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


def check_numbers(args: argparse.Namespace) -> None:
    """Raise :class:`UserError` naming the first flag whose value the benchmark (or the loss it times) cannot take.

    Called on the flags as given, before any default is filled in or any input built; the loss's options by the
    loss's own check (``algo.check_options``), its message naming the flag.
    """
    for flag in ("n", "v", "seq_len", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be an integer >= 1, got {value}")
    if args.warmup is not None and args.warmup < 0:
        raise UserError(f"--warmup must be an integer >= 0, got {args.warmup}")
    if not 0 <= args.seed <= SEED_MAX:
        raise UserError(f"--seed must be an integer in [0, 2**64 - 1], got {args.seed}")
    if not 0.0 < args.keep_fraction <= 1.0:  # also refuses NaN
        raise UserError(f"--keep-fraction must be in (0, 1], got {args.keep_fraction}")
    for flag, alpha in (("--alpha", args.alpha), ("--ar-alpha", args.ar_alpha)):
        try:
            check_options(alpha, args.eps_low, args.eps_high, None, args.kl_coef, "k3", args.temperature)
        except ValueError as e:  # "eps_low must be ..." -> "--eps-low must be ..."; alpha's under its own flag
            name, rest = str(e).split(" ", 1)
            raise UserError(f"{flag if name == 'alpha' else '--' + name.replace('_', '-')} {rest}") from None


def parse_args(argv: Optional[list], prog: str = COMMAND) -> argparse.Namespace:
    """The flags of ``argv``, checked and with the device's defaults filled in; :class:`UserError` (one line) for
    a bad one."""
    parser = ArgumentParser(
        prog=prog,
        description="The fused policy loss against OpenRLHF 0.11.2's actor path, side by side on the same inputs "
        "in one run: one forward + backward of the loss head per backend, time and peak memory.",
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--n", type=int, default=None, help="tokens N (default: 16384 on GPU, 256 on CPU)")
    parser.add_argument("--v", type=int, default=None, help="vocab V (default: 151936 on GPU, 4096 on CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="logits dtype")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: min(1024, N))")
    parser.add_argument("--keep-fraction", type=float, default=1.0, help="unmasked share of each sequence")
    parser.add_argument("--backends", default=None, help=f"comma-separated subset of {','.join(ALL_BACKENDS)}")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (default: 10 GPU, 3 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default: 2 GPU, 1 CPU)")
    parser.add_argument("--alpha", type=float, default=0.0, help="AR alpha of the main rows (0: Liger's math)")
    parser.add_argument("--ar-alpha", type=float, default=0.3, help="alpha of the +AR rows (0: no +AR rows)")
    parser.add_argument("--kl-coef", type=float, default=0.001)
    parser.add_argument("--eps-low", type=float, default=0.2)
    parser.add_argument("--eps-high", type=float, default=0.28)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS_DIR), help=f"folder for the JSON (default {RESULTS_DIR})")
    parser.add_argument("--json", default=None, help="exact JSON path (overrides --out)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing JSON file")
    args = parser.parse_args(argv)
    check_numbers(args)

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", args.device):
        raise UserError(f"--device must be cpu, cuda or cuda:<index>, got {args.device!r}")
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available")
    if gpu and ":" in args.device and int(args.device.partition(":")[2]) >= torch.cuda.device_count():
        parser.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    # `is None`, not `or`: a 0 given was refused above, never silently replaced by the default
    args.n = args.n if args.n is not None else (16384 if gpu else 256)
    args.v = args.v if args.v is not None else (151936 if gpu else 4096)
    args.seq_len = args.seq_len if args.seq_len is not None else min(1024, args.n)
    args.repeats = args.repeats if args.repeats is not None else (10 if gpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    if args.n % args.seq_len:
        parser.error(f"--n ({args.n}) must be a multiple of --seq-len ({args.seq_len})")
    default = ("openrlhf", "torch", "triton", "triton-step", "triton-onepass", "liger") + (() if gpu else ("cpp",))
    args.backends = tuple(args.backends.split(",")) if args.backends else default
    unknown = set(args.backends) - set(ALL_BACKENDS)
    if unknown:
        parser.error(f"--backends: unknown {sorted(unknown)}; choose from {ALL_BACKENDS}")
    if args.json is None:
        name = f"policy_loss_{'gpu' if gpu else 'cpu'}_n{args.n}_v{args.v}_{args.dtype}.json"
        args.json = str(Path(args.out) / name)
    if Path(args.json).exists() and not args.overwrite:
        parser.error(f"{args.json} exists: pass --overwrite to replace it, or --json / --out elsewhere")
    return args


def main(argv: Optional[list] = None, prog: str = COMMAND) -> int:
    """Run the benchmark with command-line ``argv`` (``--help`` lists them); prints the table, writes the JSON.

    As ``openrlhf-lopti bench`` (``argv`` given, ``prog`` the default) a bad flag raises :class:`UserError`, which
    the command reports in one line. As an entry point of its own (no ``argv``: ``sys.argv`` is read; or another
    ``prog``: ``benchmarks/bench_policy_loss.py``) it reports the error itself: one line ``<prog>: error: ...`` on
    stderr, then ``SystemExit(2)`` as argparse's exit did (the traceback instead with ``--debug``).
    """
    if argv is not None and prog == COMMAND:
        return _run(argv, prog)
    code = run_command(prog, lambda words: _run(words, prog), sys.argv[1:] if argv is None else list(argv))
    if code == 2:
        raise SystemExit(2)
    return code


def _run(argv: list, prog: str) -> int:
    args = parse_args(argv, prog)
    gpu = args.device.startswith("cuda")
    if not gpu and any(name.startswith("triton") for name in args.backends):
        # Must precede the first import of the kernels module (fused_policy_loss imports it lazily).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cfg = Config(
        n=args.n, v=args.v, dtype=DTYPES[args.dtype], device=args.device, seq_len=args.seq_len,
        keep_fraction=args.keep_fraction, alpha=args.alpha, ar_alpha=args.ar_alpha, kl_coef=args.kl_coef,
        eps_low=args.eps_low, eps_high=args.eps_high, temperature=args.temperature, seed=args.seed,
    )  # fmt: skip
    device_name = torch.cuda.get_device_name() if gpu else (platform.processor() or platform.machine())
    threads = "" if gpu else f", {torch.get_num_threads()} CPU threads"
    print(f"policy loss benchmark: N={cfg.n} V={cfg.v} {args.dtype} on {args.device} ({device_name}){threads}")
    data = make_inputs(cfg)
    n_kept = int(data["mask"].sum())

    rows = []
    for name in args.backends:
        rows.append(run_backend(name, cfg, data, args, cfg.alpha))
        if name in OURS and args.ar_alpha != cfg.alpha and args.ar_alpha > 0:
            rows.append(run_backend(name, cfg, data, args, args.ar_alpha))
        print(f"  {name}: {rows[-1]['status']}", flush=True)
    summary = summarize(rows, cfg, device_name, n_kept, copy_bandwidth(args.device))
    print(format_table(rows, summary))

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # the package installed without triton: the other rows still ran
        triton_version = None
    report = {
        "benchmark": "bench_policy_loss",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": args.device,
        "device_name": device_name,
        "versions": {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()},
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(cfg).items()},
        "kept_tokens": n_kept,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rows": rows,
        **summary,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    refused = [r["backend"] for r in rows if r["status"].startswith("refused")]
    if refused:
        print(f"refused rows (the op ran another backend than their label): {', '.join(refused)}", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())  # no argv: main reports a bad flag in one line itself
