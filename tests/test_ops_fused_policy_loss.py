"""``fused_policy_loss`` itself: every bad shape, dtype, device or option is a ValueError naming the argument, raised
before any backend runs; every bad value (an id out of range, a non-finite float) is found by every backend as a
status bit and raised naming the argument and the row, at once or at the step; an all-masked batch is all zeros
(value and gradient, never NaN) on every backend; the backend dispatch."""

import functools
import importlib
import math
from types import SimpleNamespace

import pytest
import torch

import openrlhf_lopti.ops.cpp_policy_loss as cpp_module
import openrlhf_lopti.ops.triton as triton_module
from openrlhf_lopti.algo import policy_loss_from_logits
from openrlhf_lopti.ops import LossOptions, fused_policy_loss
from openrlhf_lopti.ops.value_status import StepChecks

# The package re-exports the function under the module's name, so fetch the module itself.
fused_module = importlib.import_module("openrlhf_lopti.ops.fused_policy_loss")

from .kernel_cases import Case, assert_near_truth, make_inputs, options, reference_truth, textbook_policy_loss

N, V = 6, 11


def _good(**overrides) -> dict:
    """A valid call's arguments (all rows kept, KL on), with ``overrides`` applied."""
    g = torch.Generator().manual_seed(0)
    args = dict(
        logits=torch.randn(N, V, generator=g),
        labels=torch.randint(0, V, (N,), generator=g),
        old_log_probs=-torch.rand(N, generator=g),
        advantages=torch.randn(N, generator=g),
        mask=torch.ones(N, dtype=torch.bool),
        ref_log_probs=-torch.rand(N, generator=g),
        kl_coef=0.01,
    )
    args.update(overrides)
    return args


def _call(args: dict, backend: str = "torch"):
    args = dict(args)
    positional = [args.pop(k) for k in ("logits", "labels", "old_log_probs", "advantages", "mask")]
    return fused_policy_loss(*positional, backend=args.pop("backend", backend), **args)


def _with(name: str, row: int, value: float) -> torch.Tensor:
    tensor = _good()[name].clone()
    tensor[row] = value
    return tensor


def _with_double(name: str, row: int, value: float) -> torch.Tensor:
    """A float64 copy with ``value`` at ``row``: finite in float64, but not once rounded to float32."""
    tensor = _good()[name].double()
    tensor[row] = value
    return tensor


