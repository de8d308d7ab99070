"""CPU benchmark: the C++ fused policy loss (``backend="cpp"``) against the eager torch reference
(``backend="torch"``), side by side in one run: forward + backward time and peak memory.

Each (dtype, backend) runs in a fresh subprocess so peak memory is not shared between them. Peak memory is
the growth of the process's peak resident set over its resident set once the inputs exist (Linux: the
peak mark is reset there through /proc/self/clear_refs and read back as VmHWM; elsewhere ru_maxrss, with
inputs built in row blocks so no temporary exceeds that baseline). Time is the median of ``--repeats``
forward+backward passes after one warm-up, with ``torch.set_num_threads(os.cpu_count())``.

    python benchmarks/bench_cpu_policy_loss.py                       # N=2048, V=32000, fp32 and bf16
    python benchmarks/bench_cpu_policy_loss.py --n 256 --v 4096 --repeats 3
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Optional

BACKENDS = ("torch", "cpp")
DTYPES = ("float32", "bfloat16")
# A realistic loss head: AR alpha 0.3, k3 KL at the paper's coefficient, clip-higher, sampling temperature
# 0.7, entropy computed for logging (not differentiated); every row unmasked (the cpp kernel would skip
# masked rows, which would flatter it).
LOSS_OPTIONS = dict(alpha=0.3, eps_low=0.2, eps_high=0.28, kl_coef=0.001, kl_estimator="k3", temperature=0.7,
                    return_entropy=True)  # fmt: skip


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _start_peak_window() -> tuple:
    """Start measuring peak memory from now: ``(method, baseline_bytes)`` for :func:`_peak_growth`.

    Linux: reset the kernel's peak-RSS mark (``echo 5 > /proc/self/clear_refs``), baseline = current RSS.
    Elsewhere: ``ru_maxrss`` so far (a high-water mark that cannot be reset, so a lower bound of growth).
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return "VmHWM", _status_kib("VmRSS") * 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return "ru_maxrss", peak if sys.platform == "darwin" else peak * 1024


def _peak_growth(method: str, baseline: int) -> int:
    if method == "VmHWM":
        return _status_kib("VmHWM") * 1024 - baseline
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak if sys.platform == "darwin" else peak * 1024) - baseline


def _make_inputs(n: int, v: int, dtype, seed: int = 0, block: int = 64) -> dict:
    """Inputs filled ``block`` rows at a time, so the only large allocation is the logits themselves."""
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = torch.empty(n, v, dtype=dtype)
    labels = torch.empty(n, dtype=torch.long)
    logp = torch.empty(n)
    for start in range(0, n, block):
        rows = (torch.randn(min(block, n - start), v, generator=g) * 3.0).to(dtype)
        logits[start : start + len(rows)] = rows
        labels[start : start + len(rows)] = torch.randint(0, v, (len(rows),), generator=g)
        lsm = torch.log_softmax(rows.float() / LOSS_OPTIONS["temperature"], -1)
        logp[start : start + len(rows)] = lsm.gather(-1, labels[start : start + len(rows), None]).squeeze(-1)
        del rows, lsm
    return dict(
        logits=logits,
        labels=labels,
        old_log_probs=(logp + torch.randn(n, generator=g) * 0.3).clamp(max=0.0),  # log-probs are <= 0
        advantages=torch.randn(n, generator=g),
        mask=torch.ones(n, dtype=torch.bool),
        ref_log_probs=logp + torch.randn(n, generator=g) * 0.5,
    )


