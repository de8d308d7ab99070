"""``fused_linear_policy_loss`` / ``linear_log_probs`` against the torch reference ``hidden @ W.T (+ b)`` then
``policy_loss_from_logits`` / ``token_logprobs``: values, and gradients to hidden, weight and bias under arbitrary
per-token gradients on loss, logp and entropy at once; chunking, masking, tied weights, -inf bias columns,
memory (no [N, V] tensor), and the input checks."""

import importlib
import re
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import openrlhf_lopti.ops.cpp_policy_loss as cpp_module
from openrlhf_lopti.algo import policy_loss_from_logits, token_logprobs
from openrlhf_lopti.ops import fused_linear_policy_loss, linear_log_probs
from openrlhf_lopti.ops.fused_linear_policy_loss import default_chunk_size

from .kernel_cases import textbook_policy_loss

linear_module = importlib.import_module("openrlhf_lopti.ops.fused_linear_policy_loss")

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
        old_log_probs=logp + 0.3 * torch.randn(n, generator=g),
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


def assert_matches(out, ref, grads, ref_grads, atol=1e-5, rtol=1e-4):
    for name in ("loss", "logp", "kl", "entropy"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), atol=atol, rtol=rtol)
    assert torch.equal(out.clipped, ref.clipped)
    assert set(grads) == set(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name].float(), ref_grads[name].float(), atol=atol, rtol=rtol)


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference_with_gradients_on_loss_logp_and_entropy(backend, bias):
    inputs = {k: None if v is None else v.to(_device(backend)) for k, v in make_inputs(bias=bias).items()}
    grads = {k: v.to(_device(backend)) for k, v in random_grads(37).items()}
    # chunk 8 divides neither the kept rows nor N = 37
    assert int(inputs["mask"].sum()) % 8
    out, got = run(fused, inputs, grads, chunk_size=8, backend=backend, **OPTIONS)
    ref, want = run(reference, inputs, grads, **OPTIONS)
    assert out.clipped.any() and not out.clipped.all()  # the clip binds on some rows only
    assert_matches(out, ref, got, want)
    mask = inputs["mask"]
    assert not mask.all() and torch.all(got["hidden"][~mask] == 0)


@pytest.mark.parametrize("chunk_size", [1, 5, 28, 1000, None])
def test_any_chunk_size_gives_the_same_result(chunk_size):
    inputs = make_inputs()
    grads = random_grads(37, seed=2)
    out, got = run(fused, inputs, grads, chunk_size=chunk_size, backend="torch", **OPTIONS)
    ref, want = run(reference, inputs, grads, **OPTIONS)
    assert_matches(out, ref, got, want)


def test_default_chunks_fill_the_byte_budget_forward_one_buffer_backward_two(monkeypatch):
    inputs = make_inputs()  # V = 50 fp32: 200 bytes per row of logits
    monkeypatch.setattr(linear_module, "DEFAULT_CHUNK_BYTES", 8 * 200 + 199)
    recorder = _Recorder(linear_module._chunk_logits)
    monkeypatch.setattr(linear_module, "_chunk_logits", recorder)
    grads = random_grads(37, seed=2)
    out, got = run(fused, inputs, grads, backend="torch", **OPTIONS)
    kept = int(inputs["mask"].sum())
    assert kept % 8 and kept % 4  # the last chunk is partial in both passes
    forward, backward = [min(8, kept - s) for s in range(0, kept, 8)], [min(4, kept - s) for s in range(0, kept, 4)]
    assert recorder.rows == forward + backward  # forward: 8 rows (one buffer), backward: 4 (two buffers)
    ref, want = run(reference, inputs, grads, **OPTIONS)
    assert_matches(out, ref, got, want)


@pytest.mark.parametrize("grad_on", [("loss",), ("logp",), ("entropy",), ("loss", "entropy")])
def test_each_output_alone_carries_its_gradient(grad_on):
    inputs = make_inputs(seed=3)
    grads = random_grads(37, seed=4, names=grad_on)
    out, got = run(fused, inputs, grads, chunk_size=6, backend="torch", **OPTIONS)
    ref, want = run(reference, inputs, grads, **OPTIONS)
    assert_matches(out, ref, got, want)


