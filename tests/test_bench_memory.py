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


def _row(path, peak, grads=10):
    return dict(path=path, status="ok", peak_bytes=peak, grad_bytes=grads, forward_only_peak_bytes=1,
                train_peak_bytes=peak, loss=0.0, backend_ran=[path])  # fmt: skip


def _timed(fwd, train):
    return dict(forward_only_s=fwd, train_s=train, forward_only_cpu_s=fwd, train_cpu_s=train)


def test_the_gpu_sessions_paths_get_their_ratios_without_openrlhf():
    """The GPU session runs logits_kernel, fused_linear, liger_flce and cce (no openrlhf): the fused lm_head's goals
    are against the logits path, and its peers' ratios are measured too. Before, the ratios needed the openrlhf path
    and that run's were empty. Against Liger the train part only: its forward-only passes are ours."""
    memory = [_row("logits_kernel", 130), _row("fused_linear", 50), _row("liger_flce", 60), _row("cce", 90)]
    rounds = [{"logits_kernel": _timed(2, 4), "fused_linear": _timed(3, 5), "liger_flce": _timed(3, 10),
               "cce": _timed(1, 2), "loadavg_1min": 0.0}]  # fmt: skip
    q = bench_memory.summarize(memory, dict(rounds=rounds, gpu="NVIDIA H200", gemm_tflops=500.0),
                               dict(n=4, h=5, v=10**12))["ratios"]  # fmt: skip
    assert q["memory_vs_logits_kernel"] == pytest.approx(130 / 50) and q["memory_vs_cce"] == pytest.approx(90 / 50)
    assert q["total_time_vs_logits_kernel"]["median_of_round_ratios"] == pytest.approx(8 / 6)
    assert q["train_time_vs_liger_flce"]["fastest_rounds"] == pytest.approx(5 / 10)
    assert "forward_only_time_vs_liger_flce" not in q and "total_time_vs_liger_flce" not in q
    assert q["train_time_vs_cce"]["median_of_round_ratios"] == pytest.approx(5 / 2)
    summary = bench_memory.summarize(memory, dict(rounds=rounds, gpu="NVIDIA H200", gemm_tflops=500.0),
                                     dict(n=4, h=5, v=10**12))  # fmt: skip
    fused = next(r for r in summary["paths"] if r["path"] == "fused_linear")
    assert fused["train_tflops"] == pytest.approx(6 * 4 * 5 * 10**12 / 5 / 1e12)  # 24 TFLOP/s
    assert fused["train_share_of_gemm"] == pytest.approx(24 / 500)
    assert summary["throughput"]["datasheet_tflops"] == pytest.approx(989)
    report = bench_memory.format_report(summary)
    assert "2.6x less than logits_kernel (goal >= 3x)" in report and "vs liger_flce, train: 0.50x" in report


def test_a_path_that_fails_is_its_row_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    """One peer failing (the H100 session: cut-cross-entropy's API) lost every row of both lm_head steps. Now a
    path's failure, in its step or its worker process, is that path's status; the others are measured and the JSON
    is written after each path (``complete`` at the end)."""
    def broken(data, options):
        raise NotImplementedError("cce_exact is not implemented.")

    monkeypatch.setitem(bench_memory.STEPS, "cce", broken)
    row = bench_memory._memory_worker("cce", dict(backend="auto", entropy_coef=0.0), "cpu", 8, 4, 16, "float32")
    assert row == dict(path="cce", status="failed: NotImplementedError: cce_exact is not implemented.")

    def worker(args):
        mode, what = args[1].split(":")
        if mode == "memory":
            if what == "logits_kernel":
                raise RuntimeError("worker memory:logits_kernel exited -9 (its error is above)")
            ran = [bench_memory.expected_backends("cpu", "auto")[what]]
            return dict(_row(what, 100), backend_ran=ran)
        assert what == "fused_linear"  # only what measured its memory is timed
        return dict(rounds=[{"fused_linear": _timed(1.0, 1.0), "loadavg_1min": 0.0}], threads=1, cpp_isa="avx2",
                    backend_ran={"fused_linear": ["torch"]})  # fmt: skip

    monkeypatch.setattr(bench_memory, "_subprocess", worker)
    path = tmp_path / "result.json"
    argv = ["--json", str(path), "--n", "8", "--h", "4", "--v", "16", "--repeats", "1",
            "--paths", "logits_kernel,fused_linear"]  # fmt: skip
    assert bench_memory.main(argv) == 0
    report = __import__("json").loads(path.read_text())
    rows = {row["path"]: row for row in report["memory"]}
    assert rows["logits_kernel"]["status"] == "failed: worker memory:logits_kernel exited -9 (its error is above)"
    assert rows["fused_linear"]["status"] == "ok" and report["complete"] is True
    assert "memory: logits_kernel: failed" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--n", "0"], "--n must be an integer >= 1, got 0"),
    (["--entropy-coef", "nan"], "--entropy-coef must be a finite number, got nan"),
])  # fmt: skip
def test_a_zero_or_nan_is_refused_not_replaced(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.setattr(bench_memory, "_subprocess", lambda args: pytest.fail("a worker ran"))
    with pytest.raises(SystemExit) as exit_info:
        bench_memory.main(["--json", str(tmp_path / "r.json"), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