meta = torch.device("meta")  # a second device that exists on every machine
BAD_INPUTS = {
    # argument -> list of (overrides, a fragment the message must contain)
    "backend": [dict(backend="cuda"), dict(backend="")],
    "logits": [
        dict(logits=torch.randn(N)),
        dict(logits=torch.randn(2, N, V)),
        dict(logits=[[0.0] * V] * N),
        dict(logits=torch.randint(0, 3, (N, V))),
        dict(logits=torch.randn(N, V, dtype=torch.float64)),
        dict(logits=torch.randn(N, 0)),
    ],
    "labels": [
        dict(labels=torch.zeros(N + 1, dtype=torch.long)),
        dict(labels=torch.zeros(N, 1, dtype=torch.long)),
        dict(labels=torch.zeros(N, dtype=torch.long, device=meta)),
        dict(labels=torch.zeros(N)),
        dict(labels=torch.zeros(N, dtype=torch.bool)),
        dict(labels=list(range(N))),
    ],
    "old_log_probs": [
        dict(old_log_probs=torch.zeros(N - 1)),
        dict(old_log_probs=torch.zeros(N, device=meta)),
        dict(old_log_probs=torch.zeros(N, dtype=torch.long)),
    ],
    "advantages": [
        dict(advantages=torch.zeros(2 * N)),
        dict(advantages=torch.zeros(N, device=meta)),
        dict(advantages=torch.zeros(N, dtype=torch.int32)),
    ],
    "mask": [
        dict(mask=torch.ones(N + 2, dtype=torch.bool)),
        dict(mask=torch.ones(N, dtype=torch.bool, device=meta)),
        dict(mask=torch.ones(N, dtype=torch.complex64)),
        dict(mask=None),
    ],
    "ref_log_probs": [
        dict(ref_log_probs=torch.zeros(N + 1)),
        dict(ref_log_probs=torch.zeros(N, device=meta)),
        dict(ref_log_probs=torch.zeros(N, dtype=torch.long)),
        dict(ref_log_probs=None, kl_coef=0.1),
    ],
    "alpha": [dict(alpha=-0.1), dict(alpha=1.5), dict(alpha=float("nan")), dict(alpha="0.3x")],
    # not numbers: a string (a YAML 1e-3 is one), None, a bool; numbers finite in float64 but not in float32,
    # the loss's precision (1e39; a temperature whose inverse overflows)
    "eps_low": [dict(eps_low=-0.1), dict(eps_low=1.0), dict(eps_low=float("nan")), dict(eps_low="0.2"),
                dict(eps_low=None)],
    "eps_high": [dict(eps_high=-0.1), dict(eps_high=float("inf")), dict(eps_high=float("nan")),
                 dict(eps_high="0.28"), dict(eps_high=1e39)],
    "dual_clip": [dict(dual_clip=1.0), dict(dual_clip=0.5), dict(dual_clip=-float("inf")), dict(dual_clip="3"),
                  dict(dual_clip=1e39)],
    "kl_coef": [dict(kl_coef=float("nan")), dict(kl_coef=float("inf")), dict(kl_coef="1e-3"), dict(kl_coef=None),
                dict(kl_coef=1e39), dict(kl_coef=torch.ones(2))],
    "kl_estimator": [dict(kl_estimator="k4"), dict(kl_estimator="K3")],
    "temperature": [dict(temperature=0.0), dict(temperature=-1.0), dict(temperature=float("nan")),
                    dict(temperature=math.inf), dict(temperature=None), dict(temperature="0.7"),
                    dict(temperature=True), dict(temperature=1e-40)],
    "options": [dict(options="alpha=0.3"), dict(options={"alpha": 0.3}), dict(options=LossOptions(), alpha=0.3),
                dict(options=LossOptions(alpha=0.3), temperature=0.7)],
    "check": [dict(check="later"), dict(check=None)],
    # weights that require grad: the Triton one-pass head has no gradient for them, so no backend takes them
    "loss_weights": [dict(loss_weights=torch.ones(N + 1)), dict(loss_weights=torch.ones(N, dtype=torch.long)),
                     dict(loss_weights=torch.ones(N, device=meta)), dict(loss_weights=[1.0] * N),
                     dict(loss_weights=torch.ones(N, requires_grad=True))],
    "entropy_weights": [dict(entropy_weights=torch.ones(N)), dict(entropy_weights=torch.ones(2), loss_weights=torch.ones(N)),
                        dict(entropy_weights=torch.ones(N, requires_grad=True), loss_weights=torch.ones(N))],
    "grad_in_logits": [dict(grad_in_logits=True)],
}  # fmt: skip
# Bad values: found by each backend in its pass (status bits), raised after the forward naming the argument and
# the row (argument -> (overrides, the row)).
BAD_VALUES = {
    "labels": [(dict(labels=_with("labels", 2, -1)), 2), (dict(labels=_with("labels", 3, V)), 3)],
    "old_log_probs": [(dict(old_log_probs=_with("old_log_probs", 0, float("nan"))), 0),
                      (dict(old_log_probs=_with("old_log_probs", 5, -float("inf"))), 5),
                      (dict(old_log_probs=_with_double("old_log_probs", 2, -1e300)), 2),
                      # not log-probs: exp(89) is inf (AR's weight 0 * inf + 1 was a silent NaN loss at alpha 0), and
                      # a sign-flipped NLL of 0.5 weighted its token by 1.65 > 1
                      (dict(old_log_probs=_with("old_log_probs", 1, 89.0)), 1),
                      (dict(old_log_probs=_with("old_log_probs", 3, 0.5)), 3)],
    "advantages": [(dict(advantages=_with("advantages", 1, float("nan"))), 1),
                   (dict(advantages=_with("advantages", 4, float("inf"))), 4),
                   (dict(advantages=_with_double("advantages", 0, 1e300)), 0)],
    "ref_log_probs": [(dict(ref_log_probs=_with("ref_log_probs", 3, float("nan"))), 3),
                      (dict(ref_log_probs=_with_double("ref_log_probs", 1, -1e300)), 1)],
}  # fmt: skip
BAD_VALUE_CASES = [(name, overrides, row) for name, cases in BAD_VALUES.items() for overrides, row in cases]
BAD_CASES = [(name, overrides) for name, cases in BAD_INPUTS.items() for overrides in cases]


