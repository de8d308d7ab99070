"""``openrlhf-lopti check-gpu``: the Triton kernel's self-check on this GPU at a wide grid, plus the loss-head
benchmark, as one report to paste into an issue.

The self-check is ``ops.triton.self_check`` (what ``--actor.fused_loss auto`` runs on a small grid before it uses
Triton on a device), here on its wide grid, which also goes past 65,535 rows and 2^31 logits; a case that does not
fit in the GPU's free memory is reported as skipped with what it needs. The benchmark is
:mod:`openrlhf_lopti.cli.bench_loss_head` (``openrlhf-lopti bench``), OpenRLHF's eager loss head against our
torch reference and Triton kernel on the same inputs.
"""

import json
import platform
import re
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import torch

from openrlhf_lopti.errors import ArgumentParser, UserError

BENCH_SEQ_LEN = 1024  # tokens per sequence of the benchmark; N up to it is one sequence


def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML, or a driver it cannot read: the report says so
        return "unknown"


def _benchmark(device: str, n: int, v: int) -> List[str]:
    """Report lines of the loss-head benchmark on ``device`` at ``[n, v]`` bf16 logits (ms and GB per backend, and
    the ratios against OpenRLHF's)."""
    from openrlhf_lopti.cli.bench_loss_head import main as bench

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        flags = ["--device", device, "--n", str(n), "--v", str(v), "--seq-len", str(min(BENCH_SEQ_LEN, n))]
        flags += ["--dtype", "bf16", "--ar-alpha", "0"]
        bench([*flags, "--backends", "openrlhf,torch,triton", "--json", str(path)])
        rows = json.loads(path.read_text())["rows"]
    lines = [f"benchmark: N={n} V={v} bf16, one forward + backward of the loss head"]
    base = next((r for r in rows if r["backend"] == "openrlhf" and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"  {row['backend']:<9} {row['status']}")
            continue
        ms, gb = row["time_s"] * 1e3, row["peak_bytes"] / 1e9
        vs = ""
        if base is not None and row is not base:
            vs = f"  ({base['time_s'] / row['time_s']:.2f}x faster, {base['peak_bytes'] / max(row['peak_bytes'], 1):.2f}x less memory than openrlhf)"
        lines.append(f"  {row['backend']:<9} {ms:8.2f} ms  {gb:6.2f} GB{vs}")
    return lines


def main(argv: Optional[list] = None) -> int:
    parser = ArgumentParser(
        prog="openrlhf-lopti check-gpu",
        description="Check the Triton kernel against the torch reference on this GPU (forward and backward, "
        "fp32 / bf16 / fp16, V up to 151936, -inf columns, temperatures, more than 65535 rows and 2^31 logits "
        "where they fit in free memory) and benchmark the loss head; prints one report to paste into an issue.",
    )
    parser.add_argument("--device", default="cuda", help="the CUDA device to check (default: cuda, i.e. the current one)")
    parser.add_argument("--no-bench", action="store_true", help="the self-check only")
    parser.add_argument("--quick", action="store_true", help="the quick cases only (what backend='auto' checks)")
    parser.add_argument("--bench-n", type=int, default=8192, help="tokens of the benchmark (default 8192)")
    parser.add_argument("--bench-v", type=int, default=151936, help="vocabulary of the benchmark (default 151936)")
    args = parser.parse_args(argv)
    # checked before the self-check (minutes on a wide grid), so a bad flag does not cost them
    if not re.fullmatch(r"cuda(:[0-9]+)?", args.device):
        raise UserError(f"--device must be cuda or cuda:<index>, got {args.device!r}")
    for flag, value in (("--bench-n", args.bench_n), ("--bench-v", args.bench_v)):
        if value < 1:
            raise UserError(f"{flag} must be an integer >= 1, got {value}")
    if args.bench_n > BENCH_SEQ_LEN and args.bench_n % BENCH_SEQ_LEN:
        raise UserError(f"--bench-n must be at most {BENCH_SEQ_LEN} or a multiple of it (the benchmark's tokens per "
                        f"sequence), got {args.bench_n}")  # fmt: skip
    if not torch.cuda.is_available():
        print(f"check-gpu: no CUDA device visible to torch {torch.__version__} on this machine: nothing to check.")
        return 0

    from openrlhf_lopti.ops.triton.self_check import QUICK_CASES, WIDE_CASES, run_self_check

    device = torch.device(args.device)
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # the report says why instead of a traceback
        triton_version = f"not importable ({type(exc).__name__}: {exc})"
    properties = torch.cuda.get_device_properties(device)
    lines = [
        "openrlhf-lopti check-gpu report",
        f"device: {properties.name} (sm_{properties.major}{properties.minor}, {properties.total_memory / 2**30:.0f} GiB)",
        f"driver: {_driver_version()}, CUDA runtime {torch.version.cuda}",
        f"torch {torch.__version__}, triton {triton_version}, python {platform.python_version()}",
    ]
    grid = QUICK_CASES if args.quick else WIDE_CASES
    result = run_self_check(device, grid)
    cases = f"{len(grid)} cases, {len(result.skipped)} skipped"  # the skipped ones, and why: in the summary
    lines.append(f"self-check ({cases}, forward and backward vs the torch reference): {result.summary()}")
    if not args.no_bench:
        lines += _benchmark(args.device, args.bench_n, args.bench_v)
    print("\n".join(lines))
    return 0 if result.ok else 1


if __name__ == "__main__":
    from openrlhf_lopti.errors import run_command

    sys.exit(run_command("openrlhf-lopti check-gpu", main, sys.argv[1:]))