def _worker(backend: str, dtype_name: str, n: int, v: int, repeats: int) -> dict:
    import gc

    import torch

    from openrlhf_lopti.ops import fused_policy_loss

    torch.set_num_threads(os.cpu_count() or 1)
    inputs = _make_inputs(n, v, getattr(torch, dtype_name))
    logits = inputs.pop("logits").requires_grad_(True)
    gc.collect()
    method, baseline = _start_peak_window()

    ran = set()

    def step() -> float:
        start = time.perf_counter()
        out = fused_policy_loss(logits, backend=backend, **inputs, **LOSS_OPTIONS)
        ran.add(out.backend)
        objective = out.loss.sum() / n  # token mean; entropy and kl are only logged
        (grad,) = torch.autograd.grad(objective, logits)
        elapsed = time.perf_counter() - start
        del out, objective, grad
        return elapsed

    step()  # warm-up (first-call dispatch, page faults of the allocator)
    times = [step() for _ in range(repeats)]
    result = dict(backend=backend, dtype=dtype_name, n=n, v=v, median_s=statistics.median(times),
                  times_s=times, peak_mib=_peak_growth(method, baseline) / 2**20, peak_method=method,
                  logits_mib=logits.numel() * logits.element_size() / 2**20, threads=torch.get_num_threads(),
                  backend_ran=sorted(ran))  # fmt: skip
    if backend == "cpp":
        from openrlhf_lopti.ops.cpp_policy_loss import cpp_isa

        result["isa"] = cpp_isa()
    return result


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def run(n: int, v: int, dtypes: list, repeats: int) -> list:
    """Run every (dtype, backend) in its own subprocess; returns their result dicts."""
    results = []
    for dtype in dtypes:
        for backend in BACKENDS:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", backend, "--dtypes", dtype,
                   "--n", str(n), "--v", str(v), "--repeats", str(repeats)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"worker {backend}/{dtype} failed:\n{proc.stderr[-2000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def format_table(results: list) -> str:
    """Markdown table: one row per dtype, torch vs cpp side by side, and the ratios."""
    by_key = {(r["dtype"], r["backend"]): r for r in results}
    lines = [
        "| logits dtype | torch fwd+bwd (ms) | cpp fwd+bwd (ms) | speed-up | torch peak (MiB) | cpp peak (MiB) "
        "| memory ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        t, c = by_key[(dtype, "torch")], by_key[(dtype, "cpp")]
        lines.append(
            f"| {dtype} | {t['median_s'] * 1e3:.0f} | {c['median_s'] * 1e3:.0f} | {t['median_s'] / c['median_s']:.1f}x "
            f"| {t['peak_mib']:.0f} | {c['peak_mib']:.0f} | {t['peak_mib'] / max(c['peak_mib'], 1e-9):.1f}x |"
        )
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    """Entry point (``openrlhf-lopti bench``-style): prints the comparison table; 0 on success."""
    from openrlhf_lopti.errors import ArgumentParser, UserError
    from openrlhf_lopti.runs import prepare_out_file

    parser = ArgumentParser(prog="bench_cpu_policy_loss.py", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="tokens (rows of the logits)")
    parser.add_argument("--v", type=int, default=32000, help="vocab size")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--repeats", type=int, default=5, help="timed forward+backward passes per variant")
    parser.add_argument("--json", help="also write the raw results to this file")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("n", "v", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} {getattr(args, name)}: must be an integer >= 1")

    if args.worker:
        print(json.dumps(_worker(args.worker, args.dtypes[0], args.n, args.v, args.repeats)))
        return 0
    # checked before the run (minutes): an existing file is kept unless --overwrite, a folder is refused
    json_path = prepare_out_file(args.json, overwrite=args.overwrite, out_flag="--json") if args.json else None

    start = time.perf_counter()
    results = run(args.n, args.v, args.dtypes, args.repeats)
    refused = [f"{r['backend']}/{r['dtype']} ran {r['backend_ran']}" for r in results if r["backend_ran"] != [r["backend"]]]
    if refused:  # a figure must be the backend it is labelled with (a cpp row that ran torch is not cpp's)
        print(f"refused: {'; '.join(refused)}", file=sys.stderr)
        return 1
    isa = next((r["isa"] for r in results if "isa" in r), "?")
    print(f"CPU: {_cpu_model()}, {os.cpu_count()} cores, torch threads {results[0]['threads']}, cpp ISA {isa}")
    print(f"N={args.n}, V={args.v}, options {LOSS_OPTIONS}, median of {args.repeats} after 1 warm-up")
    print(f"peak = growth of peak RSS over the inputs ({results[0]['peak_method']}), fresh process per variant")
    print(format_table(results))
    print(f"(bench took {time.perf_counter() - start:.0f} s)")
    if json_path is not None:
        try:
            with open(json_path, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=2)
        except OSError as e:  # the folder went away during the run
            raise UserError(f"--json {json_path}: cannot write there ({e.strerror or e})") from None
    return 0


if __name__ == "__main__":
    from openrlhf_lopti.errors import run_command

    sys.exit(run_command("bench_cpu_policy_loss.py", main, sys.argv[1:]))