@pytest.fixture
def backends_must_not_run(monkeypatch):
    """Every backend entry point fails the test if reached: validation must happen before any launch."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a backend ran on invalid input")

    monkeypatch.setattr(fused_module, "torch_policy_loss", forbidden)
    monkeypatch.setattr(triton_module, "triton_policy_loss", forbidden)
    monkeypatch.setattr(cpp_module, "cpp_policy_loss", forbidden)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpp", "auto"])
@pytest.mark.parametrize("name,overrides", BAD_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CASES)])
def test_bad_input_is_a_value_error_naming_the_argument(backends_must_not_run, name, overrides, backend):
    args = _good(**overrides)
    with pytest.raises(ValueError, match=name):
        _call(args, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpp"])
@pytest.mark.parametrize("name,overrides,row", BAD_VALUE_CASES,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_VALUE_CASES)])  # fmt: skip
def test_a_bad_value_is_named_with_its_row_at_once_or_at_the_step(name, overrides, row, backend):
    """Each backend flags the bad row in its pass. "eager": the call raises, naming the argument and the row.
    "step": the call returns NaN on that row (finite elsewhere) and the ledger raises the same line naming the
    call; "off": nothing is raised, the NaN stays."""
    args = _good(**overrides)
    with pytest.raises(ValueError, match=rf"^{name} must be .* \(row {row}\)$"):
        _call(args, backend=backend)
    out = _call(dict(args, check="step"), backend=backend)
    assert torch.isnan(out.loss[row]) and torch.isnan(out.logp[row])
    others = torch.arange(N) != row
    assert torch.isfinite(out.loss[others]).all() and torch.isfinite(out.logp[others]).all()
    assert out.status.rows.tolist() == [int(out.status.rows[row]) if i == row else 0 for i in range(N)]
    checks = StepChecks()
    checks.add(out.status, "RL step 2, micro-batch 1")
    with pytest.raises(ValueError, match=rf"^{name} must be .* \(row {row} at RL step 2, micro-batch 1\)$"):
        checks.raise_if_bad()
    off = _call(dict(args, check="off"), backend=backend)
    assert off.status is None and torch.isnan(off.loss[row])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(logits=[[0.0] * V] * N), "logits must be a [N, V] tensor, got shape <class 'list'>"),
        (dict(logits=torch.randn(N)), f"logits must be a [N, V] tensor, got shape torch.Size([{N}])"),
        (dict(logits=torch.randn(N, 0)), "logits must have a non-empty vocab dimension V"),
        (dict(labels=list(range(N))), f"labels must be a torch.Tensor of shape [{N}], got list"),
        (dict(labels=torch.zeros(N + 1, dtype=torch.long)), f"labels must have shape [N]=[{N}] to match logits [N, V], got ({N + 1},)"),
        (dict(mask=torch.ones(N, dtype=torch.bool, device=meta)), "mask is on meta but logits is on cpu"),
        (dict(old_log_probs=_with("old_log_probs", 0, float("nan"))),
         "old_log_probs must be finite log-probabilities (<= 0, up to 0.001 of rounding) on unmasked rows (as "
         "float32, the precision of the loss) (row 0)"),
        (dict(ref_log_probs=None, kl_coef=0.1), "ref_log_probs is required when kl_coef != 0"),
    ],
    ids=["logits-list", "logits-1d", "logits-no-vocab", "labels-list", "labels-shape", "mask-device", "old-nan", "ref-missing"],
)  # fmt: skip
def test_bad_input_messages_in_full(overrides, message):
    with pytest.raises(ValueError) as error:
        _call(_good(**overrides))
    assert str(error.value) == message


def test_resolve_backend_names_the_backend_that_runs(monkeypatch):
    cpu = torch.zeros(1, 1)
    assert fused_module.resolve_backend("auto", cpu) == "cpp"  # the extension is built here (test_ops_cpp.py)
    monkeypatch.setattr(cpp_module, "cpp_available", lambda: False)
    assert fused_module.resolve_backend("auto", cpu) == "torch"
    assert [fused_module.resolve_backend(b, cpu) for b in ("triton", "cpp", "torch")] == ["triton", "cpp", "torch"]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_options_object_is_the_keywords(backend):
    """``options=LossOptions(...)`` (what the front ends pass) computes exactly what the same keywords compute,
    and a bad value inside it is named by its field."""
    fields = dict(alpha=0.3, eps_low=0.1, eps_high=0.3, dual_clip=3.0, kl_coef=0.05, kl_estimator="k2",
                  temperature=0.7, backend=backend)  # fmt: skip
    args = _good()
    args.pop("kl_coef")  # in fields
    by_keywords = fused_policy_loss(**args, return_entropy=True, **fields)
    by_object = fused_policy_loss(**args, return_entropy=True, options=LossOptions(**fields))
    for field in ("loss", "logp", "kl", "clipped", "entropy"):
        assert torch.equal(getattr(by_keywords, field), getattr(by_object, field)), field
    with pytest.raises(ValueError, match="alpha"):
        fused_policy_loss(**args, options=LossOptions(alpha=1.5, backend=backend))


def test_every_argument_has_a_bad_input_case():
    import inspect

    parameters = set(inspect.signature(fused_policy_loss).parameters) - {"return_entropy"}  # a flag
    assert parameters == set(BAD_INPUTS)
    assert set(BAD_VALUES) <= parameters


@pytest.mark.parametrize(
    "overrides",
    [dict(eps_low=0.0), dict(eps_high=0.0), dict(alpha=0), dict(alpha=1), dict(dual_clip=1.01),
     dict(ref_log_probs=None, kl_coef=0.0), dict(kl_coef=-0.5), dict(temperature=1e-3),
     dict(labels=torch.zeros(N, dtype=torch.long)), dict(labels=torch.full((N,), V - 1)),
     dict(labels=torch.zeros(N, dtype=torch.int32)), dict(mask=torch.ones(N, dtype=torch.uint8)),
     dict(old_log_probs=torch.zeros(N, dtype=torch.float64)),
     # numbers of other types: an int, a one-element tensor (an adaptive KL controller's value)
     dict(eps_high=1), dict(temperature=2), dict(kl_coef=torch.tensor(0.01))],
    ids=lambda o: ",".join(o),
)
def test_boundary_values_are_accepted(overrides):
    """The edges of every accepted range run and give finite outputs (the checks reject only what is outside)."""
    out = _call(_good(**overrides))
    assert torch.isfinite(out.loss).all() and torch.isfinite(out.logp).all()


def test_garbage_on_masked_rows_is_accepted():
    """Ids and values on rows with mask 0 are never used, so they are not validated (padding is -100)."""
    keep = torch.tensor([True, False, True, False, True, True])
    args = _good(mask=keep)
    for name, value in (("labels", -100), ("old_log_probs", float("nan")), ("advantages", float("inf")),
                        ("ref_log_probs", float("nan"))):  # fmt: skip
        args[name] = args[name].masked_fill(~keep, value)
    out = _call(args)
    assert torch.all(torch.isfinite(out.loss)) and torch.all(out.loss[~keep] == 0)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpp"])
def test_float64_per_token_inputs_are_read_as_float32(backend):
    """old_log_probs / advantages / ref_log_probs of any float dtype are accepted and rounded to float32 first,
    the precision of the whole loss (as the reference does): float64 gives the float32 inputs' results."""
    case = Case(n=12, v=30, alpha=0.3, kl="k3", entropy=True, seed=2)
    inputs = make_inputs(case)
    objective = lambda out: out.loss.sum() + out.entropy.sum()  # noqa: E731
    truth, truth_grad = reference_truth(inputs, options(case), objective)  # float64, from the fp32 vectors
    for cast in (torch.float64, torch.float32):
        vectors = {k: inputs[k].to(cast) for k in ("old_log_probs", "advantages", "ref_log_probs")}
        logits = inputs["logits"].clone().requires_grad_(True)
        fn = policy_loss_from_logits if cast == torch.float32 else functools.partial(fused_policy_loss, backend=backend)
        out = fn(logits, inputs["labels"], mask=inputs["mask"], **vectors, **options(case))
        objective(out).backward()
        path = "reference (fp32 vectors)" if cast == torch.float32 else f"{backend} (float64 vectors)"
        assert_near_truth(path, out, logits.grad, truth, truth_grad, inputs["logits"], case.temperature)


