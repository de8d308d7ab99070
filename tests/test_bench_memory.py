"""benchmarks/bench_memory.py at a tiny shape, in-process: its three paths compute the same loss and gradients
(so the table compares equal work), each records the backend its op ran and a path whose op ran another backend
than expected is refused, its ratios are computed as documented, and it never overwrites a result."""

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
    options = dict(backend="auto", entropy_coef=bench_memory.ENTROPY_COEF)
    for path in bench_memory.DEFAULT_PATHS:
        steps = bench_memory.STEPS[path](data, options)
        logp = steps.forward_only()
        loss = steps.train()
        grads = torch.autograd.grad(loss, [data["hidden"], data["weight"]])
        results[path] = (logp.detach(), loss.detach(), grads)
        assert steps.ran == {bench_memory.expected_backends("cpu", "auto")[path]}, (path, steps.ran)
    # The truth: the openrlhf path (plain torch) on float64 copies of the same inputs (tests/numerics.py); every
    # path, fp32 only where it runs a C++ kernel, within the bound derived from the computation: magnitude
    # max sum_k |h_k w_k| / T, reduction length V + H + N.
    data64 = {k: (v.detach().double().requires_grad_(v.requires_grad) if v.is_floating_point() else v)
              for k, v in data.items()}  # fmt: skip
    with Float64Shadow():
        steps = bench_memory.STEPS["openrlhf"](data64, options)
        want_logp = steps.forward_only().reshape(-1)
        want_loss = steps.train()
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
    memory = [dict(path=p, status="ok", peak_bytes=b, grad_bytes=10, forward_only_peak_bytes=1, train_peak_bytes=b,
                   loss=0.0, backend_ran=[p]) for p, b in (("openrlhf", 410), ("logits_kernel", 130), ("fused_linear", 50))]  # fmt: skip

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


def test_a_path_whose_op_ran_another_backend_is_refused(tmp_path, monkeypatch, capsys):
    """Every figure says what ran: the logits path's op reporting the torch reference where the C++ kernel is
    expected (what `auto` did on a GPU with the reference) is refused, and the run exits 1."""
    def worker(args):
        mode, what = args[1].split(":")
        if mode == "memory":
            ran = ["torch"] if what == "logits_kernel" else [bench_memory.expected_backends("cpu", "auto")[what]]
            return dict(path=what, status="ok", peak_bytes=100, grad_bytes=10, forward_only_peak_bytes=1,
                        train_peak_bytes=100, loss=0.0, backend_ran=ran)  # fmt: skip
        step = dict(forward_only_s=1.0, train_s=1.0, forward_only_cpu_s=1.0, train_cpu_s=1.0)
        paths = what.split(",")
        return dict(rounds=[{**{p: step for p in paths}, "loadavg_1min": 0.0}], threads=1, cpp_isa="avx2",
                    backend_ran={p: [bench_memory.expected_backends("cpu", "auto")[p]] for p in paths})  # fmt: skip

    monkeypatch.setattr(bench_memory, "_subprocess", worker)
    path = tmp_path / "result.json"
    assert bench_memory.main(["--json", str(path), "--n", "8", "--h", "4", "--v", "16", "--repeats", "1"]) == 1
    report = __import__("json").loads(path.read_text())
    rows = {row["path"]: row for row in report["memory"]}
    assert rows["logits_kernel"]["status"] == "refused: the op ran ['torch'], cpp expected"
    assert rows["fused_linear"]["status"] == "ok" and rows["fused_linear"]["backend_ran"] == ["torch"]
    assert "refused paths (their op ran another backend): logits_kernel" in capsys.readouterr().err
