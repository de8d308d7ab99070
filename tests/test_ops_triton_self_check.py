"""The Triton kernel's self-check (what `--actor.fused_loss auto` runs on a CUDA device before using Triton) and
`openrlhf-lopti check-gpu`. No GPU here: the check runs the kernel in interpreter mode on CPU tensors (set by
conftest), and the CUDA decision is taken on a stand-in for CUDA logits (it reads only ``is_cuda`` and ``device``)."""

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import openrlhf_lopti.ops.triton as triton_ops
from openrlhf_lopti.__main__ import main as cli_main
from openrlhf_lopti.algo import PolicyLossOutput, policy_loss_from_logits
from openrlhf_lopti.ops.fused_policy_loss import resolve_backend
from openrlhf_lopti.ops.triton import self_check
from openrlhf_lopti.ops.triton.policy_loss import DEFAULT_GRID_CAP, _launch_config
from openrlhf_lopti.ops.triton.self_check import QUICK_CASES, forget_self_checks, run_self_check, triton_verified

CPU = torch.device("cpu")
INF, NAN = float("inf"), float("nan")


@pytest.fixture(autouse=True)
def fresh_cache():
    forget_self_checks()
    yield
    forget_self_checks()


def reference_kernel(logits, labels, *args, **kwargs):
    """The torch reference dressed as the kernel (its output): the base of the planted kernels below,
    exact where they are not broken and far faster than the interpreted kernel."""
    return policy_loss_from_logits(logits, labels, *args, **kwargs)