def _backends() -> list:
    # Every backend, always: a missing cpp extension fails these tests (cpp_policy_loss raises) instead of
    # silently shrinking the grid. Triton runs in interpreter mode without CUDA (tests/conftest.py).
    return ["torch", "triton", "cpp"]


def _device(backend: str) -> str:
    # Triton runs CUDA tensors where CUDA exists (its kernels are then compiled, not interpreted).
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _all_masked(dtype, garbage: bool):
    case = Case(n=9, v=40, dtype=dtype, masked_fraction=1.0, kl="k3", alpha=0.3, dual_clip=3.0, entropy=True)
    inputs = make_inputs(case)
    assert not inputs["mask"].any()
    if garbage:  # what padding rows may hold: nothing on a masked row may reach an output or a gradient
        inputs["old_log_probs"] = torch.full((case.n,), float("nan"))
        inputs["advantages"] = torch.full((case.n,), float("inf"))
        inputs["ref_log_probs"] = torch.full((case.n,), float("nan"))
        inputs["logits"] = torch.full((case.n, case.v), float("nan"), dtype=dtype)
    return case, inputs


def _check_all_zero(case, inputs, backend):
    inputs = {k: v.to(_device(backend)) for k, v in inputs.items()}
    logits = inputs.pop("logits").requires_grad_(True)
    out = fused_policy_loss(
        logits, inputs.pop("labels"), inputs.pop("old_log_probs"), inputs.pop("advantages"), inputs.pop("mask"),
        backend=backend, **inputs, **options(case),
    )  # fmt: skip
    for name in ("loss", "logp", "kl", "entropy"):
        assert torch.equal(getattr(out, name), torch.zeros_like(out.loss)), name
    assert not out.clipped.any()
    token_mean = out.loss.sum() / out.loss.numel()  # a trainer's aggregate: must stay finite
    (token_mean + out.entropy.sum() + out.logp.sum()).backward()
    assert torch.isfinite(token_mean)
    assert torch.equal(logits.grad, torch.zeros_like(logits)), "gradient is not exactly zero"


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_masked_batch_is_zero_never_nan(backend, dtype):
    _check_all_zero(*_all_masked(dtype, garbage=False), backend)


