"""``fused_linear_policy_loss`` / ``linear_log_probs`` against the torch reference ``hidden @ W.T (+ b)`` then
``policy_loss_from_logits`` / ``token_logprobs``: values, and gradients to hidden, weight and bias under arbitrary
per-token gradients on loss, logp and entropy at once; row chunks and vocabulary blocks, masking, tied weights, -inf
bias columns, memory (no [N, V] tensor), and the input checks."""

import contextlib
import copy
import importlib
import re
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import openrlhf_lopti.ops.cpp_policy_loss as cpp_module
from openrlhf_lopti.algo import policy_loss_from_logits, token_logprobs
from openrlhf_lopti.ops import fused_linear_policy_loss, linear_log_probs
from openrlhf_lopti.ops.fused_linear_policy_loss import default_block_shape

from .kernel_cases import textbook_policy_loss
from .numerics import U32, Float64Shadow, assert_near_float64, assert_same_computation, fp32_error_bound

linear_module = importlib.import_module("openrlhf_lopti.ops.fused_linear_policy_loss")
fused_module = importlib.import_module("openrlhf_lopti.ops.fused_policy_loss")

BACKENDS = ["torch", "triton"] + (["cpp"] if cpp_module.cpp_available() else [])  # triton: interpreter (conftest)
OPTIONS = dict(alpha=0.3, eps_low=0.2, eps_high=0.28, dual_clip=3.0, kl_coef=0.05, kl_estimator="k3",
               temperature=0.7, return_entropy=True)  # fmt: skip


def make_inputs(n=37, h=16, v=50, dtype=torch.float32, masked_fraction=0.25, bias=True, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * 3  # logits of std ~3: probabilities far from uniform
    labels = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad():  # old / ref near the current log-probs, so ratios land on both sides of the clip
        logp, _ = token_logprobs(hidden @ weight.t(), labels, OPTIONS["temperature"])
    return dict(
        hidden=hidden.to(dtype),
        weight=weight.to(dtype),
        bias=(torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None,
        labels=labels,
        old_log_probs=(logp + 0.3 * torch.randn(n, generator=g)).clamp(max=0.0),  # log-probs are <= 0
        advantages=torch.randn(n, generator=g),
        mask=torch.rand(n, generator=g) >= masked_fraction,
        ref_log_probs=logp + 0.5 * torch.randn(n, generator=g),
    )


def run(fn, inputs: dict, grads: dict, **kw):
    """Call ``fn`` on leaf copies of hidden / weight / bias, backprop ``sum(out.x * grads[x])``; returns
    ``(out, {name: grad})``."""
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight", "bias")
              if inputs[k] is not None}  # fmt: skip
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")}
    out = fn(leaves["hidden"], leaves["weight"], leaves.get("bias"), rest, **kw)
    objective = sum((getattr(out, name) * g).sum() for name, g in grads.items())
    objective.backward()
    return out, {k: t.grad for k, t in leaves.items()}


def fused(hidden, weight, bias, rest, **kw):
    rest = dict(rest)
    positional = [rest.pop(k) for k in ("labels", "old_log_probs", "advantages", "mask")]
    return fused_linear_policy_loss(hidden, weight, *positional, bias=bias, **rest, **kw)


def reference(hidden, weight, bias, rest, chunk_size=None, backend=None, **kw):
    """The unfused path: the lm_head's logits in the model's dtype, then the torch reference of the loss."""
    logits = hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())
    rest = dict(rest)
    positional = [rest.pop(k) for k in ("labels", "old_log_probs", "advantages", "mask")]
    return policy_loss_from_logits(logits, *positional, **rest, **kw)


