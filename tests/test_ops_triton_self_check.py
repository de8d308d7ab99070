"""The Triton kernel's self-check (what `--actor.fused_loss auto` runs on a CUDA device before using Triton) and
`openrlhf-lopti check-gpu`. No GPU here: the check runs the kernel in interpreter mode on CPU tensors (set by
conftest), and the CUDA decision is taken on a stand-in for CUDA logits (it reads only ``is_cuda`` and ``device``)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import openrlhf_lopti.ops.triton as triton_ops
from openrlhf_lopti.__main__ import main as cli_main
from openrlhf_lopti.ops.fused_policy_loss import resolve_backend
from openrlhf_lopti.ops.triton import self_check
from openrlhf_lopti.ops.triton.self_check import QUICK_CASES, forget_self_checks, run_self_check, triton_verified

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_cache():
    forget_self_checks()
    yield
    forget_self_checks()


def test_the_kernel_passes_its_own_check():
    result = run_self_check(CPU)
    assert result.ok and result.error is None, result.summary()
    assert set(result.worst) == {"float32", "bfloat16"} and all(0 <= e <= 1 for e in result.worst.values())
    assert {case.dtype for case in QUICK_CASES} == {torch.float32, torch.bfloat16}
    assert any(case.neg_inf for case in QUICK_CASES) and any(case.temperature != 1 for case in QUICK_CASES)
    assert all(case.v % 64 for case in QUICK_CASES)  # V not a multiple of a block


@pytest.mark.parametrize("field, error", [("loss", 1e-3), ("entropy", 1e-3), ("logp", 1e-3)])
def test_a_wrong_kernel_fails_the_check_with_its_worst_error(field, error, monkeypatch):
    kernel = triton_ops.triton_policy_loss

    def off_by(*args, **kwargs):
        out, bad_rows = kernel(*args, **kwargs)
        return dataclasses.replace(out, **{field: getattr(out, field) + error}), bad_rows

    monkeypatch.setattr(triton_ops, "triton_policy_loss", off_by)
    result = run_self_check(CPU)
    assert not result.ok and max(result.worst.values()) > 1
    assert result.summary().startswith("FAILED in ")


def test_a_kernel_that_cannot_run_fails_the_check_without_raising(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("PTX JIT compilation failed")

    monkeypatch.setattr(triton_ops, "triton_policy_loss", broken)
    result = run_self_check(CPU)
    assert not result.ok and result.error == "RuntimeError: PTX JIT compilation failed"
    assert "could not run (RuntimeError: PTX JIT compilation failed)" in result.summary()


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