def test_temperature_and_no_kl_no_entropy():
    inputs = make_inputs(seed=5)
    options = dict(temperature=1.7, alpha=0.0, eps_high=0.2, return_entropy=False)
    grads = random_grads(37, seed=6, names=("loss", "logp"))
    out, got = run(fused, inputs, grads, chunk_size=7, backend="torch", **options)
    ref, want = run(reference, inputs, grads, **options)
    assert out.entropy is None and ref.entropy is None
    for name in ("loss", "logp", "kl"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), atol=1e-5, rtol=1e-4)
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if cpp_module.cpp_available() else []))
def test_bfloat16_tiny(backend, monkeypatch):
    monkeypatch.setattr(linear_module, "_GRAD_WEIGHT_BLOCK", 7)  # grad_W summed over 4 vocab blocks (24 = 3 x 7 + 3)
    inputs = make_inputs(n=9, h=8, v=24, dtype=torch.bfloat16, seed=7)
    grads = random_grads(9, seed=8)
    out, got = run(fused, inputs, grads, chunk_size=4, backend=backend, **OPTIONS)
    ref, want = run(reference, inputs, grads, **OPTIONS)  # bf16 logits, bf16 lm_head backward
    assert got["hidden"].dtype == got["weight"].dtype == got["bias"].dtype == torch.bfloat16
    for name in ("loss", "logp", "entropy"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), atol=1e-3, rtol=1e-3)
    # The reference rounds grad_W once from a bf16 GEMM over all rows; ours sums chunks in fp32: an ulp apart.
    for name in got:
        torch.testing.assert_close(got[name].float(), want[name].float(), atol=2e-2, rtol=1e-2)


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