@pytest.mark.parametrize("backend", _backends())
def test_all_masked_batch_with_padding_garbage_is_zero(backend):
    _check_all_zero(*_all_masked(torch.float32, garbage=True), backend)


class _Spy:
    """Stands in for a backend: records the call and returns a marker output whose status found nothing."""

    def __init__(self, name: str):
        self.calls = []
        self.name = name

    def __call__(self, *args, **kwargs):
        from openrlhf_lopti.ops.loss_head_output import LossHeadOutput
        from openrlhf_lopti.ops.value_status import ValueStatus

        self.calls.append((args, kwargs))
        status = ValueStatus.of_rows(torch.zeros(N, dtype=torch.int32), V, 1.0)
        return LossHeadOutput(*(["spy-result"] * 4), backend=self.name, status=status)


@pytest.fixture
def spies(monkeypatch):
    spies = {name: _Spy(name) for name in ("torch", "triton", "cpp")}
    monkeypatch.setattr(fused_module, "torch_policy_loss", spies["torch"])
    monkeypatch.setattr(triton_module, "triton_policy_loss", spies["triton"])
    monkeypatch.setattr(cpp_module, "cpp_policy_loss", spies["cpp"])
    return spies


@pytest.mark.parametrize("backend", ["torch", "triton", "cpp"])
def test_explicit_backend_gets_the_validated_call(spies, backend):
    args = _good(alpha=1, eps_low=0.1, eps_high=0.3, dual_clip=3, kl_coef=1, kl_estimator="k2", temperature=2)
    before = fused_module.backends_ran().get(backend, 0)
    out = _call(args, backend=backend)
    assert out.loss == "spy-result" and out.backend == backend
    assert fused_module.backends_ran()[backend] == before + 1  # what a benchmark reads
    assert [len(s.calls) for s in spies.values()] == [int(name == backend) for name in spies]
    positional, options_ = spies[backend].calls[0]
    assert positional[0] is args["logits"] and positional[4] is args["mask"]
    assert options_ == dict(
        ref_log_probs=args["ref_log_probs"], alpha=1.0, eps_low=0.1, eps_high=0.3, dual_clip=3.0, kl_coef=1.0,
        kl_estimator="k2", temperature=2.0, return_entropy=False, loss_weights=None, entropy_weights=None,
        grad_in_logits=False,
    )  # fmt: skip
    assert all(type(options_[k]) is float for k in ("alpha", "eps_low", "eps_high", "dual_clip", "kl_coef"))