def random_grads(n: int, seed: int = 1, names=("loss", "logp", "entropy")) -> dict:
    """Arbitrary per-token upstream gradients (what a token-mean loss + KL via logp + entropy bonus give, and more)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(n, generator=g) for name in names}


def in_float64(inputs: dict) -> dict:
    """The same inputs with hidden / weight / bias as float64 (exact copies), on the CPU."""
    return {k: None if v is None else (v.detach().cpu().double() if k in ("hidden", "weight", "bias") else v.cpu())
            for k, v in inputs.items()}  # fmt: skip


def float64_run(fn, inputs: dict, grads: dict, monkeypatch=None, **kw):
    """``run(fn, ...)`` on float64 copies of the inputs under ``Float64Shadow`` (tests/numerics.py). For the fused
    path's torch backend pass ``monkeypatch``: the test widens LOGITS_DTYPES to float64 (C++ / Triton are fp32
    only)."""
    if monkeypatch is not None:
        for module in (linear_module, fused_module):
            monkeypatch.setattr(module, "LOGITS_DTYPES", (*fused_module.LOGITS_DTYPES, torch.float64))
    with Float64Shadow():
        return run(fn, in_float64(inputs), {k: g.cpu().double() for k, g in grads.items()}, **kw)


def bound_inputs(inputs: dict, temperature: float) -> tuple:
    """(magnitude, reduction length) of :func:`tests.numerics.fp32_error_bound` for an lm_head + loss: magnitude
    max over tokens and vocabulary of sum_k |h_k w_k| (+|b|) / T (what the GEMM's rounding and z/T's are relative to),
    length V + H + N (logsumexp over V, the GEMM over H, grad_W's sum over the N rows)."""
    hidden, weight, bias = (None if inputs[k] is None else inputs[k].detach().cpu().double()
                            for k in ("hidden", "weight", "bias"))  # fmt: skip
    z = hidden.abs() @ weight.abs().t() + (0.0 if bias is None else bias.abs().nan_to_num(posinf=0.0))
    n, h, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
    return z.max().item() / temperature, v + h + n


def assert_near_float64_run(path: str, out, grads: dict, truth, truth_grads: dict, inputs: dict, temperature: float,
                            names=("loss", "logp", "kl", "entropy"), unit: float = U32) -> None:  # fmt: skip
    """Each output and gradient of one fp32 path within :func:`tests.numerics.fp32_error_bound` of the float64 run:
    scale max(1, max|output|) for the outputs, max|gradient| for each gradient (plus one ulp of its dtype)."""
    magnitude, length = bound_inputs(inputs, temperature)
    for name in names:
        want = getattr(truth, name)
        if want is None:
            assert getattr(out, name) is None, f"{path}: {name}"
            continue
        finite = want[torch.isfinite(want)]
        scale = max(1.0, finite.abs().max().item() if finite.numel() else 0.0)
        bound = fp32_error_bound(magnitude, length, scale, unit=unit)
        assert_near_float64(name, getattr(out, name), want, bound, path)
    assert set(grads) == set(truth_grads), (path, set(grads), set(truth_grads))
    for name, grad in grads.items():
        scale = max(truth_grads[name].abs().max().item(), torch.finfo(torch.float32).tiny)
        bound = fp32_error_bound(magnitude, length, scale, dtype=grad.dtype, unit=unit)
        assert_near_float64(f"grad {name}", grad, truth_grads[name], bound, path)


def assert_matches(out, ref, grads, ref_grads, inputs: dict, upstream: dict, options: dict, backend: str = "torch",
                   monkeypatch=None, **fused_kw) -> None:  # fmt: skip
    """The fused path (``out``, ``grads``) computes what the unfused reference (``ref``, ``ref_grads``) computes, on
    the same ``inputs`` with the same upstream gradients. Both are measured against the float64 run of the
    reference (:func:`assert_near_float64_run`: a failure names the path that is off). For the torch backend, with
    ``monkeypatch``, the fused path also runs in float64 and must agree with the reference's float64 run to float64
    rounding (:func:`tests.numerics.assert_same_computation`: the logic, some 10^8 times tighter)."""
    temperature = options.get("temperature", 1.0)
    truth, truth_grads = float64_run(reference, inputs, upstream, **options)
    for path, o, g in ((f"fused ({backend})", out, grads), ("reference", ref, ref_grads)):
        assert_near_float64_run(path, o, g, truth, truth_grads, inputs, temperature)
    assert torch.equal(out.clipped.cpu(), ref.clipped.cpu())
    if backend == "torch" and monkeypatch is not None:
        fused64, fused64_grads = float64_run(fused, inputs, upstream, monkeypatch, backend="torch", **options,
                                             **fused_kw)  # fmt: skip
        for name in ("loss", "logp", "kl", "entropy"):
            if getattr(truth, name) is not None:
                assert_same_computation(name, getattr(out, name), getattr(ref, name), getattr(fused64, name),
                                        getattr(truth, name), "fused", "reference")  # fmt: skip
        for name in grads:
            assert_same_computation(f"grad {name}", grads[name], ref_grads[name], fused64_grads[name],
                                    truth_grads[name], "fused", "reference")  # fmt: skip


def _assert_near_textbook(out, want: dict, mine, leaves, inputs: dict, temperature: float, names) -> None:
    """The fused path's outputs and hidden / weight / bias gradients against the float64 textbook loss."""
    truth = type("Truth", (), {k: want[k].detach() for k in names})()
    grads = dict(zip(("hidden", "weight", "bias"), (t.grad for t in mine)))
    truth_grads = dict(zip(("hidden", "weight", "bias"), (t.grad for t in leaves)))
    assert_near_float64_run("fused (torch)", out, grads, truth, truth_grads, inputs, temperature, names)
    assert torch.equal(out.clipped, want["clipped"])


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference_with_gradients_on_loss_logp_and_entropy(backend, bias, monkeypatch):
    inputs = {k: None if v is None else v.to(_device(backend)) for k, v in make_inputs(bias=bias).items()}
    grads = {k: v.to(_device(backend)) for k, v in random_grads(37).items()}
    # chunk 8 divides neither the kept rows nor N = 37
    assert int(inputs["mask"].sum()) % 8
    out, got = run(fused, inputs, grads, chunk_size=8, backend=backend, **OPTIONS)
    ref, want = run(reference, inputs, grads, **OPTIONS)
    assert out.clipped.any() and not out.clipped.all()  # the clip binds on some rows only
    assert_matches(out, ref, got, want, inputs, grads, OPTIONS, backend, monkeypatch, chunk_size=8)
    mask = inputs["mask"]
    assert not mask.all() and torch.all(got["hidden"][~mask] == 0)


@pytest.mark.parametrize("chunk_size,vocab_block", [(1, None), (5, 7), (28, 1), (1000, 50), (None, 13), (None, None)])
def test_any_block_shape_gives_the_same_result(chunk_size, vocab_block, monkeypatch):
    inputs = make_inputs()
    grads = random_grads(37, seed=2)
    blocks = dict(chunk_size=chunk_size, vocab_block=vocab_block)
    out, got = run(fused, inputs, grads, backend="torch", **blocks, **OPTIONS)
    ref, want = run(reference, inputs, grads, **OPTIONS)
    assert_matches(out, ref, got, want, inputs, grads, OPTIONS, "torch", monkeypatch, **blocks)


def test_default_blocks_hold_every_kept_row_and_fill_the_byte_budget(monkeypatch):
    inputs = make_inputs()  # V = 50 fp32
    kept = int(inputs["mask"].sum())
    monkeypatch.setattr(linear_module, "DEFAULT_BLOCK_BYTES", kept * 4 * 12 + 47)  # 12 columns of every kept row
    monkeypatch.setattr(linear_module, "MIN_VOCAB_BLOCK", 8)  # (1024 at real sizes: wider than this V = 50)
    recorder = _Recorder(linear_module._block_logits)
    monkeypatch.setattr(linear_module, "_block_logits", recorder)
    grads = random_grads(37, seed=2)
    out, got = run(fused, inputs, grads, backend="torch", **OPTIONS)
    blocks = [(kept, 12)] * 4 + [(kept, 2)]  # 50 = 4 x 12 + 2, every block over all the kept rows
    assert recorder.blocks == blocks * 2  # the forward, then the backward's one recompute per block
    ref, want = run(reference, inputs, grads, **OPTIONS)
    assert_matches(out, ref, got, want, inputs, grads, OPTIONS)


@pytest.mark.parametrize("grad_on", [("loss",), ("logp",), ("entropy",), ("loss", "entropy")])
def test_each_output_alone_carries_its_gradient(grad_on, monkeypatch):
    inputs = make_inputs(seed=3)
    grads = random_grads(37, seed=4, names=grad_on)
    out, got = run(fused, inputs, grads, chunk_size=6, backend="torch", **OPTIONS)
    ref, want = run(reference, inputs, grads, **OPTIONS)
    assert_matches(out, ref, got, want, inputs, grads, OPTIONS, "torch", monkeypatch, chunk_size=6)


def test_temperature_and_no_kl_no_entropy(monkeypatch):
    inputs = make_inputs(seed=5)
    options = dict(temperature=1.7, alpha=0.0, eps_high=0.2, return_entropy=False)
    grads = random_grads(37, seed=6, names=("loss", "logp"))
    out, got = run(fused, inputs, grads, chunk_size=7, backend="torch", **options)
    ref, want = run(reference, inputs, grads, **options)
    assert out.entropy is None and ref.entropy is None
    assert_matches(out, ref, got, want, inputs, grads, options, "torch", monkeypatch, chunk_size=7)


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if cpp_module.cpp_available() else []))
def test_bfloat16_tiny(backend, monkeypatch):
    inputs = make_inputs(n=9, h=8, v=24, dtype=torch.bfloat16, seed=7)
    grads = random_grads(9, seed=8)
    # 4 vocab blocks (24 = 3 x 7 + 3) over row chunks of 4: grad_W summed over chunks in fp32
    out, got = run(fused, inputs, grads, chunk_size=4, vocab_block=7, backend=backend, **OPTIONS)
    ref, want = run(reference, inputs, grads, **OPTIONS)  # bf16 logits, bf16 lm_head backward
    assert got["hidden"].dtype == got["weight"].dtype == got["bias"].dtype == torch.bfloat16
    # Both paths round the lm_head's logits to bf16, so neither is near the float64 truth to fp32 precision: the
    # rule of tests/numerics.py instead. Logic: the fused path (its torch backend: C++ is fp32 only) and the
    # reference in float64 on the same values agree to float64 rounding. Precision: each bf16 run's error against
    # that float64 run is within ACCURACY_RATIO of the other's (the reference rounds grad_W once from a bf16 GEMM
    # over all rows; ours sums chunks in fp32).
    truth, truth_grads = float64_run(reference, inputs, grads, **OPTIONS)
    fused64, fused64_grads = float64_run(fused, inputs, grads, monkeypatch, chunk_size=4, vocab_block=7,
                                         backend="torch", **OPTIONS)  # fmt: skip
    for name in ("loss", "logp", "kl", "entropy"):
        assert_same_computation(name, getattr(out, name), getattr(ref, name), getattr(fused64, name),
                                getattr(truth, name), f"fused ({backend})", "reference")  # fmt: skip
    for name in got:
        assert_same_computation(f"grad {name}", got[name], want[name], fused64_grads[name], truth_grads[name],
                                f"fused ({backend})", "reference")  # fmt: skip


