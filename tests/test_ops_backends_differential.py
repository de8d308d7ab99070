"""Every backend of ``fused_policy_loss`` (torch, cpp, triton) against the reference on the same inputs, where
logits are not just random numbers: -inf columns are exact (issue 15), NaN / +inf rows raise the reference's
own ``ValueError`` on every backend, and a hypothesis fuzz mixes shapes (V=1, V off the block sizes), dtypes,
extreme magnitudes, -inf patterns and every option. The reference itself is pinned against hand formulas and
the "columns removed" definition in ``tests/test_algo_policy_loss.py``.

Triton runs in interpreter mode without a GPU (tests/conftest.py): shapes stay tiny.
"""

import functools
import os
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from openrlhf_lopti.algo import policy_loss_from_logits
from openrlhf_lopti.ops import fused_policy_loss
from openrlhf_lopti.ops.cpp_policy_loss import cpp_available

from .kernel_cases import assert_near_truth, max_weight
from .numerics import Float64Shadow

# A bad row's NaN arithmetic runs in numpy under the Triton interpreter before the flag raises.
pytestmark = [pytest.mark.filterwarnings(f"ignore:{what} encountered:RuntimeWarning")
              for what in ("invalid value", "divide by zero", "overflow")]  # fmt: skip

INF = float("inf")
BACKENDS = ["torch", "cpp", "triton"]
BLOCK_V_ENV = "OPENRLHF_LOPTI_TRITON_BLOCK_V"


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _run(backend: str, inputs: dict, opts: dict, upstream: dict):
    """``(outputs, logits gradient)`` of one backend (or the reference), or ``(error message, None)``."""
    device = "cpu" if backend == "reference" else _device(backend)
    on = {k: (v.to(device) if v is not None else None) for k, v in inputs.items()}
    logits = on.pop("logits").detach().clone().requires_grad_(True)
    fn = policy_loss_from_logits if backend == "reference" else functools.partial(fused_policy_loss, backend=backend)
    try:
        out = fn(logits, on["labels"], on["old_log_probs"], on["advantages"], on["mask"],
                 ref_log_probs=on["ref_log_probs"], **opts)  # fmt: skip
    except ValueError as exc:
        return str(exc), None
    fields = [name for name in upstream if getattr(out, name) is not None]  # the outputs differentiated
    sum(((getattr(out, name) * upstream[name].to(device)).sum() for name in fields)).backward()
    return out, logits.grad.cpu()


def assert_backends_agree(inputs: dict, opts: dict, backends=BACKENDS, block_v=None, seed=0,
                          differentiate=("loss", "logp", "entropy")) -> str:  # fmt: skip
    """Each backend gives the reference's outputs and the gradient of a random weighting of the outputs in
    ``differentiate``, or raises the reference's error.

    Beyond closeness: -inf logits (off the label) get exactly 0 gradient, every output but ``logp`` is
    finite, and ``logp`` is -inf exactly where the reference's is. Returns ``"ok"`` or ``"error"``.
    """
    assert cpp_available(), "the C++ kernel must be built for this test"
    g = torch.Generator().manual_seed(seed)
    n = inputs["labels"].shape[0]
    upstream = {k: torch.randn(n, generator=g) for k in differentiate}
    want, want_grad = _run("reference", inputs, opts, upstream)
    temperature = opts.get("temperature", 1.0)
    if not isinstance(want, str):
        # the truth every path is measured against: the reference on the same inputs in float64
        inputs64 = dict(inputs, logits=inputs["logits"].double())
        with Float64Shadow():
            truth, truth_grad = _run("reference", inputs64, opts, {k: v.double() for k, v in upstream.items()})
        assert_near_truth("reference", want, want_grad, truth, truth_grad, inputs["logits"], temperature, max_weight(upstream))
    logits = inputs["logits"].float()
    keep = inputs["mask"].bool()
    dead = (logits == -INF) & keep[:, None]
    rows = torch.arange(n)[keep]
    dead[rows, inputs["labels"][keep]] = False  # the label's column gets logp's gradient (module docstring)
    for backend in backends:
        env = {BLOCK_V_ENV: str(block_v)} if backend == "triton" and block_v else {}
        with mock.patch.dict(os.environ, env):
            got, grad = _run(backend, inputs, opts, upstream)
        if isinstance(want, str):
            assert got == want, f"{backend}: expected the reference's error {want!r}, got {got!r}"
            continue
        assert not isinstance(got, str), f"{backend} raised {got!r}; the reference did not"
        for name in ("loss", "logp", "kl", "entropy"):
            a, b = getattr(got, name), getattr(want, name)
            if b is None:
                assert a is None, name
                continue
            a, b = a.detach().cpu(), b.detach()
            if name != "logp":
                assert torch.isfinite(a).all(), f"{backend}: non-finite {name}: {a}"
            assert torch.equal(a == -INF, b == -INF), f"{backend}: -inf {name} differs"
        assert torch.equal(got.clipped.cpu(), want.clipped), f"{backend}: clipped differs"
        assert grad.dtype == inputs["logits"].dtype and torch.isfinite(grad.float()).all(), backend
        assert torch.all(grad[dead] == 0), f"{backend}: a -inf logit got a nonzero gradient"
        assert_near_truth(backend, got, grad, truth, truth_grad, inputs["logits"], temperature, max_weight(upstream))
    return "error" if isinstance(want, str) else "ok"