@pytest.mark.parametrize("cpp_built", [True, False])
def test_auto_on_cpu_is_cpp_when_built_else_torch(spies, monkeypatch, cpp_built):
    monkeypatch.setattr(cpp_module, "cpp_available", lambda: cpp_built)
    monkeypatch.setattr(triton_module, "triton_available", lambda: True)  # never chosen for CPU tensors
    _call(_good(), backend="auto")
    assert len(spies["cpp"].calls) == int(cpp_built)
    assert len(spies["torch"].calls) == int(not cpp_built)
    assert not spies["triton"].calls


@pytest.mark.parametrize("has_triton", [True, False])
def test_auto_on_cuda_is_triton_when_available_else_torch(monkeypatch, has_triton):
    # No CUDA tensor can be made on the CPU CI: the resolver only reads `is_cuda` and `device`. The self-check it
    # runs first on that device is tested in test_ops_triton_self_check.py; here it passes.
    from openrlhf_lopti.ops.triton import self_check

    monkeypatch.setattr(triton_module, "triton_available", lambda: has_triton)
    monkeypatch.setattr(self_check, "triton_verified", lambda device: True)
    monkeypatch.setattr(cpp_module, "cpp_available", lambda: True)  # never chosen for CUDA tensors
    chosen = fused_module.resolve_backend("auto", SimpleNamespace(is_cuda=True, device=torch.device("cuda:0")))
    assert chosen == ("triton" if has_triton else "torch")


def test_auto_here_runs_and_matches_the_reference():
    case = Case(n=10, v=30, kl="k3", alpha=0.3, entropy=True)
    inputs = make_inputs(case)
    outs = [
        fused_policy_loss(
            inputs["logits"], inputs["labels"], inputs["old_log_probs"], inputs["advantages"], inputs["mask"],
            ref_log_probs=inputs["ref_log_probs"], backend=backend, **options(case),
        )  # fmt: skip
        for backend in ("auto", "torch")
    ]
    truth, _ = reference_truth(inputs, options(case), lambda out: out.loss.sum())
    for backend, out in zip(("auto", "torch"), outs):
        assert_near_truth(backend, out, None, truth, None, inputs["logits"], case.temperature)


