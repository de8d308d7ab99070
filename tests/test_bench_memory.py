"""benchmarks/bench_memory.py at a tiny shape, in-process: its three paths compute the same loss and gradients
(so the table compares equal work), its ratios are computed as documented, and it never overwrites a result."""

import pytest
import torch

from benchmarks import bench_memory

from .numerics import Float64Shadow, assert_near_float64, fp32_error_bound


def _eager_entropy(monkeypatch):
    """Upstream's compute_entropy without its torch.compile (a compile takes ~30 s on CPU; same math)."""
    from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

    install_cpu_stubs()
    import openrlhf.models.utils as utils

    monkeypatch.setattr(utils, "compute_entropy", getattr(utils.compute_entropy, "_torchdynamo_orig_callable"))


def test_the_three_paths_compute_the_same_loss_and_gradients(monkeypatch):
    _eager_entropy(monkeypatch)
    data = bench_memory._make_inputs(n=24, h=8, v=40, dtype=torch.float32, device="cpu")
    results = {}
    for path in bench_memory.PATHS:
        forward_only, train = bench_memory.STEPS[path](data)
        logp = forward_only()
        loss = train()
        grads = torch.autograd.grad(loss, [data["hidden"], data["weight"]])
        results[path] = (logp.detach(), loss.detach(), grads)
    # The truth: the openrlhf path (plain torch) on float64 copies of the same inputs (tests/numerics.py); every
    # path, fp32 only where it runs a C++ kernel, within the bound derived from the computation: magnitude
    # max sum_k |h_k w_k| / T, reduction length V + H + N.
    data64 = {k: (v.detach().double().requires_grad_(v.requires_grad) if v.is_floating_point() else v)
              for k, v in data.items()}  # fmt: skip
    with Float64Shadow():
        forward_only, train = bench_memory.STEPS["openrlhf"](data64)
        want_logp = forward_only().reshape(-1)
        want_loss = train()
        want_grads = torch.autograd.grad(want_loss, [data64["hidden"], data64["weight"]])
    assert want_loss.dtype == want_logp.dtype == torch.float64
    hidden, weight = data64["hidden"].detach(), data64["weight"].detach()
    magnitude = (hidden.abs() @ weight.abs().t()).max().item() / bench_memory.TEMPERATURE
    length = weight.shape[0] + hidden.shape[1] + hidden.shape[0]
    for path, (logp, loss, grads) in results.items():
        scale = max(1.0, want_logp.abs().max().item())
        assert_near_float64("logp", logp.reshape(-1), want_logp, fp32_error_bound(magnitude, length, scale), path)
        scale = max(1.0, abs(want_loss.item()))
        assert_near_float64("loss", loss, want_loss, fp32_error_bound(magnitude, length, scale), path)
        for name, got, want in zip(("hidden", "weight"), grads, want_grads):
            bound = fp32_error_bound(magnitude, length, want.abs().max().item())
            assert_near_float64(f"grad {name}", got, want, bound, path)
    assert results["openrlhf"][2][1].abs().sum() > 0


def test_summary_ratios():
    memory = [dict(path=p, peak_bytes=b, grad_bytes=10, forward_only_peak_bytes=1, train_peak_bytes=b, loss=0.0)
              for p, b in (("openrlhf", 410), ("logits_kernel", 130), ("fused_linear", 50))]  # fmt: skip

    def run(fwd, train):
        return dict(forward_only_s=fwd, train_s=train, forward_only_cpu_s=2 * fwd, train_cpu_s=2 * train)

    rounds = [
        {"openrlhf": run(9, 9), "logits_kernel": run(2, 3), "fused_linear": run(2, 4), "loadavg_1min": 1.0},
        {"openrlhf": run(9, 9), "logits_kernel": run(4, 6), "fused_linear": run(2, 6), "loadavg_1min": 5.0},
        {"openrlhf": run(9, 9), "logits_kernel": run(2, 3), "fused_linear": run(3, 9), "loadavg_1min": 2.0},
    ]
    summary = bench_memory.summarize(memory, dict(rounds=rounds))
    q = summary["ratios"]
    assert q["memory_vs_openrlhf"] == pytest.approx(410 / 50)
    assert q["memory_vs_logits_kernel_without_grads"] == pytest.approx(120 / 40)
    total = q["total_time_vs_logits_kernel"]
    assert total["median_of_round_ratios"] == pytest.approx(6 / 5)  # round ratios 6/5, 8/10, 12/5
    assert total["fastest_rounds"] == pytest.approx(6 / 5)
    assert q["train_time_vs_logits_kernel"]["median_of_round_cpu_ratios"] == pytest.approx(8 / 6)  # 4/3, 1, 3
    fused = next(r for r in summary["paths"] if r["path"] == "fused_linear")
    assert fused["train_s"] == 6 and fused["total_s"] == 8
    assert "fused_linear peak: 8.2x less than openrlhf" in bench_memory.format_report(summary)


def test_refuses_to_overwrite_a_result(tmp_path, monkeypatch):
    existing = tmp_path / "result.json"
    existing.write_text("{}")
    monkeypatch.setattr(bench_memory, "_subprocess", lambda args: pytest.fail("a worker ran"))
    with pytest.raises(SystemExit) as exit_info:
        bench_memory.main(["--json", str(existing)])
    assert exit_info.value.code == 2 and existing.read_text() == "{}"