def test_small_weight_gradients_survive_bf16():
    """grad_W of a low-probability token is tiny; it must reach the weight (no filtering, fp32 accumulation)."""
    v, h, n = 16, 4, 12
    hidden = torch.ones(n, h, dtype=torch.bfloat16)
    weight = torch.zeros(v, h, dtype=torch.bfloat16)
    weight[0] = 4.0  # token 0 takes almost all the mass; the others have p ~ 1e-7 each
    weight.requires_grad_(True)
    labels = torch.zeros(n, dtype=torch.long)
    out = fused_linear_policy_loss(hidden, weight, labels, torch.zeros(n), torch.ones(n), torch.ones(n),
                                   chunk_size=5, backend="torch")  # fmt: skip
    out.logp.sum().backward()
    with torch.no_grad():  # d logp / d W_j = -p_j * h per row, summed over rows
        p = torch.softmax((hidden.float() @ weight.float().t())[0], -1)
    expected = -n * p[1:]  # every coordinate of rows 1..V-1
    assert (expected.abs() < 1e-5).all() and (expected != 0).all()
    torch.testing.assert_close(weight.grad[1:].float(), expected[:, None].expand(-1, h), rtol=1e-2, atol=0)


def test_tied_embedding_gets_both_gradients(monkeypatch):
    """The lm_head weight is the input embedding: its gradient must add to the embedding's."""
    v, h, n = 30, 8, 20
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, v, (n,), generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    old, adv = -torch.rand(n, generator=g) * 3, torch.randn(n, generator=g)
    grads = random_grads(n, seed=10)
    torch.manual_seed(0)
    modules = (torch.nn.Embedding(v, h), torch.nn.Linear(h, h))
    for module in (linear_module, fused_module):  # the float64 runs (the torch backend takes float64 in tests)
        monkeypatch.setattr(module, "LOGITS_DTYPES", (*fused_module.LOGITS_DTYPES, torch.float64))
    results = {}
    for use_fused, precision in ((True, torch.float32), (False, torch.float32), (True, torch.float64),
                                 (False, torch.float64)):  # fmt: skip
        embedding, mix = (copy.deepcopy(m).to(precision) for m in modules)  # the same weights in each run
        with Float64Shadow() if precision == torch.float64 else contextlib.nullcontext():
            hidden = torch.tanh(mix(embedding(ids)))
            if use_fused:
                out = fused_linear_policy_loss(hidden, embedding.weight, labels, old, adv, mask, chunk_size=3,
                                               backend="torch", **OPTIONS | dict(kl_coef=0.0))  # fmt: skip
            else:
                out = policy_loss_from_logits(hidden @ embedding.weight.t(), labels, old, adv, mask,
                                              **OPTIONS | dict(kl_coef=0.0))  # fmt: skip
            sum((getattr(out, k) * t).sum() for k, t in grads.items()).backward()
        results[use_fused, precision] = (embedding.weight.grad, mix.weight.grad)
    for i, name in enumerate(("embedding", "mix")):
        runs = [results[key][i] for key in ((True, torch.float32), (False, torch.float32), (True, torch.float64),
                                            (False, torch.float64))]  # fmt: skip
        assert_same_computation(f"grad {name}", *runs, "fused", "reference")
    assert results[False, torch.float32][0][ids[mask]].abs().sum() > 0


