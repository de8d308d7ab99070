"""Sweep the Triton policy-loss kernel's launch settings on a GPU: BLOCK_V x num_warps, forward + backward time.

    python -m benchmarks.sweep_triton_launch                       # N=8192, V=151936, bf16, the default grid
    python -m benchmarks.sweep_triton_launch --block-v 2048,4096 --warps 4,8 --json out.json

The kernel reads its launch settings from ``OPENRLHF_LOPTI_TRITON_BLOCK_V`` / ``_NUM_WARPS`` at each call
(``ops/triton/policy_loss.py``, ``_launch_config``), so one process times every setting on the same inputs, the
default first, and checks each against the default's loss and gradient (a setting that changes the result is
reported, not timed as a win). Times are CUDA-event medians; GB/s counts the bytes the job must move (logits read
twice, gradient written once). A measurement, not a test; it needs CUDA.
"""

import argparse
import json
import os
import sys
from typing import List, Optional

import torch

from openrlhf_lopti.ops import fused_policy_loss
from openrlhf_lopti.ops.triton.policy_loss import ENV_BLOCK_V, ENV_NUM_WARPS


def _inputs(n: int, v: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    old = (torch.randn(n, device="cuda", generator=g) * 0.5 - 1.5).clamp(max=0.0)  # log-probs are <= 0
    return dict(
        logits=(torch.randn(n, v, device="cuda", generator=g) * 4).to(dtype),
        labels=torch.randint(0, v, (n,), device="cuda", generator=g),
        old_log_probs=old,
        advantages=torch.randn(n, device="cuda", generator=g),
        mask=torch.ones(n, dtype=torch.bool, device="cuda"),
        ref_log_probs=old + 0.1 * torch.randn(n, device="cuda", generator=g),
    )


def _step(inputs: dict) -> tuple:
    """One forward + backward; ``(loss value, gradient)``."""
    logits = inputs["logits"].detach().requires_grad_(True)
    out = fused_policy_loss(
        logits, inputs["labels"], inputs["old_log_probs"], inputs["advantages"], inputs["mask"],
        ref_log_probs=inputs["ref_log_probs"], alpha=0.3, eps_low=0.2, eps_high=0.28, kl_coef=0.001,
        backend="triton",
    )  # fmt: skip
    out.loss.sum().backward()
    return out.loss.detach().sum(), logits.grad


def _time_ms(inputs: dict, repeats: int) -> float:
    for _ in range(2):
        _step(inputs)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _setting(block_v: Optional[int], warps: Optional[int]) -> None:
    for name, value in ((ENV_BLOCK_V, block_v), (ENV_NUM_WARPS, warps)):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192, help="tokens (rows)")
    p.add_argument("--v", type=int, default=151936, help="vocabulary (columns)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--block-v", default="1024,2048,4096,8192,16384", help="comma-separated BLOCK_V values (powers of 2)")
    p.add_argument("--warps", default="4,8,16", help="comma-separated num_warps values")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_triton_launch: needs a CUDA device")
        return 2
    inputs = _inputs(args.n, args.v, getattr(torch, args.dtype))
    bytes_moved = 3 * args.n * args.v * inputs["logits"].element_size()
    _setting(None, None)
    want_loss, want_grad = _step(inputs)
    rows = [("default", None, None)] + [
        (f"{b}x{w}", int(b), int(w)) for b in args.block_v.split(",") for w in args.warps.split(",")
    ]
    print(f"{torch.cuda.get_device_name()}: N={args.n} V={args.v} {args.dtype}, fwd+bwd median of {args.repeats}")
    print(f"{'BLOCK_V x warps':>16} {'ms':>8} {'GB/s':>8}  result")
    results = []
    for label, block_v, warps in rows:
        _setting(block_v, warps)
        try:
            loss, grad = _step(inputs)
            same = bool(torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-5)) and bool(
                (grad.float() - want_grad.float()).abs().max() <= 1e-2 * want_grad.float().abs().max()
            )
            ms = _time_ms(inputs, args.repeats)
            row = dict(setting=label, block_v=block_v, warps=warps, ms=ms, gbps=bytes_moved / ms / 1e6, same=same)
            print(f"{label:>16} {ms:8.3f} {row['gbps']:8.0f}  {'same' if same else 'DIFFERENT'}")
        except Exception as exc:  # noqa: BLE001 - a setting that does not compile is a row, not the end
            row = dict(setting=label, block_v=block_v, warps=warps, error=f"{type(exc).__name__}: {exc}"[:200])
            print(f"{label:>16} {'-':>8} {'-':>8}  {row['error']}")
        results.append(row)
        torch.cuda.empty_cache()
    _setting(None, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), n=args.n, v=args.v, dtype=args.dtype, rows=results), f,
                      indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