def test_the_kernel_passes_its_own_check():
    result = run_self_check(CPU)
    assert result.ok and result.error is None and result.skipped == [], result.summary()
    assert set(result.worst) == {"float32", "bfloat16", "float16"} and all(0 <= e <= 1 for e in result.worst.values())
    assert {case.dtype for case in QUICK_CASES} == {torch.float32, torch.bfloat16, torch.float16}
    assert any(case.neg_inf for case in QUICK_CASES) and any(case.temperature != 1 for case in QUICK_CASES)
    assert all(case.v % 64 for case in QUICK_CASES)  # V not a multiple of a block
    configs = [(case, _launch_config(case.n, case.v)) for case in QUICK_CASES]
    # one block with 4 warps, and the build real vocabularies get: several 4096-wide blocks, 8 warps
    assert any(case.v <= c["BLOCK_V"] and c["num_warps"] == 4 for case, c in configs)
    assert any(case.v > 2 * c["BLOCK_V"] == 8192 and c["num_warps"] == 8 for case, c in configs)
    # fp16 on the real-vocabulary build too, and the -inf columns in two blocks there
    assert any(case.dtype == torch.float16 and c["num_warps"] == 8 for case, c in configs)
    case = next(case for case, c in configs if c["BLOCK_V"] == 4096 and case.neg_inf)
    logits = self_check._inputs(case, CPU, seed=0)["logits"]
    blocks = {int(col) // 4096 for col in torch.isinf(logits[1]).nonzero().flatten()}
    assert len(blocks) == 2 and not torch.isinf(logits[0]).any()


def test_the_reference_dressed_as_the_kernel_passes(monkeypatch):
    """The control of the planted kernels below: what fails there is the plant, not its base."""
    monkeypatch.setattr(triton_ops, "triton_policy_loss", reference_kernel)
    result = run_self_check(CPU)
    assert result.ok and max(result.worst.values()) <= 0.01, result.summary()


@pytest.mark.parametrize("field, error", [("loss", 1e-3), ("entropy", 1e-3), ("logp", 1e-3)])
def test_a_wrong_kernel_fails_the_check_with_its_worst_error(field, error, monkeypatch):
    kernel = reference_kernel

    def off_by(*args, **kwargs):
        out = kernel(*args, **kwargs)
        return dataclasses.replace(out, **{field: getattr(out, field) + error})

    monkeypatch.setattr(triton_ops, "triton_policy_loss", off_by)
    result = run_self_check(CPU)
    assert not result.ok and max(result.worst.values()) > 1
    assert result.summary().startswith("FAILED in ")


def nan_everywhere(logits, labels, *args, **kwargs):
    """NaN in every output and, through them, in every entry of the gradient."""
    nan = logits.float().sum(-1) * NAN
    no_rows = torch.zeros(labels.shape, dtype=torch.bool)
    return PolicyLossOutput(loss=nan, logp=nan, kl=nan.detach(), clipped=no_rows, entropy=nan)


def nan_in_one_entropy(logits, labels, *args, **kwargs):
    """The reference's outputs and gradients, but a NaN entropy in row 0 (kept or not, the reference's is finite)."""
    out = reference_kernel(logits, labels, *args, **kwargs)
    out.entropy = out.entropy + torch.where(torch.arange(len(labels)) == 0, NAN, 0.0)  # the gradient is unchanged
    return out


@pytest.mark.parametrize("kernel", [nan_everywhere, nan_in_one_entropy])
def test_a_kernel_writing_nan_fails_the_check(kernel, monkeypatch):
    """Python's max(0.0, nan) is 0.0: an error of NaN used to read as no error, and NaN everywhere passed."""
    monkeypatch.setattr(triton_ops, "triton_policy_loss", kernel)
    result = run_self_check(CPU)
    assert not result.ok, result.summary()
    assert set(result.worst) == {"float32", "bfloat16", "float16"}  # every dtype reported, none dropped as NaN
    assert all(math.isinf(e) for e in result.worst.values()) and "float32 inf" in result.summary()
    logits = torch.zeros(2, 5, requires_grad=True)
    out = kernel(logits, torch.tensor([1, 2]), torch.zeros(2), torch.ones(2), torch.ones(2), return_entropy=True)
    if kernel is nan_everywhere:  # the plant is what it says: NaN outputs and NaN gradients
        out.loss.sum().backward()
        assert torch.isnan(out.loss).all() and torch.isnan(logits.grad).all()


def test_a_kernel_wrong_past_the_first_vocabulary_block_fails_the_check(monkeypatch):
    """A kernel that reads only the first BLOCK_V columns (log-sum-exp and gradient) is right on every vocabulary
    of one block: only a quick case over several blocks catches it."""

    def first_block_only(logits, labels, *args, **kwargs):
        block = _launch_config(*logits.shape)["BLOCK_V"]
        return reference_kernel(logits[:, :block], labels.clamp(max=block - 1), *args, **kwargs)

    monkeypatch.setattr(triton_ops, "triton_policy_loss", first_block_only)
    result = run_self_check(CPU)
    assert not result.ok, result.summary()
    one_block = [case for case in QUICK_CASES if case.v <= _launch_config(case.n, case.v)["BLOCK_V"]]
    assert one_block and run_self_check(CPU, one_block).ok  # wrong only past the first block


def test_a_kernel_wrong_only_in_fp16_fails_the_check(monkeypatch):
    """A kernel that reads fp16 logits as bf16 (3 mantissa bits lost) is right in fp32 and bf16."""

    def fp16_as_bf16(logits, *args, **kwargs):
        if logits.dtype == torch.float16:
            logits = logits.to(torch.bfloat16)
        return reference_kernel(logits, *args, **kwargs)

    monkeypatch.setattr(triton_ops, "triton_policy_loss", fp16_as_bf16)
    result = run_self_check(CPU)
    assert not result.ok, result.summary()
    assert result.worst["float16"] > 1 and result.worst["float32"] <= 1 and result.worst["bfloat16"] <= 1


@pytest.mark.parametrize(
    "got, want, distance",
    [
        ([1.0, 2.0], [1.5, 2.0], 0.5),
        ([1.0, INF, NAN, -INF], [1.5, INF, NAN, -INF], 0.5),  # the same non-finite values: compared elsewhere
        ([1.0, 2.0], [1.0, INF], INF),  # finite where the reference is not
        ([1.0, NAN], [1.0, 2.0], INF),
        ([1.0, NAN], [1.0, INF], INF),  # both non-finite, not the same
        ([1.0, -INF], [1.0, INF], INF),
    ],
)
def test_the_distance_fails_any_mismatch_of_non_finite_values(got, want, distance):
    assert self_check._distance(torch.tensor(got), torch.tensor(want))[0] == distance


def test_a_gradient_wrong_in_the_last_row_fails_the_check_when_the_reference_runs_in_chunks(monkeypatch):
    """The 2^31-element case runs the reference and the comparison a chunk of rows at a time: the last chunk too."""
    case = self_check.Case(16, 1000, torch.bfloat16, neg_inf=True)
    monkeypatch.setattr(self_check, "CHUNK_ELEMENTS", 3000)  # 3 rows a chunk: 6 chunks, the last one of 1 row
    assert len(self_check._row_chunks(case)) == 6

    def last_row_off(logits, labels, *args, **kwargs):
        out = reference_kernel(logits, labels, *args, **kwargs)
        column = logits[:, 0].float()
        # the same values; the gradient of row N-1, column 0 moves by 0.1 * its loss weight
        out.loss = out.loss + 0.1 * (column - column.detach()) * (torch.arange(len(labels)) == len(labels) - 1)
        return out

    monkeypatch.setattr(triton_ops, "triton_policy_loss", last_row_off)
    assert not run_self_check(CPU, [case]).ok
    monkeypatch.setattr(triton_ops, "triton_policy_loss", reference_kernel)
    assert run_self_check(CPU, [case]).ok


def test_the_kernel_passes_with_programs_striding_over_rows_and_the_reference_in_chunks(monkeypatch):
    """What the N > 65,535 case checks on a GPU, at a size the interpreter runs: 3 programs for 16 rows."""
    monkeypatch.setenv("OPENRLHF_LOPTI_TRITON_GRID_CAP", "3")
    monkeypatch.setattr(self_check, "CHUNK_ELEMENTS", 5000)
    result = run_self_check(CPU, [self_check.Case(16, 1000, torch.bfloat16, temperature=0.7, neg_inf=True)])
    assert result.ok, result.summary()


def test_the_wide_grid_goes_past_the_grid_cap_and_2_31_elements():
    rows = [case for case in self_check.WIDE_CASES if case.n > DEFAULT_GRID_CAP]
    elements = [case for case in self_check.WIDE_CASES if case.n * case.v >= 2**31]
    assert rows and elements
    # the 2^31 case holds the logits and two gradients, not the reference's fp32 temporaries: it fits on an H100
    assert all(3 * 2**31 * 2 <= case.bytes_needed() < 20e9 for case in elements)
    assert set(QUICK_CASES) <= set(self_check.WIDE_CASES)


def test_a_case_larger_than_the_free_device_memory_is_skipped_and_reported(monkeypatch):
    monkeypatch.setattr(triton_ops, "triton_policy_loss", reference_kernel)
    small, large = QUICK_CASES[0], self_check.Case(64, 4099, torch.bfloat16)
    assert small.bytes_needed() < large.bytes_needed()
    monkeypatch.setattr(self_check, "_free_bytes", lambda device: large.bytes_needed() - 1)
    result = run_self_check(CPU, [small, large])
    gb = large.bytes_needed() / 1e9
    assert result.ok and result.skipped == [f"N=64 V=4099 T=1.0 bfloat16 (needs {gb:.1f} GB, {gb:.1f} GB free)"]
    assert result.summary().endswith(f"; skipped: N=64 V=4099 T=1.0 bfloat16 (needs {gb:.1f} GB, {gb:.1f} GB free)")
    nothing = run_self_check(CPU, [large])  # nothing checked is not a pass
    assert not nothing.ok and "no case ran" in nothing.summary()


def test_a_kernel_that_cannot_run_fails_the_check_without_raising(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("PTX JIT compilation failed")

    monkeypatch.setattr(triton_ops, "triton_policy_loss", broken)
    result = run_self_check(CPU)
    assert not result.ok and result.error == "RuntimeError: PTX JIT compilation failed"
    assert "could not run (RuntimeError: PTX JIT compilation failed)" in result.summary()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_check_passes_when_its_first_caller_runs_without_grad(mode):
    """A trainer's first loss-head call is often its log-prob pass, under no_grad or inference_mode: the check's own
    backward must run anyway. It used to raise there ("element 0 of tensors does not require grad"), and the failure
    was cached as a failed check: `auto` then used the torch reference for the whole process."""
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        assert triton_verified(CPU), self_check._VERIFIED[str(CPU)].summary()
        assert not torch.is_grad_enabled()  # the caller's mode is left as it was
    assert self_check._VERIFIED[str(CPU)].error is None


def test_an_error_of_the_harness_is_raised_never_cached_as_a_failed_kernel(monkeypatch):
    """Only the kernel's own failures make a failed check. An exception in the reference (or the inputs, or the
    comparison) is our bug: it propagates, and nothing is cached, so the next call checks again."""

    def broken_reference(inputs, case):
        raise RuntimeError("the harness broke")

    monkeypatch.setattr(self_check, "_reference", broken_reference)
    with pytest.raises(RuntimeError, match="the harness broke"):
        triton_verified(CPU)
    assert str(CPU) not in self_check._VERIFIED
    monkeypatch.undo()
    assert triton_verified(CPU)


def test_a_kernel_that_flags_good_rows_fails_the_check(monkeypatch):
    """Status bits set on valid inputs would NaN those rows in training: the check compares them like any output."""
    real = triton_ops.triton_policy_loss

    def flags_row_0(logits, labels, *args, **kwargs):
        out = real(logits, labels, *args, **kwargs)
        poison = torch.where(torch.arange(len(labels), device=labels.device) == 0, NAN, 1.0)
        out.loss, out.logp = out.loss * poison, out.logp * poison
        return out

    monkeypatch.setattr(triton_ops, "triton_policy_loss", flags_row_0)
    assert not run_self_check(CPU, QUICK_CASES[:1]).ok


def test_auto_uses_triton_on_a_cuda_device_only_after_the_check_passes(monkeypatch, capsys):
    calls = []
    verdict = {"cuda:0": True, "cuda:1": False}

    def check(device, cases=QUICK_CASES):
        calls.append(str(device))
        ok = verdict[str(device)]
        return self_check.SelfCheck(ok, 0.25, {"bfloat16": 0.5 if ok else 7.0}, {"bfloat16": "N=16 V=1000 T=1.0"})

    monkeypatch.setattr(self_check, "run_self_check", check)
    monkeypatch.setattr(triton_ops, "triton_available", lambda: True)
    on = {name: SimpleNamespace(is_cuda=True, device=torch.device(name)) for name in verdict}
    assert resolve_backend("auto", on["cuda:0"]) == "triton"
    assert resolve_backend("auto", on["cuda:1"]) == "torch"
    assert resolve_backend("auto", on["cuda:1"]) == "torch"  # cached: checked once per device
    assert resolve_backend("triton", on["cuda:1"]) == "triton"  # an explicit choice is the user's
    assert calls == ["cuda:0", "cuda:1"]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "[openrlhf-lopti] Triton self-check on cuda:0: passed in 0.2 s; worst error / bound per dtype: "
        "bfloat16 0.5 (N=16 V=1000 T=1.0)",
        "[openrlhf-lopti] WARNING: Triton self-check on cuda:1 FAILED in 0.2 s; worst error / bound per dtype: "
        "bfloat16 7 (N=16 V=1000 T=1.0); --actor.fused_loss auto uses the torch reference on this device "
        "(`openrlhf-lopti check-gpu` reports more)",
    ]
    assert triton_verified(torch.device("cuda:0")) and calls == ["cuda:0", "cuda:1"]


def test_check_gpu_on_a_machine_without_cuda_says_so_in_one_line(capsys):
    assert cli_main(["check-gpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("check-gpu: no CUDA device visible to torch")


def test_check_gpu_reports_the_skipped_cases_and_its_verdict(monkeypatch, capsys):
    """The report on a (stand-in) GPU: the wide grid is what runs, and a case too large for it is named, not dropped."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    properties = SimpleNamespace(name="Stand-in GPU", major=9, minor=0, total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    skipped = ["N=14336 V=151936 T=1.0 bfloat16 (needs 15.2 GB, 9.0 GB free)"]
    verdicts, seen = iter([True, False]), []

    def check(device, cases):
        seen.append(cases)
        ok = next(verdicts)
        return self_check.SelfCheck(ok, 1.5, {"bfloat16": 0.5 if ok else 3.0}, {"bfloat16": "N=16 V=1000 T=1.0"},
                                    skipped=skipped)  # fmt: skip

    monkeypatch.setattr(self_check, "run_self_check", check)
    assert cli_main(["check-gpu", "--no-bench"]) == 0
    report = capsys.readouterr().out.splitlines()
    total = len(self_check.WIDE_CASES)
    assert seen == [self_check.WIDE_CASES] and report[1].startswith("device: Stand-in GPU (sm_90, 80 GiB)")
    assert report[-1] == (
        f"self-check ({total} cases, 1 skipped, forward and backward vs the torch reference): passed in 1.5 s; "
        "worst error / bound per dtype: bfloat16 0.5 (N=16 V=1000 T=1.0); "
        "skipped: N=14336 V=151936 T=1.0 bfloat16 (needs 15.2 GB, 9.0 GB free)"
    )
    assert cli_main(["check-gpu", "--no-bench"]) == 1 and "FAILED in 1.5 s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [(["--device", "gpu0"], "--device must be cuda or cuda:<index>, got 'gpu0'"),
     (["--bench-n", "0"], "--bench-n must be an integer >= 1, got 0"),
     (["--bench-v", "-5"], "--bench-v must be an integer >= 1, got -5"),
     (["--bench-n", "1500"], "--bench-n must be at most 1024 or a multiple of it (the benchmark's tokens per sequence), "
                             "got 1500")],
)  # fmt: skip
def test_check_gpu_refuses_a_bad_flag_in_one_line_before_the_self_check(monkeypatch, capsys, flags, message):
    """The wide self-check takes minutes on a GPU: a bad benchmark flag was found only after it, under `bench`'s flag
    names (--n), and a bad --device was a traceback. On a (stand-in) GPU the check must not even start."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    started = []
    monkeypatch.setattr(self_check, "run_self_check", lambda *a: started.append(a))
    assert cli_main(["check-gpu", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"openrlhf-lopti check-gpu: error: {message}"]
    assert started == []


def test_check_gpu_benchmarks_the_device_it_checked(monkeypatch):
    """`--device cuda:1` checked cuda:1 but benchmarked `cuda` (the current device)."""
    from openrlhf_lopti.cli import bench_loss_head

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a (stand-in) machine with a cuda:1
    properties = SimpleNamespace(name="Stand-in GPU", major=9, minor=0, total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    monkeypatch.setattr(self_check, "run_self_check", lambda device, cases: self_check.SelfCheck(True, 1.0, {}, {}))
    flags = []

    def bench(argv):  # writes a table without rows where the benchmark writes its JSON
        flags.extend(argv)
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps({"rows": []}))
        return 0

    monkeypatch.setattr(bench_loss_head, "main", bench)
    assert cli_main(["check-gpu", "--device", "cuda:1", "--bench-n", "512"]) == 0
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert (pairs["--device"], pairs["--n"], pairs["--seq-len"]) == ("cuda:1", "512", "512")


def test_rounding_left_where_the_reference_gradient_cancels_to_zero_passes_and_a_real_error_there_fails(monkeypatch):
    """At V=1 every gradient entry is exactly 0 in the reference (the softmax is 1); an H100 left ~4e-15 there and
    the wide grid failed by "4.8e+25" bounds, because the bound was relative to the cancelled result. The bound is
    relative to the size of the terms that cancel (the upstream gradient over T); a real error still fails."""
    cases = (self_check.Case(1, 1, torch.float32, temperature=0.6), self_check.Case(1, 1, torch.bfloat16, 0.6))

    def kernel_off_by(offset):
        def kernel(logits, *args, **kwargs):
            out = reference_kernel(logits, *args, **kwargs)
            # the gradient moves by `offset` per unit of the logp's upstream gradient: the forward values are unchanged
            out.logp = out.logp + offset * (logits.float().sum(-1) - logits.float().sum(-1).detach())
            return out

        return kernel

    for offset, passes in ((4e-15, True), (1e-2, False)):
        monkeypatch.setattr(triton_ops, "triton_policy_loss", kernel_off_by(offset))
        result = run_self_check(CPU, cases=cases)
        assert result.ok is passes, (offset, result.summary())
        assert passes or result.worst["float32"] > 1  # fp32's bound has no dtype ulp in it: the error is seen there


def test_check_gpu_of_a_device_past_the_count_is_one_line(monkeypatch, capsys):
    """``--device cuda:3`` on a (stand-in) one-GPU machine: one line before any check (before: a traceback from
    ``get_device_properties``, which the stand-in stands for)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: pytest.fail("the device was queried"))
    assert cli_main(["check-gpu", "--device", "cuda:3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["openrlhf-lopti check-gpu: error: --device cuda:3: this machine has 1 CUDA device(s)"], err