def _inputs(n=6, v=50, dtype=torch.float32, seed=0, scale=3.0, offset=0.0, old_spread=0.3, ref=True, mask=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * scale + offset
    labels = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    return {
        "logits": logits.to(dtype),
        "labels": labels,
        "old_log_probs": (logp + torch.randn(n, generator=g) * old_spread).clamp(max=0.0),  # log-probs are <= 0
        "advantages": torch.randn(n, generator=g),
        "mask": torch.ones(n, dtype=torch.bool) if mask is None else mask,
        "ref_log_probs": logp + torch.randn(n, generator=g) * 0.5 if ref else None,
    }


def _opts(kl="k2", entropy=True, temperature=0.7, alpha=0.3, dual_clip=3.0):
    return dict(alpha=alpha, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip, kl_coef=0.05 if kl else 0.0,
                kl_estimator=kl or "k3", temperature=temperature, return_entropy=entropy)  # fmt: skip


def _minus_inf(inputs: dict, pattern: str) -> dict:
    logits, labels = inputs["logits"].clone(), inputs["labels"].clone()
    n, v = logits.shape
    if pattern == "columns":  # padded vocab: whole columns, the labels elsewhere
        cols = torch.arange(v)[torch.arange(v) % 3 == 1]
        logits[:, cols] = -INF
        labels = torch.where(labels % 3 == 1, labels - 1, labels)
    elif pattern == "label":  # some rows' label is -inf (logp = -inf)
        logits[[0, 2], labels[[0, 2]]] = -INF
    elif pattern == "all-but-one":  # one live token per row; on row 1 it is not the label
        logits[:] = -INF
        live = labels.clone()
        live[1] = (labels[1] + 1) % v
        logits[torch.arange(n), live] = inputs["logits"][torch.arange(n), live]
    elif pattern == "leading-blocks":  # the first blocks of the online log-sum-exp see only -inf
        logits[:, :40] = -INF
        labels = 40 + labels % (v - 40)
    return dict(inputs, logits=logits, labels=labels)


PATTERNS = ["columns", "label", "all-but-one", "leading-blocks"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_minus_inf_logits_are_exact_on_every_backend(pattern, dtype, kl):
    inputs = _minus_inf(_inputs(dtype=dtype, seed=PATTERNS.index(pattern)), pattern)
    assert assert_backends_agree(inputs, _opts(kl=kl), block_v=16) == "ok"


@pytest.mark.parametrize("pattern", ["columns", "label"])
def test_loss_gradient_alone_while_entropy_is_returned(pattern):
    """Entropy requested for logging but not differentiated: the loss gradient must not see 0 * log 0."""
    inputs = _minus_inf(_inputs(seed=5), pattern)
    assert assert_backends_agree(inputs, _opts(kl="k3"), block_v=16, differentiate=("loss",)) == "ok"


BAD_VALUES = {
    "nan": lambda row: row.index_fill_(0, torch.tensor([7]), float("nan")),
    "+inf": lambda row: row.index_fill_(0, torch.tensor([3]), INF),
    "all -inf": lambda row: row.fill_(-INF),
    "overflow at T=0.5": lambda row: row.index_fill_(0, torch.tensor([2]), 3e38),
}


# fp16 cannot hold a logit that overflows fp32 at T=0.5
BAD_CASES = [(kind, dtype) for kind in BAD_VALUES for dtype in (torch.float32, torch.bfloat16, torch.float16)
             if not (kind.startswith("overflow") and dtype == torch.float16)]  # fmt: skip


@pytest.mark.parametrize("kind,dtype", BAD_CASES, ids=[f"{k}-{_name(d)}" for k, d in BAD_CASES])
def test_nan_or_plus_inf_is_the_same_error_on_every_backend(kind, dtype):
    inputs = _inputs(n=7, v=40, dtype=dtype, seed=3)
    for row in (2, 5):  # two bad rows: the first is named
        BAD_VALUES[kind](inputs["logits"][row])
    opts = _opts(temperature=0.5)
    assert assert_backends_agree(inputs, opts) == "error"
    message = _run("reference", inputs, opts, {k: torch.ones(7) for k in ("loss", "logp", "entropy")})[0]
    assert message.startswith("logits row 2 "), message
    inputs["mask"][[2, 5]] = False  # the same values on masked rows are padding: no error anywhere
    assert assert_backends_agree(inputs, opts) == "ok"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_name)
def test_vocab_of_one(dtype):
    inputs = _inputs(n=4, v=1, dtype=dtype, seed=4)
    assert assert_backends_agree(inputs, _opts()) == "ok"  # p = 1: logp 0, entropy 0, gradient 0
    inputs["logits"][1, 0] = -INF  # that row's only token is impossible: no distribution
    assert assert_backends_agree(inputs, _opts()) == "error"


# The differential fuzz: one drawn example runs the reference and all three backends (forward and backward).

MINUS_INF_PATTERNS = ("none", "columns", "labels", "all-but-one", "scattered", "leading")
BAD_KINDS = (None,) * 6 + ("nan", "+inf", "all -inf", "overflow")  # mostly clean: None is drawn 6/10


@st.composite
def fuzz_examples(draw):
    n = draw(st.integers(1, 6))
    v = draw(st.one_of(st.integers(1, 40), st.sampled_from([63, 64, 65, 100])))  # blocks of 16/32, vectors 8/16
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    # Magnitudes: spread (scale), shift (offset) and single spikes; huge ones only with a power-of-two T,
    # where every backend computes the same z / T (see assert_backends_agree).
    big = {torch.float16: 3e4, torch.bfloat16: 1e30, torch.float32: 1e30}[dtype]
    scale = draw(st.sampled_from([1.0, 3.0, 300.0]))
    offset = draw(st.sampled_from([0.0, 1e4, -1e4])) if dtype != torch.float16 else 0.0
    spike = draw(st.sampled_from([None, big, -big]))
    dyadic = offset != 0.0 or spike is not None or scale > 3.0
    temperature = draw(st.sampled_from([0.5, 1.0, 2.0] if dyadic else [0.5, 0.7, 1.0, 1.3, 2.0]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * scale + offset
    if spike is not None:
        logits[torch.rand(n, v, generator=g) < 0.1] = spike
    labels = torch.randint(0, v, (n,), generator=g)

    pattern = draw(st.sampled_from(MINUS_INF_PATTERNS))
    dead = torch.zeros(n, v, dtype=torch.bool)
    if pattern == "columns":
        dead[:, torch.rand(v, generator=g) < 0.3] = True
    elif pattern == "labels":
        dead[torch.arange(n), labels] = torch.rand(n, generator=g) < 0.5
    elif pattern == "all-but-one":
        rows = torch.rand(n, generator=g) < 0.6
        dead[rows] = True
        survivor = torch.where(torch.rand(n, generator=g) < 0.7, labels, torch.randint(0, v, (n,), generator=g))
        dead[torch.arange(n), survivor] = False
    elif pattern == "scattered":
        dead = torch.rand(n, v, generator=g) < 0.3
    elif pattern == "leading":
        dead[:, : draw(st.integers(0, v - 1))] = True
    logits = logits.masked_fill(dead, -INF)

    with torch.no_grad():
        logp = torch.log_softmax(logits / temperature, -1).gather(-1, labels[:, None]).squeeze(-1)
        logp = torch.where(torch.isfinite(logp), logp, torch.full_like(logp, -5.0))
    old_spread = draw(st.sampled_from([0.3, 3.0, 30.0]))  # 30: past the dual clip and the +-20 log-ratio clamp
    mask = torch.rand(n, generator=g) >= draw(st.sampled_from([0.0, 0.4]))
    kl = draw(st.sampled_from([None, "k1", "k2", "k3"]))
    inputs = {
        "logits": logits.to(dtype),
        "labels": torch.where(mask, labels, torch.full_like(labels, -100)),  # padding ids on masked rows
        "old_log_probs": (logp + torch.randn(n, generator=g) * old_spread).clamp(max=0.0),  # log-probs are <= 0
        "advantages": torch.randn(n, generator=g) * draw(st.sampled_from([1.0, 100.0])),
        "mask": mask,
        "ref_log_probs": (logp + torch.randn(n, generator=g) * draw(st.sampled_from([0.5, 15.0]))).clamp(max=0.0)
        if kl
        else None,
    }
    bad, bad_row = draw(st.sampled_from(BAD_KINDS)), draw(st.integers(0, n - 1))
    if bad is not None:
        row = inputs["logits"][bad_row]
        column = draw(st.integers(0, v - 1))
        if bad == "all -inf":
            row.fill_(-INF)
        else:
            huge = 3e38 if dtype != torch.float16 else 6e4  # fp16: overflows nothing at T >= 0.5, a large logit
            row[column] = {"nan": float("nan"), "+inf": INF, "overflow": huge}[bad]
    opts = dict(
        alpha=draw(st.sampled_from([0.0, 0.3, 1.0])), eps_low=0.2, eps_high=draw(st.sampled_from([0.2, 0.28])),
        dual_clip=draw(st.sampled_from([None, 3.0])), kl_coef=0.05 if kl else 0.0, kl_estimator=kl or "k3",
        temperature=temperature, return_entropy=draw(st.booleans()),
    )  # fmt: skip
    return inputs, opts, draw(st.sampled_from([16, 32])), seed


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(example=fuzz_examples())
def test_backends_agree_with_the_reference_or_raise_its_error(example):
    inputs, opts, block_v, seed = example
    event(assert_backends_agree(inputs, opts, block_v=block_v, seed=seed))  # "ok" / "error", in --hypothesis-show-statistics