def test_defaults_run_the_plain_loss_on_the_auto_backend():
    """No option given: alpha 0, clip range [0.8, 1.2], no dual clip, no KL, temperature 1, no entropy, backend auto
    (cpp here): the loss written out in the test with those values."""
    case = Case(n=40, v=30, old_spread=2.0, seed=3)
    inputs = make_inputs(case)
    out = fused_policy_loss(*[inputs[k] for k in ("logits", "labels", "old_log_probs", "advantages", "mask")])
    assert out.entropy is None and out.clipped.any()
    opts = dict(alpha=0.0, eps_low=0.2, eps_high=0.2, dual_clip=None, kl_coef=0.0, kl_estimator="k3", temperature=1.0)
    want = textbook_policy_loss(dict(inputs, ref_log_probs=None), opts, inputs["logits"])
    assert_near_truth("auto", out, None, want, None, inputs["logits"], 1.0, fields=("loss", "logp"))


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_kernel_bad_rows_raise_the_references_message(backend):
    """A kernel flags the bad row in its pass; the ValueError names that row and what it holds, at the call's
    temperature."""
    args = _good(kl_coef=0.0, ref_log_probs=None)
    args["logits"] = args["logits"].clone()
    args["logits"][3, 2] = 3e38  # finite, but not once divided by 0.5
    with pytest.raises(ValueError) as error:
        _call(dict(args, temperature=0.5), backend=backend)
    assert str(error.value).startswith(
        "logits row 3 (unmasked) has finite values that overflow float32 when divided by temperature=0.5; "
    )
    args["logits"][1, 4] = float("nan")
    with pytest.raises(ValueError, match=r"^logits row 1 \(unmasked\) has NaN at column 4; "):
        _call(args, backend=backend)


@pytest.mark.parametrize("one_pass", [False, True], ids=["two-pass", "one-pass"])
@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_a_second_derivative_is_refused_never_silently_wrong(backend, one_pass):
    """The kernels' gradients carry no graph: under ``create_graph=True`` autograd would take them as constants, and
    a gradient penalty's derivative silently lost every term through them (cpp and triton returned dL/dx alone).
    They refuse it in one line; the torch reference differentiates twice (its penalty term is not 0)."""
    args = _good()
    logits = args.pop("logits").requires_grad_(True)
    if one_pass:
        args["loss_weights"] = torch.full((N,), 1.0 / N)

    def objective(backend):
        out = fused_policy_loss(logits, **args, return_entropy=True, backend=backend)
        return out.reduced if one_pass else out.loss.sum() + out.entropy.sum()

    (grad,) = torch.autograd.grad(objective("torch"), logits, create_graph=True)
    (penalty_grad,) = torch.autograd.grad((grad**2).sum(), logits)
    assert penalty_grad.abs().max() > 1e-3  # the term the kernels' gradients would have dropped
    with pytest.raises(RuntimeError, match=rf"^fused_policy_loss \(backend '{backend}'.*create_graph=True.*torch"):
        torch.autograd.grad(objective(backend), logits, create_graph=True)
    (first,) = torch.autograd.grad(objective(backend), logits)  # first order, as before
    torch.testing.assert_close(first, grad.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", _backends())
def test_an_infinite_dual_clip_is_no_dual_clip_on_every_backend(backend):
    """OpenRLHF's and verl's own losses take ``dual_clip = inf`` (their check is only ``> 1``) and then clip nothing
    more: with AR and Lopti off, `--actor.dual_clip inf` trained on upstream and raised in our fused loss (a ValueError
    at the first step, after a whole rollout). It is now None, exactly, on every backend and in the reference."""
    args = _good(advantages=-torch.rand(N, generator=torch.Generator().manual_seed(3)) * 2)  # negative: dual clip's side
    args["old_log_probs"] = args["old_log_probs"] - 3.0  # ratio ~e^3 > any finite dual clip's floor: it would bind
    results = []
    for dual_clip in (None, math.inf, 1.5):
        logits = args["logits"].clone().requires_grad_(True)
        out = _call({**args, "logits": logits, "dual_clip": dual_clip}, backend)
        out.loss.sum().backward()
        results.append((out.loss.detach(), logits.grad))
    (loss_none, grad_none), (loss_inf, grad_inf), (loss_finite, _) = results
    assert torch.equal(loss_inf, loss_none) and torch.equal(grad_inf, grad_none)
    assert not torch.allclose(loss_finite, loss_none)  # the case is one where a dual clip binds
    reference = policy_loss_from_logits(args["logits"], args["labels"], args["old_log_probs"], args["advantages"],
                                        args["mask"], ref_log_probs=args["ref_log_probs"], kl_coef=0.01,
                                        dual_clip=math.inf)  # fmt: skip
    torch.testing.assert_close(reference.loss, loss_none, rtol=1e-5, atol=1e-6)