def test_tied_embedding_gets_both_gradients():
    """The lm_head weight is the input embedding: its gradient must add to the embedding's."""
    v, h, n = 30, 8, 20
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, v, (n,), generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    old, adv = -torch.rand(n, generator=g) * 3, torch.randn(n, generator=g)
    grads = random_grads(n, seed=10)
    results = []
    for use_fused in (True, False):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(v, h)
        mix = torch.nn.Linear(h, h)
        hidden = torch.tanh(mix(embedding(ids)))
        if use_fused:
            out = fused_linear_policy_loss(hidden, embedding.weight, labels, old, adv, mask, chunk_size=3,
                                           backend="torch", **OPTIONS | dict(kl_coef=0.0))  # fmt: skip
        else:
            out = policy_loss_from_logits(hidden @ embedding.weight.t(), labels, old, adv, mask,
                                          **OPTIONS | dict(kl_coef=0.0))  # fmt: skip
        sum((getattr(out, k) * t).sum() for k, t in grads.items()).backward()
        results.append((embedding.weight.grad, mix.weight.grad))
    (emb_fused, mix_fused), (emb_ref, mix_ref) = results
    torch.testing.assert_close(emb_fused, emb_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(mix_fused, mix_ref, atol=1e-5, rtol=1e-4)
    assert emb_ref[ids[mask]].abs().sum() > 0


class _Recorder:
    def __init__(self, real):
        self.real, self.rows = real, []

    def __call__(self, hidden_rows, weight, bias, out):
        self.rows.append(hidden_rows.shape[0])
        return self.real(hidden_rows, weight, bias, out)


def test_masked_rows_never_reach_the_matmul(monkeypatch):
    inputs = make_inputs(seed=11)
    mask = inputs["mask"]
    inputs["hidden"][~mask] = float("nan")  # padding garbage: must not touch any output or gradient
    recorder = _Recorder(linear_module._chunk_logits)
    monkeypatch.setattr(linear_module, "_chunk_logits", recorder)
    out, got = run(fused, inputs, random_grads(37), chunk_size=10, backend="torch", **OPTIONS)
    kept = int(mask.sum())
    assert recorder.rows == [10, 10, kept - 20] * 2  # forward, then the backward's recompute
    assert all(torch.isfinite(t).all() for t in got.values())
    assert torch.isfinite(out.loss).all() and torch.all(out.loss[~mask] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_masked_is_zero_and_runs_no_matmul(monkeypatch, dtype):
    inputs = make_inputs(n=6, h=4, v=10, dtype=dtype, masked_fraction=1.0)
    assert not inputs["mask"].any()
    recorder = _Recorder(linear_module._chunk_logits)
    monkeypatch.setattr(linear_module, "_chunk_logits", recorder)
    out, got = run(fused, inputs, random_grads(6), backend="torch", **OPTIONS)
    assert recorder.rows == []
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
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    reference(ref_hidden, weight, None, rest, **OPTIONS).loss.sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, atol=1e-5, rtol=1e-4)


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
    for name in names + ("kl",):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["hidden"], want["hidden"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["weight"][keep_cols], want["weight"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["bias"][keep_cols], want["bias"], atol=1e-5, rtol=1e-4)
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
            want_logp, want_ent = token_logprobs(hidden.detach() @ inputs["weight"].t() + inputs["bias"],
                                                 inputs["labels"], 0.6)  # fmt: skip
            zero = torch.zeros(())
            torch.testing.assert_close(logp, torch.where(mask, want_logp, zero), atol=1e-5, rtol=1e-4)
            assert logp.dtype == torch.float32 and logp.grad_fn is None and not logp.requires_grad
            if entropy:
                torch.testing.assert_close(ent, torch.where(mask, want_ent, zero), atol=1e-5, rtol=1e-4)
            else:
                assert ent is None
    logp, _ = linear_log_probs(hidden, inputs["weight"], inputs["labels"], backend="torch")  # mask None: all rows
    torch.testing.assert_close(logp, token_logprobs(hidden.detach() @ inputs["weight"].t(), inputs["labels"])[0])


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
    (dict(backend="gpu"), "backend must be one of"),
    # the per-token checks are fused_policy_loss's, with hidden named as the source of N
    (dict(labels=torch.zeros(N + 1, dtype=torch.long)),
     "labels must have shape \\[N\\]=\\[5\\] to match hidden \\[N, H\\]"),
    (dict(labels=torch.full((N,), V)), "labels must be token ids in \\[0, V\\) = \\[0, 7\\)"),
    (dict(old_log_probs=torch.full((N,), float("nan"))), "old_log_probs must be finite"),
    (dict(advantages=torch.zeros(N, device="meta")), "advantages is on meta but hidden is on cpu"),
    (dict(kl_coef=0.1), "ref_log_probs is required when kl_coef != 0"),
    (dict(temperature=0.0), "temperature must be a finite number > 0"),
    (dict(alpha=2.0), "alpha"),
    (dict(dual_clip=0.5), "dual_clip must be None or a finite number > 1, got 0.5"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,message", BAD,
                         ids=[re.sub(r"\W", "", m.split()[0]) + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_a_value_error_before_any_matmul(monkeypatch, overrides, message):
    def forbidden(*args):
        raise AssertionError("a matmul ran on invalid input")

    monkeypatch.setattr(linear_module, "_chunk_logits", forbidden)
    args = _good(**overrides)
    positional = [args.pop(k) for k in ("hidden", "weight", "labels", "old_log_probs", "advantages", "mask")]
    with pytest.raises(ValueError, match=message):
        fused_linear_policy_loss(*positional, **args)
    if not {"old_log_probs", "advantages", "kl_coef", "alpha", "dual_clip"} & set(overrides):  # not in linear_log_probs
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


def test_default_chunk_size_by_hand():
    # 256 MiB = 268435456 bytes of [chunk, V] buffers. At V = 151936: fp32 rows 607744 bytes -> 441 rows for one
    # buffer, 220 for two; bf16 / fp16 rows 303872 bytes -> 883 and 441. A vocab whose one row is over the
    # budget still gets chunks of 1 row.
    assert default_chunk_size(151936, torch.float32) == 441
    assert default_chunk_size(151936, torch.float32, buffers=2) == 220
    assert default_chunk_size(151936, torch.bfloat16) == 883
    assert default_chunk_size(151936, torch.float16, buffers=2) == 441
    assert default_chunk_size(2**27, torch.float32) == 1  # 2 GiB per row (budget // row = 0)
    assert default_chunk_size(2**26, torch.bfloat16, buffers=2) == 1


def test_linear_log_probs_default_chunk_is_one_buffer_in_the_models_dtype(monkeypatch):
    inputs = make_inputs(dtype=torch.bfloat16, masked_fraction=0.0)  # V = 50 bf16: 100 bytes per row of logits
    monkeypatch.setattr(linear_module, "DEFAULT_CHUNK_BYTES", 8 * 100 + 99)  # 8 rows (fp32 rows would give 4)
    recorder = _Recorder(linear_module._chunk_logits)
    monkeypatch.setattr(linear_module, "_chunk_logits", recorder)
    linear_log_probs(inputs["hidden"], inputs["weight"], inputs["labels"], backend="torch")
    assert recorder.rows == [8, 8, 8, 8, 5]  # N = 37


def test_defaults_are_the_textbook_loss():
    # fused_linear_policy_loss with no options: alpha 0 (no AR), eps 0.2 / 0.2, no dual clip, no KL, T = 1, no
    # entropy; checked against the loss written out in tests/kernel_cases.py with those values, on logits made
    # in float64 by the test.
    inputs = make_inputs(seed=19)
    with torch.no_grad():  # old log-probs near the current ones at T = 1 (make_inputs's are at T = 0.7)
        logp, _ = token_logprobs(torch.addmm(inputs["bias"], inputs["hidden"], inputs["weight"].t()), inputs["labels"])
    inputs["old_log_probs"] = logp + 0.3 * torch.randn(37, generator=torch.Generator().manual_seed(19))
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
    for name in ("loss", "logp", "kl"):
        torch.testing.assert_close(getattr(out, name).double(), want[name].detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.clipped, want["clipped"])
    for mine, ref in zip((hidden, weight, bias), leaves):
        torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


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
    inputs["old_log_probs"] = logp + 0.3 * torch.randn(37, generator=torch.Generator().manual_seed(23))
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
    for name in ("loss", "logp", "kl", "entropy"):
        torch.testing.assert_close(getattr(out, name).double(), want[name].detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.clipped, want["clipped"])
    for mine, ref in zip((hidden, weight, bias), leaves):
        torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_chunk_logits_are_written_into_one_reused_buffer(monkeypatch, bias):
    # The [chunk, V] logits go into one buffer made per pass (no fresh allocation per chunk), with no resize.
    seen = []
    real = linear_module._chunk_logits

    def spy(hidden_rows, weight, bias, out):
        result = real(hidden_rows, weight, bias, out)
        seen.append((out.untyped_storage().data_ptr(), result.data_ptr() == out.data_ptr(), tuple(result.shape)))
        return result

    monkeypatch.setattr(linear_module, "_chunk_logits", spy)
    inputs = make_inputs(seed=24, bias=bias, masked_fraction=0.0)
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")}
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in ("hidden", "weight")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it has to resize an `out=` tensor
        out = fused(leaves["hidden"], leaves["weight"], inputs["bias"], rest, chunk_size=10, backend="torch",
                    **OPTIONS)  # fmt: skip
        out.loss.sum().backward()
    assert [shape for _, _, shape in seen] == [(10, 50), (10, 50), (10, 50), (7, 50)] * 2
    assert all(same for _, same, _ in seen)
    forward, backward = {ptr for ptr, _, _ in seen[:4]}, {ptr for ptr, _, _ in seen[4:]}
    assert len(forward) == 1 and len(backward) == 1
    # and the values are the lm_head's
    h, w = inputs["hidden"][:10], inputs["weight"]
    buffer = torch.empty(12, 50)
    got = real(h, w, inputs["bias"], buffer[:10])
    want = h @ w.t() if inputs["bias"] is None else h @ w.t() + inputs["bias"]
    assert got.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(got, want)


def test_default_chunks_of_a_bf16_model_count_two_bytes_a_logit(monkeypatch):
    inputs = make_inputs(dtype=torch.bfloat16, masked_fraction=0.0)  # V = 50 bf16: 100 bytes per row of logits
    monkeypatch.setattr(linear_module, "DEFAULT_CHUNK_BYTES", 8 * 100 + 99)
    recorder = _Recorder(linear_module._chunk_logits)
    monkeypatch.setattr(linear_module, "_chunk_logits", recorder)
    out, _ = run(fused, inputs, random_grads(37, seed=2), backend="torch", **OPTIONS)
    assert recorder.rows == [8, 8, 8, 8, 5] + [4] * 9 + [1]  # forward 8 rows (one buffer), backward 4 (two)


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
    ref = reference(inputs["hidden"], inputs["weight"], inputs["bias"], rest, **OPTIONS)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-4)


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