class _Recorder:
    """Records the ``(rows, columns)`` of every block of logits the lm_head makes."""

    def __init__(self, real):
        self.real, self.blocks = real, []

    def __call__(self, hidden_rows, weight, bias, cols, buffer):
        out = self.real(hidden_rows, weight, bias, cols, buffer)
        self.blocks.append(tuple(out.shape))
        return out


def test_masked_rows_never_reach_the_matmul(monkeypatch):
    inputs = make_inputs(seed=11)
    mask = inputs["mask"]
    inputs["hidden"][~mask] = float("nan")  # padding garbage: must not touch any output or gradient
    recorder = _Recorder(linear_module._block_logits)
    monkeypatch.setattr(linear_module, "_block_logits", recorder)
    out, got = run(fused, inputs, random_grads(37), chunk_size=10, vocab_block=30, backend="torch", **OPTIONS)
    kept = int(mask.sum())
    chunks = [(10, 30), (10, 20), (10, 30), (10, 20), (kept - 20, 30), (kept - 20, 20)]
    assert recorder.blocks == chunks * 2  # forward, then the backward's recompute
    assert all(torch.isfinite(t).all() for t in got.values())
    assert torch.isfinite(out.loss).all() and torch.all(out.loss[~mask] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_masked_is_zero_and_runs_no_matmul(monkeypatch, dtype):
    inputs = make_inputs(n=6, h=4, v=10, dtype=dtype, masked_fraction=1.0)
    assert not inputs["mask"].any()
    recorder = _Recorder(linear_module._block_logits)
    monkeypatch.setattr(linear_module, "_block_logits", recorder)
    out, got = run(fused, inputs, random_grads(6), backend="torch", **OPTIONS)
    assert recorder.blocks == []
    for name in ("loss", "logp", "kl", "entropy"):
        assert torch.equal(getattr(out, name), torch.zeros(6)), name
    for name, grad in got.items():
        assert grad.dtype == dtype and torch.equal(grad, torch.zeros_like(grad)), name


def test_frozen_weight_gets_no_gradient_and_no_weight_matmul():
    inputs = make_inputs(seed=12)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["weight"]  # frozen (e.g. LoRA): no [V, H] gradient is computed
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")}
    out = fused(hidden, weight, None, rest, chunk_size=8, backend="torch", **OPTIONS)
    out.loss.sum().backward()
    assert weight.grad is None
    truth, truth_grads = float64_run(reference, dict(inputs, bias=None), {"loss": torch.ones(37)}, **OPTIONS)
    assert_near_float64_run("fused (torch)", out, {"hidden": hidden.grad}, truth, {"hidden": truth_grads["hidden"]},
                            dict(inputs, bias=None), OPTIONS["temperature"])  # fmt: skip


def _neg_inf_case(backend: str, with_entropy: bool):
    """-inf bias columns must act as if those tokens were not in the vocabulary (issue 15's semantics)."""
    inputs = {k: None if v is None else v.to(_device(backend)) for k, v in make_inputs(seed=13).items()}
    v = inputs["weight"].shape[0]
    banned = torch.zeros(v, dtype=torch.bool, device=inputs["weight"].device)
    banned[[0, 7, 31, v - 1]] = True
    inputs["bias"][banned] = -float("inf")
    keep_cols = (~banned).nonzero().squeeze(1)
    new_id = torch.full((v,), -1, dtype=torch.long, device=banned.device)
    new_id[keep_cols] = torch.arange(len(keep_cols), device=banned.device)
    inputs["labels"] = keep_cols[inputs["labels"] % len(keep_cols)]  # labels are allowed tokens
    options = OPTIONS | dict(return_entropy=with_entropy)
    names = ("loss", "logp", "entropy") if with_entropy else ("loss", "logp")
    grads = {k: t.to(banned.device) for k, t in random_grads(37, seed=14, names=names).items()}
    out, got = run(fused, inputs, grads, chunk_size=8, backend=backend, **options)
    removed = dict(inputs, weight=inputs["weight"][keep_cols], bias=inputs["bias"][keep_cols],
                   labels=new_id[inputs["labels"]])  # fmt: skip
    ref, want = run(reference, removed, grads, **options)
    truth, truth_grads = float64_run(reference, removed, grads, **options)  # the "columns removed" definition
    kept = dict(hidden=got["hidden"], weight=got["weight"][keep_cols], bias=got["bias"][keep_cols])
    for path, o, g in ((f"fused ({backend})", out, kept), ("reference", ref, want)):
        assert_near_float64_run(path, o, g, truth, truth_grads, removed, options["temperature"], names + ("kl",))
    assert torch.equal(got["weight"][banned], torch.zeros_like(got["weight"][banned]))  # exactly 0
    assert torch.equal(got["bias"][banned], torch.zeros_like(got["bias"][banned]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_bias_columns_loss_and_logp(backend):
    _neg_inf_case(backend, with_entropy=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_bias_columns_with_entropy(backend):
    _neg_inf_case(backend, with_entropy=True)


class _LargestOutput(TorchDispatchMode):
    """Records the largest element count of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_n_by_v_is_ever_made():
    """Peak O(chunk x V + V x H): with N x V far above both, no op may produce N x V elements."""
    n, h, v, chunk = 400, 4, 64, 16
    inputs = make_inputs(n=n, h=h, v=v, masked_fraction=0.0, seed=15)
    hidden = inputs["hidden"].requires_grad_(True)
    weight = inputs["weight"].requires_grad_(True)
    rest = {k: t for k, t in inputs.items() if k not in ("hidden", "weight", "bias")}
    grads = random_grads(n, seed=16)
    with _LargestOutput() as mode:
        out = fused(hidden, weight, None, rest, chunk_size=chunk, backend="torch", **OPTIONS)
        sum((getattr(out, k) * t).sum() for k, t in grads.items()).backward()
        linear_log_probs(hidden, weight, inputs["labels"], return_entropy=True, chunk_size=chunk, backend="torch")
    assert mode.largest <= max(chunk * v, v * h, n * h) < n * v, mode.largest


def test_linear_log_probs_matches_token_logprobs():
    inputs = make_inputs(seed=17)
    hidden = inputs["hidden"].requires_grad_(True)  # no graph may be kept even so
    mask = inputs["mask"]
    for backend in BACKENDS:
        for entropy in (True, False):
            logp, ent = linear_log_probs(hidden, inputs["weight"], inputs["labels"], bias=inputs["bias"], mask=mask,
                                         temperature=0.6, return_entropy=entropy, chunk_size=9,
                                         backend=backend)  # fmt: skip
            with Float64Shadow():  # token_logprobs on the float64 lm_head: the truth
                h64, w64, b64 = (inputs[k].detach().double() for k in ("hidden", "weight", "bias"))
                want_logp, want_ent = token_logprobs(h64 @ w64.t() + b64, inputs["labels"], 0.6)
            zero = torch.zeros((), dtype=torch.float64)
            magnitude, length = bound_inputs(inputs, 0.6)
            for name, got, want in (("logp", logp, want_logp), ("entropy", ent, want_ent)):
                if name == "entropy" and not entropy:
                    continue
                scale = max(1.0, want.abs().max().item())
                assert_near_float64(name, got, torch.where(mask, want, zero), fp32_error_bound(magnitude, length, scale),
                                    backend)  # fmt: skip
            assert logp.dtype == torch.float32 and logp.grad_fn is None and not logp.requires_grad
            if entropy:
                assert ent.dtype == torch.float32
            else:
                assert ent is None
    logp, _ = linear_log_probs(hidden, inputs["weight"], inputs["labels"], backend="torch")  # mask None: all rows
    with Float64Shadow():
        want = token_logprobs(inputs["hidden"].detach().double() @ inputs["weight"].double().t(), inputs["labels"])[0]
    magnitude, length = bound_inputs(dict(inputs, bias=None), 1.0)
    assert_near_float64("logp (mask None)", logp, want, fp32_error_bound(magnitude, length, want.abs().max().item()))


N, H, V = 5, 4, 7


def _good(**overrides) -> dict:
    g = torch.Generator().manual_seed(0)
    args = dict(hidden=torch.randn(N, H, generator=g), weight=torch.randn(V, H, generator=g),
                labels=torch.randint(0, V, (N,), generator=g), old_log_probs=-torch.rand(N, generator=g),
                advantages=torch.randn(N, generator=g), mask=torch.ones(N, dtype=torch.bool))  # fmt: skip
    args.update(overrides)
    return args


def _full(message: str) -> str:
    """A pattern matching exactly ``message``."""
    return "^" + re.escape(message) + "$"


BAD = [
    (dict(hidden=torch.randn(N)), _full("hidden must be a [N, H] tensor, got shape torch.Size([5])")),
    (dict(hidden=[[0.0] * H] * N), _full("hidden must be a [N, H] tensor, got shape <class 'list'>")),
    (dict(weight=torch.randn(V)),
     _full("weight must be the lm_head's [V, H] = [V, 4] tensor, got shape torch.Size([7])")),
    (dict(weight=[[0.0] * H] * V),
     _full("weight must be the lm_head's [V, H] = [V, 4] tensor, got shape <class 'list'>")),
    (dict(hidden=torch.randn(N, H, dtype=torch.float64)), "hidden must be float32"),
    (dict(weight=torch.randn(V, H + 1)), "weight must be the lm_head's \\[V, H\\]"),
    (dict(weight=torch.randn(0, H)), _full("weight must have a non-empty vocab dimension V")),
    (dict(weight=torch.randn(V, H, dtype=torch.bfloat16)), "weight must have hidden's dtype and device"),
    (dict(bias=torch.randn(V + 1)), _full("bias must be None or a [V] = [7] tensor, got torch.Size([8])")),
    (dict(bias=[0.5] * V), _full("bias must be None or a [V] = [7] tensor, got [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]")),
    (dict(bias=torch.randn(V, dtype=torch.float16)),
     _full("bias must have hidden's dtype and device, got torch.float16 on cpu")),
    (dict(chunk_size=0), "chunk_size must be None or an integer >= 1"),
    (dict(chunk_size=2.0), "chunk_size must be None or an integer >= 1"),
    (dict(vocab_block=0), "vocab_block must be None or an integer >= 1"),
    (dict(loss_weights=torch.ones(N + 1)), "loss_weights must be None or a float tensor of shape \\[N\\]=\\[5\\]"),
    (dict(check="later"), "check must be one of \\('eager', 'step', 'off'\\), got 'later'"),
    (dict(backend="gpu"), "backend must be one of"),
    # the per-token checks are fused_policy_loss's, with hidden named as the source of N
    (dict(labels=torch.zeros(N + 1, dtype=torch.long)),
     "labels must have shape \\[N\\]=\\[5\\] to match hidden \\[N, H\\]"),
    (dict(advantages=torch.zeros(N, device="meta")), "advantages is on meta but hidden is on cpu"),
    (dict(kl_coef=0.1), "ref_log_probs is required when kl_coef != 0"),
    (dict(temperature=0.0), "temperature must be a finite number > 0"),
    (dict(alpha=2.0), "alpha"),
    (dict(dual_clip=0.5), "dual_clip must be None, inf \\(no dual clip\\) or a finite number > 1, got 0.5"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,message", BAD,
                         ids=[re.sub(r"\W", "", m.split()[0]) + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_a_value_error_before_any_matmul(monkeypatch, overrides, message):
    def forbidden(*args):
        raise AssertionError("a matmul ran on invalid input")

    monkeypatch.setattr(linear_module, "_block_logits", forbidden)
    args = _good(**overrides)
    positional = [args.pop(k) for k in ("hidden", "weight", "labels", "old_log_probs", "advantages", "mask")]
    with pytest.raises(ValueError, match=message):
        fused_linear_policy_loss(*positional, **args)
    if not {"old_log_probs", "advantages", "kl_coef", "alpha", "dual_clip", "loss_weights", "check"} & set(overrides):
        hidden, weight, labels, _, _, mask = positional
        with pytest.raises(ValueError, match=message):
            linear_log_probs(hidden, weight, labels, mask=mask, **args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_logits_row_is_named_by_its_global_index(backend):
    """A NaN hidden row gives a NaN logits row: the error names row 13 of the caller's N, not its row in the chunk."""
    inputs = {k: None if v is None else v.to(_device(backend)) for k, v in make_inputs(seed=18).items()}
    inputs["mask"][:] = True
    inputs["hidden"][13, 2] = float("nan")
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")}
    with pytest.raises(ValueError, match=r"logits row 13 \(unmasked\) has NaN"):
        fused(inputs["hidden"], inputs["weight"], inputs["bias"], rest, chunk_size=5, backend=backend, **OPTIONS)
    with pytest.raises(ValueError, match=r"logits row 13 \(unmasked\) has NaN"):
        linear_log_probs(inputs["hidden"], inputs["weight"], inputs["labels"], chunk_size=5, backend=backend)
    inputs["mask"][13] = False  # the same row masked: never multiplied, no error
    fused(inputs["hidden"], inputs["weight"], inputs["bias"], rest, chunk_size=5, backend=backend, **OPTIONS)


BAD_VALUES = [
    (dict(labels=torch.full((N,), V)), "labels must be token ids in \\[0, V\\) = \\[0, 7\\) on unmasked rows \\(row 0"),
    (dict(old_log_probs=torch.tensor([0.0, -1.0, float("nan"), 0.0, 0.0])),
     "old_log_probs must be finite log-probabilities \\(<= 0, up to 0.001 of rounding\\) on unmasked rows "
     "\\(as float32, the precision of the loss\\) \\(row 2"),
    (dict(old_log_probs=torch.tensor([0.0, 89.0, 0.0, 0.0, 0.0])), "old_log_probs must be finite log-prob.* \\(row 1"),
    (dict(advantages=torch.tensor([0.0, 0.0, 0.0, float("-inf"), 0.0])), "advantages must be finite .* \\(row 3"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,message", BAD_VALUES)
def test_bad_values_are_named_with_their_row_after_the_forward_and_at_the_step(overrides, message):
    """Values are checked as status bits (no host sync): under "eager" the call raises after the forward, naming the
    row; under "step" the call returns (NaN on that row) and the ledger raises the same line, naming the call."""
    from openrlhf_lopti.ops.value_status import StepChecks

    args = _good(**overrides)
    positional = [args.pop(k) for k in ("hidden", "weight", "labels", "old_log_probs", "advantages", "mask")]
    with pytest.raises(ValueError, match=message + "\\)$"):
        fused_linear_policy_loss(*positional, **args)
    out = fused_linear_policy_loss(*positional, check="step", **args)
    assert torch.isnan(out.loss).any() and torch.isfinite(out.loss[out.status.rows == 0]).all()
    checks = StepChecks()
    checks.add(out.status, "micro-batch 3")
    with pytest.raises(ValueError, match=message + " at micro-batch 3\\)$"):
        checks.raise_if_bad()
    checks.raise_if_bad()  # emptied: nothing left to raise
    if "labels" in overrides:
        hidden, weight, labels, _, _, mask = positional
        with pytest.raises(ValueError, match=message):
            linear_log_probs(hidden, weight, labels, mask=mask)


def test_default_block_shape_by_hand():
    # 256 MiB = 268435456 bytes per [R, Vb] block. Every kept row while 1024 columns of them fit: bf16 up to
    # 131072 rows, fp32 65536. At N = 16384, V = 151936 bf16: every row, 8192 columns; fp32: 4096. A vocabulary
    # narrower than 1024 gives the rows room for all of it.
    assert default_block_shape(16384, 151936, torch.bfloat16) == (16384, 8192)
    assert default_block_shape(16384, 151936, torch.float32) == (16384, 4096)
    assert default_block_shape(10**6, 151936, torch.bfloat16) == (131072, 1024)
    assert default_block_shape(10**6, 151936, torch.float32) == (65536, 1024)
    assert default_block_shape(37, 50, torch.float32) == (37, 50)
    assert default_block_shape(0, 50, torch.float32) == (1, 50)


def test_defaults_are_the_textbook_loss():
    # fused_linear_policy_loss with no options: alpha 0 (no AR), eps 0.2 / 0.2, no dual clip, no KL, T = 1, no
    # entropy; checked against the loss written out in tests/kernel_cases.py with those values, on logits made
    # in float64 by the test.
    inputs = make_inputs(seed=19)
    with torch.no_grad():  # old log-probs near the current ones at T = 1 (make_inputs's are at T = 0.7)
        logp, _ = token_logprobs(torch.addmm(inputs["bias"], inputs["hidden"], inputs["weight"].t()), inputs["labels"])
    noise = 0.3 * torch.randn(37, generator=torch.Generator().manual_seed(19))
    inputs["old_log_probs"] = (logp + noise).clamp(max=0.0)  # log-probs are <= 0
    hidden, weight, bias = (inputs[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    out = fused_linear_policy_loss(hidden, weight, inputs["labels"], inputs["old_log_probs"], inputs["advantages"],
                                   inputs["mask"], bias=bias, backend="torch")  # fmt: skip
    assert out.entropy is None and not out.kl.requires_grad and not out.clipped.requires_grad
    out.loss.sum().backward()
    leaves = [inputs[k].double().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    logits = torch.addmm(leaves[2], leaves[0], leaves[1].t())
    opts = dict(alpha=0.0, eps_low=0.2, eps_high=0.2, dual_clip=None, kl_coef=0.0, kl_estimator="k3", temperature=1.0)
    want = textbook_policy_loss(dict(inputs, ref_log_probs=None), opts, logits)
    ratio = (want["logp"] - inputs["old_log_probs"].double()).exp()
    keep, adv = inputs["mask"], inputs["advantages"]
    assert (keep & (ratio > 1.2) & (adv > 0)).any() and (keep & (ratio < 0.8) & (adv < 0)).any()  # both clips bind
    want["loss"].sum().backward()
    _assert_near_textbook(out, want, (hidden, weight, bias), leaves, inputs, 1.0, ("loss", "logp", "kl"))


def test_linear_log_probs_returns_no_entropy_by_default():
    inputs = make_inputs(seed=20)
    logp, entropy = linear_log_probs(inputs["hidden"], inputs["weight"], inputs["labels"], backend="torch")
    assert entropy is None and logp.shape == (37,)


def test_kl_and_clipped_are_not_differentiable():
    # As fused_policy_loss: kl and clipped come detached (a loss built on kl would otherwise get a silent zero
    # gradient: the backward ignores kl's incoming gradient).
    inputs = make_inputs(seed=21)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")}
    out = fused(hidden, inputs["weight"], inputs["bias"], rest, chunk_size=8, backend="torch", **OPTIONS)
    assert out.loss.requires_grad and out.logp.requires_grad and out.entropy.requires_grad
    assert not out.kl.requires_grad and out.kl.grad_fn is None
    assert not out.clipped.requires_grad


def test_every_option_reaches_the_kernel():
    # Every option away from its default (eps_low 0.1, k2, ...), against the textbook loss on float64 logits.
    inputs = make_inputs(seed=23)
    with torch.no_grad():  # old log-probs near the current ones with the bias (make_inputs's have none)
        logp, _ = token_logprobs(torch.addmm(inputs["bias"], inputs["hidden"], inputs["weight"].t()), inputs["labels"],
                                 0.7)  # fmt: skip
    noise = 0.3 * torch.randn(37, generator=torch.Generator().manual_seed(23))
    inputs["old_log_probs"] = (logp + noise).clamp(max=0.0)  # log-probs are <= 0
    opts = dict(alpha=0.3, eps_low=0.1, eps_high=0.3, dual_clip=2.0, kl_coef=0.1, kl_estimator="k2", temperature=0.7)
    hidden, weight, bias = (inputs[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")}
    out = fused(hidden, weight, bias, rest, chunk_size=6, backend="torch", return_entropy=True, **opts)
    (out.loss.sum() + 0.5 * out.entropy.sum()).backward()
    leaves = [inputs[k].double().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    want = textbook_policy_loss(inputs, opts, torch.addmm(leaves[2], leaves[0], leaves[1].t()))
    ratio = (want["logp"] - inputs["old_log_probs"].double()).exp()
    keep, adv = inputs["mask"], inputs["advantages"]
    assert (keep & (ratio < 0.9) & (ratio > 0.8) & (adv < 0)).any()  # eps_low 0.1 binds where 0.2 would not
    (want["loss"].sum() + 0.5 * want["entropy"].sum()).backward()
    _assert_near_textbook(out, want, (hidden, weight, bias), leaves, inputs, 0.7, ("loss", "logp", "kl", "entropy"))


@pytest.mark.parametrize("bias", [True, False])
def test_block_logits_are_written_into_one_reused_buffer(monkeypatch, bias):
    # The [R, Vb] logits go into one buffer made per pass (no fresh allocation per block), with no resize.
    seen = []
    real = linear_module._block_logits

    def spy(hidden_rows, weight, bias, cols, buffer):
        result = real(hidden_rows, weight, bias, cols, buffer)
        seen.append((buffer.untyped_storage().data_ptr(), result.data_ptr() == buffer.data_ptr(), tuple(result.shape)))
        return result

    monkeypatch.setattr(linear_module, "_block_logits", spy)
    inputs = make_inputs(seed=24, bias=bias, masked_fraction=0.0)
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")}
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in ("hidden", "weight")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it has to resize an `out=` tensor
        out = fused(leaves["hidden"], leaves["weight"], inputs["bias"], rest, chunk_size=20, vocab_block=30,
                    backend="torch", **OPTIONS)  # fmt: skip
        out.loss.sum().backward()
    assert [shape for _, _, shape in seen] == [(20, 30), (20, 20), (17, 30), (17, 20)] * 2
    assert all(same for _, same, _ in seen)
    forward, backward = {ptr for ptr, _, _ in seen[:4]}, {ptr for ptr, _, _ in seen[4:]}
    assert len(forward) == 1 and len(backward) == 1
    # and the values are the lm_head's columns
    h, w = inputs["hidden"][:10], inputs["weight"]
    buffer = torch.empty(12 * 30)
    got = real(h, w, inputs["bias"], slice(20, 50), buffer)
    assert got.data_ptr() == buffer.data_ptr() and got.shape == (10, 30)
    with Float64Shadow():
        want = h.double() @ w[20:].double().t() + (0.0 if inputs["bias"] is None else inputs["bias"][20:].double())
    magnitude, length = bound_inputs(dict(inputs, hidden=h), 1.0)
    assert_near_float64("block logits", got, want, fp32_error_bound(magnitude, inputs["weight"].shape[1], 1.0))


def test_default_blocks_of_a_bf16_model_count_two_bytes_a_logit(monkeypatch):
    inputs = make_inputs(dtype=torch.bfloat16, masked_fraction=0.0)  # V = 50, N = 37
    monkeypatch.setattr(linear_module, "DEFAULT_BLOCK_BYTES", 37 * 2 * 20 + 73)  # 20 bf16 columns (fp32 would be 10)
    monkeypatch.setattr(linear_module, "MIN_VOCAB_BLOCK", 8)
    recorder = _Recorder(linear_module._block_logits)
    monkeypatch.setattr(linear_module, "_block_logits", recorder)
    run(fused, inputs, random_grads(37, seed=2), backend="torch", **OPTIONS)
    assert recorder.blocks == [(37, 20), (37, 20), (37, 10)] * 2


def test_outputs_are_float32_whatever_the_default_dtype():
    inputs = make_inputs(seed=22)
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = fused(inputs["hidden"], inputs["weight"], inputs["bias"], rest, chunk_size=8, backend="torch", **OPTIONS)
        logp, entropy = linear_log_probs(inputs["hidden"], inputs["weight"], inputs["labels"], bias=inputs["bias"],
                                         return_entropy=True, chunk_size=8, backend="torch")  # fmt: skip
    finally:
        torch.set_default_dtype(default)
    for name in ("loss", "logp", "kl", "entropy"):
        assert getattr(out, name).dtype == torch.float32, name
    assert logp.dtype == entropy.dtype == torch.float32
    truth, _ = float64_run(reference, inputs, {"loss": torch.ones(37)}, **OPTIONS)
    assert_near_float64_run("fused (torch)", out, {}, truth, {}, inputs, OPTIONS["temperature"], ("loss",))


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if cpp_module.cpp_available() else []))
def test_a_row_that_overflows_at_the_temperature_is_named_with_it(backend):
    # Finite logits of 2e38 in row 13 overflow float32 once divided by T = 0.5: the error names row 13 of the
    # caller's N (row 3 of its chunk) and the temperature.
    inputs = make_inputs(seed=25, masked_fraction=0.0)
    inputs["hidden"][:, 0] = 0.0
    inputs["hidden"][13] = 0.0
    inputs["hidden"][13, 0] = 1e19
    inputs["weight"][:, 0] = 2e19
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")}
    message = (
        "logits row 13 (unmasked) has finite values that overflow float32 when divided by temperature=0.5; logits "
        "must be finite or -inf, with a finite value in every unmasked row (NaN / +inf logits usually mean the "
        "model diverged)"
    )
    opts = dict(OPTIONS, temperature=0.5)
    with pytest.raises(ValueError) as error:
        fused(inputs["hidden"], inputs["weight"], None, rest, chunk_size=5, backend=backend, **opts)
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        linear_log_probs(inputs["hidden"], inputs["weight"], inputs["labels"], temperature=0.5, chunk_size=5,
                         backend=backend)  # fmt: skip
    assert str(error.value) == message


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_derivative_is_refused_never_silently_wrong(backend):
    """Under ``create_graph=True`` the lm_head's block gradients (no graph) would be constants of a second derivative,
    which then silently missed their terms (measured: 0 where the reference's is 73); it is refused in one line."""
    inputs = make_inputs(n=9, h=8, v=20)
    hidden = inputs["hidden"].requires_grad_(True)
    out = fused_linear_policy_loss(hidden, inputs["weight"], inputs["labels"], inputs["old_log_probs"],
                                   inputs["advantages"], inputs["mask"], bias=inputs["bias"], backend=backend)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"^fused_linear_policy_loss: a second derivative .* fused_policy_loss"):
        torch.autograd.grad(out.loss.sum(), hidden, create_graph=True)


def test_old_ref_log_probs_and_advantages_are_constants_of_the_loss():
    # an old_log_probs still attached to the graph (a missed .detach()) must not cancel the ratio's gradient, as
    # on fused_policy_loss's cpp / triton backends: only the log-prob carries a gradient
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 5, generator=g).requires_grad_(True)
    weight = torch.randn(7, 5, generator=g)
    labels = torch.randint(0, 7, (4,), generator=g)
    advantages = torch.randn(4, generator=g).requires_grad_(True)
    mask = torch.ones(4, dtype=torch.bool)
    grads = []
    for attached in (True, False):
        hidden.grad = None
        logp = torch.log_softmax(hidden @ weight.t(), -1).gather(1, labels[:, None]).squeeze(1)
        old = logp - 0.05 if attached else (logp - 0.05).detach()
        out = fused_linear_policy_loss(hidden, weight, labels, old, advantages if attached else advantages.detach(),
                                       mask, ref_log_probs=old - 0.1, kl_coef=0.1, backend="torch")  # fmt: skip
        out.loss.sum().backward()
        grads.append(hidden.grad.clone())
    assert grads[1].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1])
    assert advantages.grad is None
