"""The C++ CPU backend (csrc/, ``openrlhf_lopti.ops.cpp_policy_loss``) against the torch reference: the
shared kernel grid, C++-specific shapes (parallel row chunks, vector tails, fp16), every ISA code path,
bad input, rows it must not read, the op registration, and the fallback when the extension is missing.

The extension must be built (``pip install --no-build-isolation -e .`` does it): these tests fail, not
skip, when it is not.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_lopti.ops import fused_policy_loss
from openrlhf_lopti.ops import cpp_policy_loss as cpp_module
from openrlhf_lopti.ops.cpp_policy_loss import cpp_available, cpp_isa

from .kernel_cases import (
    CASES,
    EXTREME_CASES,
    Case,
    assert_near_truth,
    check_backend_matches_reference,
    make_inputs,
    options,
    reference_truth,
)
from .kernel_cases import textbook_policy_loss

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CPP_CASES = [
    Case(n=300, v=5000, alpha=0.3, kl="k3", entropy=True, seed=5),  # many parallel_for chunks
    Case(n=300, v=5000, dtype=torch.bfloat16, kl="k2", entropy=True, temperature=0.7, seed=6),
    Case(n=64, v=777, dtype=torch.float16, kl="k1", dual_clip=2.0, entropy=True, seed=7),
    Case(n=6, v=5, entropy=True, kl="k3", seed=8),  # V smaller than one vector: tail only
    Case(n=4, v=1, entropy=True, seed=9),  # a one-token vocab: p = 1, zero gradient
    # Far-off old / ref log-probs: the +-20 log-ratio clamp, the dual clip and the KL clamps all engage.
    Case(n=64, v=300, kl="k3", dual_clip=2.0, old_spread=15.0, ref_spread=15.0, entropy=True, seed=21),
    Case(n=64, v=300, kl="k2", old_spread=8.0, ref_spread=8.0, seed=22),
    Case(n=64, v=300, kl="k1", alpha=0.5, ref_spread=15.0, seed=23),
    Case(n=16, v=500, logit_offset=1000.0, entropy=True, kl="k3", seed=24),  # large logits: stability
    Case(n=16, v=500, logit_offset=-1000.0, dtype=torch.bfloat16, entropy=True, seed=25),
]


def _call(inputs: dict, backend: str, **opts):
    logits = inputs["logits"].detach().clone().requires_grad_(True)
    args = {k: v for k, v in inputs.items() if k != "logits"}
    return logits, fused_policy_loss(logits, **args, backend=backend, **opts)


def test_extension_is_built_and_loaded():
    assert cpp_available(), "C++ kernel missing: run `pip install --no-deps --no-build-isolation -e .`"
    assert cpp_isa() in ("avx512", "avx2", "generic")
    assert hasattr(torch.ops.openrlhf_lopti, "policy_loss_bwd")


@pytest.mark.parametrize("case", CASES + CPP_CASES + list(EXTREME_CASES.values()), ids=str)
def test_cpp_backend_matches_reference(case):
    check_backend_matches_reference(case, backend="cpp")


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    v=st.integers(1, 70),  # every remainder modulo the 8- and 16-wide vectors
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    temperature=st.sampled_from([0.6, 1.0, 1.7]),
    alpha=st.sampled_from([0.0, 0.5, 1.0]),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
    dual_clip=st.sampled_from([None, 2.5]),
    entropy=st.booleans(),
    masked_fraction=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 1000),
)
def test_cpp_backend_matches_reference_random(n, v, dtype, temperature, alpha, kl, dual_clip, entropy,
                                              masked_fraction, seed):  # fmt: skip
    case = Case(n=n, v=v, dtype=dtype, temperature=temperature, alpha=alpha, kl=kl, dual_clip=dual_clip,
                entropy=entropy, masked_fraction=masked_fraction, seed=seed)  # fmt: skip
    check_backend_matches_reference(case, backend="cpp")


def _isa_subprocess(isa: str) -> dict:
    script = textwrap.dedent(
        """
        import json, torch
        from tests.kernel_cases import CASES, Case, check_backend_matches_reference
        from openrlhf_lopti.ops.cpp_policy_loss import cpp_isa
        extra = [Case(n=300, v=5000, dtype=torch.bfloat16, kl="k3", entropy=True, seed=5),
                 Case(n=40, v=1001, dtype=torch.float16, entropy=True, seed=6)]
        for case in CASES + extra:
            check_backend_matches_reference(case, backend="cpp")
        print(json.dumps({"isa": cpp_isa()}))
        """
    )
    env = dict(os.environ, OPENRLHF_LOPTI_CPU_ISA=isa)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_every_isa_level_matches_reference(isa):
    # This machine's best level runs in-process above; the capped levels run here, as on older CPUs.
    got = _isa_subprocess(isa)["isa"]
    assert got == "generic" if isa == "generic" else got in ("avx2", "generic")


def test_unknown_isa_cap_is_an_error_naming_the_variable():
    # An unknown OPENRLHF_LOPTI_CPU_ISA used to be ignored silently (the best level ran): now every kernel
    # call, and cpp_isa(), raise a ValueError naming the variable and its allowed values.
    script = textwrap.dedent(
        """
        import torch
        from openrlhf_lopti.ops import fused_policy_loss
        from openrlhf_lopti.ops.cpp_policy_loss import cpp_isa
        from tests.kernel_cases import Case, make_inputs, options
        case = Case(n=4, v=16)
        for call in (cpp_isa, lambda: fused_policy_loss(**make_inputs(case), **options(case), backend="cpp")):
            try:
                call()
            except ValueError as exc:
                print("ValueError:", exc)
            else:
                print("no error")
        """
    )
    env = dict(os.environ, OPENRLHF_LOPTI_CPU_ISA="avx9000")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert line.startswith("ValueError: OPENRLHF_LOPTI_CPU_ISA must be one of generic, avx2, avx512"), line
        assert "got 'avx9000'" in line, line


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(labels=torch.where(d["mask"], d["v"], d["labels"])), "labels"),
        (lambda d: d["advantages"].__setitem__(0, float("nan")), "advantages"),
        (lambda d: d.update(old_log_probs=d["old_log_probs"][:-1]), "old_log_probs"),
        (lambda d: d.update(logits=d["logits"].long()), "logits"),
        (lambda d: d["opts"].update(eps_low=1.5), "eps_low"),
        (lambda d: d["opts"].update(kl_coef=0.1, ref_log_probs=None), "ref_log_probs"),
        (lambda d: d["opts"].update(temperature=0.0), "temperature"),
        (lambda d: d["opts"].update(alpha=1.5), "alpha"),
    ],
)
def test_bad_input_raises_value_error(change, message):
    case = Case(n=8, v=40, masked_fraction=0.0)
    d = make_inputs(case)
    d["v"] = torch.tensor(case.v)
    d["opts"] = dict(options(case), ref_log_probs=d.pop("ref_log_probs"))
    change(d)
    opts, _ = d.pop("opts"), d.pop("v")
    with pytest.raises(ValueError, match=message):
        fused_policy_loss(**d, **opts, backend="cpp")


def test_vector_exp_accuracy():
    # With stats (max 0, log-sum 0) and d loss/d logp = -1, the backward row is exp(z_j) itself (the label's
    # element 0 aside): the kernel's polynomial exp, checked against float64 on [-87, 0] and past it.
    z = torch.cat([torch.linspace(-87.0, 0.0, 400_001), torch.tensor([-87.5, -100.0, float("-inf")])])
    out = torch.ops.openrlhf_lopti.policy_loss_bwd(
        z[None], torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool),
        torch.tensor([[0.0, 0.0, 0.0, 0.0]]), None, torch.tensor([-1.0]), None, 1.0,
    )[0]  # fmt: skip
    want = z[1:-3].double().exp()
    rel = ((out[1:-3].double() - want) / want).abs().max().item()
    assert rel < 1e-7, rel
    assert torch.equal(out[-3:], torch.zeros(3)), "exp below -87 must flush to exactly 0"


def test_op_checks_labels_itself():
    # Called without fused_policy_loss's validation, the op still refuses an out-of-vocab label.
    d = make_inputs(Case(n=4, v=16, masked_fraction=0.0))
    labels = d["labels"].clone()
    labels[2] = 16
    with pytest.raises(RuntimeError, match="labels must be token ids"):
        torch.ops.openrlhf_lopti.policy_loss_fwd(
            d["logits"], labels, d["old_log_probs"], d["advantages"], d["mask"], None,
            0.0, 0.2, 0.2, None, 0.0, "k3", 1.0, False,
        )  # fmt: skip


def test_masked_rows_are_never_read():
    d = make_inputs(Case(n=16, v=300, entropy=True, masked_fraction=0.5, seed=11))
    d["logits"][~d["mask"]] = float("nan")  # would poison every output and gradient if read
    logits, out = _call(d, "cpp", return_entropy=True)
    (out.loss.sum() + out.logp.sum() + out.entropy.sum()).backward()
    for field in (out.loss, out.logp, out.kl, out.entropy):
        assert torch.isfinite(field).all() and torch.all(field[~d["mask"]] == 0)
    assert torch.all(logits.grad[~d["mask"]] == 0) and torch.isfinite(logits.grad).all()


def test_extreme_logits_match_reference():
    # Probabilities far below exp(-87) (flushed to 0 by the kernel's exp), large |logits| and -inf entries.
    g = torch.Generator().manual_seed(3)
    d = make_inputs(Case(n=12, v=500, masked_fraction=0.0, seed=3))
    d["logits"] = torch.randn(12, 500, generator=g) * 200.0
    d["logits"][:, ::7] = float("-inf")
    d["labels"] = d["logits"].argmax(-1)
    objective = lambda out: out.loss.sum() + 0.5 * out.logp.sum()  # noqa: E731
    truth, truth_grad = reference_truth(d, dict(alpha=0.3), objective)
    for backend in ("cpp", "torch"):
        logits, out = _call(d, backend, alpha=0.3)
        objective(out).backward()
        assert_near_truth(backend, out, logits.grad, truth, truth_grad, d["logits"], 1.0, fields=("loss", "logp"))


@pytest.mark.parametrize("layout", ["row_padded", "transposed"])
def test_non_contiguous_logits(layout):
    case = Case(n=24, v=200, entropy=True, kl="k3", seed=4)
    d = make_inputs(case)
    if layout == "row_padded":  # rows of a wider buffer: row stride > V, read in place
        d["logits"] = torch.cat([d["logits"], torch.zeros(24, 9)], dim=1)[:, :200]
    else:  # V not contiguous: copied once by the wrapper
        d["logits"] = d["logits"].t().contiguous().t()
    opts = options(case)
    objective = lambda out: out.loss.sum() + out.entropy.sum()  # noqa: E731
    truth, truth_grad = reference_truth(d, opts, objective)
    for backend in ("torch", "cpp"):
        logits, out = _call(d, backend, **opts)
        objective(out).backward()
        assert_near_truth(backend, out, logits.grad, truth, truth_grad, d["logits"], case.temperature)


@pytest.mark.parametrize("output", ["loss", "logp", "entropy"])
def test_gradient_from_a_single_output(output):
    # Autograd hands the backward None for the outputs not used; each term must stand on its own.
    case = Case(n=20, v=150, alpha=0.3, kl="k3", entropy=True, seed=12)
    d = make_inputs(case)
    truth, truth_grad = reference_truth(d, options(case), lambda out: getattr(out, output).sum())
    for backend in ("cpp", "torch"):
        logits, out = _call(d, backend, **options(case))
        getattr(out, output).sum().backward()
        assert not out.kl.requires_grad and not out.clipped.requires_grad
        assert_near_truth(backend, out, logits.grad, truth, truth_grad, d["logits"], case.temperature, fields=())


def test_thread_count_does_not_change_results():
    d = make_inputs(Case(n=300, v=3000, entropy=True, kl="k3", seed=13))
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            logits, out = _call(d, "cpp", kl_coef=0.05, return_entropy=True)
            (out.loss.sum() + out.entropy.sum()).backward()
            results.append((out.loss, out.entropy, logits.grad))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_auto_uses_cpp_on_cpu(monkeypatch):
    calls = []
    real = cpp_module.cpp_policy_loss
    monkeypatch.setattr(cpp_module, "cpp_policy_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    d = make_inputs(Case(n=8, v=64))
    _, out = _call(d, "auto")
    assert calls == [1]
    truth, _ = reference_truth(d, {}, lambda out: out.loss.sum())
    assert_near_truth("auto", out, None, truth, None, d["logits"], 1.0)


def test_ops_schema_and_fake_tensors():
    d = make_inputs(Case(n=6, v=50, kl="k3", seed=14))
    fwd_args = (d["logits"], d["labels"].long(), d["old_log_probs"], d["advantages"], d["mask"],
                d["ref_log_probs"], 0.3, 0.2, 0.28, 3.0, 0.05, "k3", 0.7, True)  # fmt: skip
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.openrlhf_lopti.policy_loss_fwd.default, fwd_args, test_utils=checks)
    stats = torch.ops.openrlhf_lopti.policy_loss_fwd(*fwd_args)[5]
    up = torch.randn(6)
    bwd_args = (d["logits"], d["labels"].long(), d["mask"], stats, up, up, None, 0.7)
    torch.library.opcheck(torch.ops.openrlhf_lopti.policy_loss_bwd.default, bwd_args, test_utils=checks)


def test_fallback_without_extension_uses_torch():
    # The extension "missing" (import blocked, JIT skipped): cpp_available() is False with one warning,
    # backend="auto" gives the torch backend's numbers, and an explicit backend="cpp" says why it cannot run.
    script = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["openrlhf_lopti._C"] = None  # makes `import openrlhf_lopti._C` raise ImportError
        import torch
        from openrlhf_lopti.ops import fused_policy_loss
        from openrlhf_lopti.ops.cpp_policy_loss import cpp_available
        from tests.kernel_cases import Case, make_inputs, options
        case = Case(n=16, v=120, alpha=0.3, kl="k3", entropy=True)
        d = make_inputs(case)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cpp_available() is False and cpp_available() is False
            auto = fused_policy_loss(**d, **options(case), backend="auto")
        ours = [w for w in caught if "openrlhf_lopti" in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        message = str(ours[0].message)
        assert "torch backend" in message and "OPENRLHF_LOPTI_NO_JIT" in message and "\\n" not in message
        want = fused_policy_loss(**d, **options(case), backend="torch")
        for name in ("loss", "logp", "kl", "clipped", "entropy"):
            assert torch.equal(getattr(auto, name), getattr(want, name)), name
        try:
            fused_policy_loss(**d, **options(case), backend="cpp")
        except RuntimeError as exc:
            assert "unavailable" in str(exc)
        else:
            raise AssertionError("backend='cpp' ran without the extension")
        print("fallback ok")
        """
    )
    env = dict(os.environ, OPENRLHF_LOPTI_NO_JIT="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fallback ok" in proc.stdout


_JIT_SCRIPT = """
import glob, json, logging, os, sys, time, warnings
sys.modules["openrlhf_lopti._C"] = None  # the built extension "missing": `import openrlhf_lopti._C` raises
import torch
logged = []
handler = logging.Handler(logging.INFO)
handler.emit = lambda record: logged.append(record.getMessage())
logging.getLogger("openrlhf_lopti").addHandler(handler)
logging.getLogger("openrlhf_lopti").setLevel(logging.INFO)
from openrlhf_lopti.ops import fused_policy_loss
from openrlhf_lopti.ops.cpp_policy_loss import cpp_available
from tests.kernel_cases import Case, assert_near_truth, make_inputs, options, textbook_policy_loss
case = Case(n=24, v=300, alpha=0.3, kl="k3", dual_clip=3.0, entropy=True, temperature=0.8, seed=31)
d = make_inputs(case)
opts = options(case)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start = time.perf_counter()
    available = cpp_available()
    seconds = time.perf_counter() - start
    logits = d["logits"].clone().requires_grad_(True)
    out = fused_policy_loss(logits, **{k: v for k, v in d.items() if k != "logits"}, **opts, backend="cpp")
    (out.loss.sum() + out.entropy.sum()).backward()
want_logits = d["logits"].double().requires_grad_(True)
want = textbook_policy_loss(d, opts, want_logits)
(want["loss"].sum() + want["entropy"].sum()).backward()
try:  # the bound of tests/kernel_cases.py, derived from the computation
    assert_near_truth("cpp (JIT)", out, logits.grad, want, want_logits.grad, d["logits"], case.temperature)
    near_truth = "ok"
except AssertionError as exc:
    near_truth = str(exc)
print(json.dumps({
    "available": available,
    "seconds": seconds,
    "warnings": [str(w.message) for w in caught if "openrlhf_lopti" in str(w.message)],
    "near_truth": near_truth,
    "clipped_equal": torch.equal(out.clipped, want["clipped"]),
    "path": os.environ["PATH"],
    "log": logged,
    "libraries": sorted(os.path.relpath(p, os.environ["JIT_ROOT"])
                        for p in glob.glob(os.path.join(os.environ["JIT_ROOT"], "**", "*.so"), recursive=True)),
}))
"""


def _path_without_ninja(tmp_path) -> str:
    """A PATH of one folder linking every program on this PATH except ``ninja``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            target = os.path.join(folder, name)
            if name != "ninja" and not (bin_dir / name).exists() and os.access(target, os.X_OK):
                (bin_dir / name).symlink_to(target)
    return str(bin_dir)


@pytest.mark.parametrize("where", ["TORCH_EXTENSIONS_DIR", "default"])
def test_jit_build_from_csrc_when_extension_is_missing(tmp_path, where):
    # The README's fallback: without the built `openrlhf_lopti._C`, the first cpp_available() compiles csrc/*.cpp
    # with torch.utils.cpp_extension, the op runs and gives the textbook loss (values and gradients), and no
    # "unavailable" warning is emitted. The build goes to $TORCH_EXTENSIONS_DIR when set, else to
    # ~/.cache/openrlhf_lopti/, in a folder named after the Python and torch versions. With a ninja on PATH,
    # PATH is left alone; without one (the "default" case here), the pip `ninja` package's folder is put in
    # front of PATH. A real compile each time: about 10 s here (TESTING.md).
    ninja = pytest.importorskip("ninja")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENRLHF_LOPTI_NO_JIT", "OPENRLHF_LOPTI_CPU_ISA", "TORCH_EXTENSIONS_DIR")}  # fmt: skip
    env["MAX_JOBS"] = "2"
    if where == "TORCH_EXTENSIONS_DIR":
        env["TORCH_EXTENSIONS_DIR"] = env["JIT_ROOT"] = str(tmp_path)
        assert shutil.which("ninja", path=env.get("PATH")) is not None, "this case needs a ninja on PATH"
    else:
        env["HOME"] = str(tmp_path)
        env["JIT_ROOT"] = str(tmp_path / ".cache" / "openrlhf_lopti")
        env["PATH"] = _path_without_ninja(tmp_path)
    runs = []
    for _ in range(2 if where == "default" else 1):  # the default folder is made once and then reused
        proc = subprocess.run([sys.executable, "-c", _JIT_SCRIPT], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout[-3000:]  # a quiet build: no compiler log
        got = json.loads(proc.stdout)
        library = os.path.join(env["JIT_ROOT"], got["libraries"][0]) if len(got["libraries"]) == 1 else None
        runs.append((got, library and os.stat(library).st_mtime_ns))
    for got, _ in runs:
        assert got["available"] is True, got
        assert got["warnings"] == [], got["warnings"]
        csrc = os.path.realpath(os.path.join(REPO, "csrc"))
        assert got["log"] == [f"openrlhf_lopti: JIT-building the C++ policy-loss kernel from {csrc} (first use only)"]
        assert len(got["libraries"]) == 1, got["libraries"]
        library = got["libraries"][0]
        assert os.path.basename(library) == "openrlhf_lopti_cpu_kernels.so", library
        if where == "default":
            py = f"py{sys.version_info.major}{sys.version_info.minor}"
            assert library.startswith("torch_extensions/") and py in library, library
            assert torch.__version__.split("+")[0] in library, library
            assert got["path"] == ninja.BIN_DIR + os.pathsep + env["PATH"], got["path"]
        else:
            assert got["path"] == env["PATH"], got["path"]
        assert got["clipped_equal"] is True
        assert got["near_truth"] == "ok", got["near_truth"]
    if where == "default":
        assert runs[1][1] == runs[0][1], "the second process rebuilt the cached library"
    # Built with setup.py's flags (-O3 -Wno-psabi -fopenmp, and -fopenmp to link; no OpenMP flags on macOS).
    with open(os.path.join(env["JIT_ROOT"], os.path.dirname(library), "build.ninja")) as f:
        flags = dict(line.split(" = ", 1) for line in f.read().splitlines() if line.startswith(("cflags", "ldflags")))
    openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
    assert all(flag in flags["cflags"].split() for flag in ["-O3", "-Wno-psabi"] + openmp), flags["cflags"]
    assert all(flag in flags["ldflags"].split() for flag in openmp), flags["ldflags"]


def test_a_cxx_with_a_launcher_is_a_compiler(monkeypatch, tmp_path):
    """``CXX="ccache g++"``, a launcher before the compiler, as torch's builder takes it. (Before: refused as "no C++
    compiler", the whole string looked up as one program.) No compile here: torch's builder is replaced."""
    from types import SimpleNamespace

    from openrlhf_lopti.ops import cpp_policy_loss as cpp

    loads = []
    monkeypatch.setattr(cpp, "_quiet_import_of_the_builder", lambda: SimpleNamespace(load=lambda **k: loads.append(k)))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "env g++")  # env: a launcher on every machine
    cpp._jit_build()
    assert len(loads) == 1
    monkeypatch.setenv("CXX", "no-such-launcher g++")
    with pytest.raises(cpp._CannotBuild, match=r"^no C\+\+ compiler \('no-such-launcher' of CXX='no-such-launcher g\+\+' is"):
        cpp._jit_build()


def test_jit_fallback_without_csrc_says_why(tmp_path):
    # An install without csrc/ (and without `_C`): a copy of the package alone, in a site-packages where another
    # package left a csrc/ of its own. No build is tried (before: the other package's sources were compiled),
    # cpp_available() is False, and the one warning names the missing sources.
    package = tmp_path / "site" / "openrlhf_lopti"
    shutil.copytree(os.path.join(REPO, "openrlhf_lopti"), package,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))  # fmt: skip
    (tmp_path / "site" / "csrc").mkdir()
    (tmp_path / "site" / "csrc" / "other.cpp").write_text("int other_package() { return 0; }\n")
    script = textwrap.dedent(
        """
        import json, sys, warnings
        sys.modules["openrlhf_lopti._C"] = None  # (an editable install would find the checkout's `_C`)
        import openrlhf_lopti
        from openrlhf_lopti.ops.cpp_policy_loss import cpp_available
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = cpp_available()
        print(json.dumps({"package": openrlhf_lopti.__file__, "available": available,
                          "warnings": [str(w.message) for w in caught if "openrlhf_lopti" in str(w.message)]}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OPENRLHF_LOPTI_NO_JIT", "PYTHONPATH")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path / "site", env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["package"] == str(package / "__init__.py"), got  # the copy, not the checkout
    assert got["available"] is False
    where = f"{package / 'csrc'}"
    assert got["warnings"] == [
        "openrlhf_lopti: C++ policy-loss kernel unavailable, using the torch backend (openrlhf_lopti._C: "
        f"import of openrlhf_lopti._C halted; None in sys.modules; JIT build impossible: no C++ sources in {where} "
        '(a wheel built without them): reinstall, pip install "openrlhf-lopti" --force-reinstall --no-deps)'
    ], got["warnings"]
    assert not (tmp_path / "ext").exists()


_LOAD_SCRIPT = """
import json, sys, warnings
import torch.utils.cpp_extension
builds = []
def no_build(*args, **kwargs):  # a JIT build is never needed here: record it instead of compiling
    builds.append(kwargs.get("name"))
    raise RuntimeError("JIT build attempted")
torch.utils.cpp_extension.load = no_build
from openrlhf_lopti.ops.cpp_policy_loss import cpp_available
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    available = cpp_available()
print(json.dumps({"available": available, "builds": builds,
                  "warnings": [str(w.message) for w in caught if "openrlhf_lopti" in str(w.message)]}))
"""


@pytest.mark.parametrize("no_jit", [None, "1"])
def test_built_extension_is_used_without_a_jit_build(no_jit):
    # With `openrlhf_lopti._C` importable, cpp_available() is True at once: no JIT build is attempted (it would
    # recompile csrc/ on every first use), with or without OPENRLHF_LOPTI_NO_JIT, and nothing is warned.
    env = {k: v for k, v in os.environ.items() if k != "OPENRLHF_LOPTI_NO_JIT"}
    if no_jit is not None:
        env["OPENRLHF_LOPTI_NO_JIT"] = no_jit
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"available": True, "builds": [], "warnings": []}, got


def test_cpp_policy_loss_defaults_are_the_textbook_loss():
    # cpp_policy_loss called directly with no options: alpha 0 (no AR), eps 0.2 / 0.2, no dual clip, no KL,
    # T = 1, no entropy. Checked against the loss written out in the test with those values.
    d = make_inputs(Case(n=32, v=80, old_spread=1.0, seed=41))
    logits = d["logits"].clone().requires_grad_(True)
    out = cpp_module.cpp_policy_loss(logits, d["labels"], d["old_log_probs"], d["advantages"], d["mask"])
    assert out.entropy is None and not out.status.rows.any() and out.backend == "cpp"
    opts = dict(alpha=0.0, eps_low=0.2, eps_high=0.2, dual_clip=None, kl_coef=0.0, kl_estimator="k3",
                temperature=1.0)  # fmt: skip
    want_logits = d["logits"].double().requires_grad_(True)
    want = textbook_policy_loss(dict(d, ref_log_probs=None), opts, want_logits)
    assert want["clipped"].any() and (d["advantages"][d["mask"]] < 0).any()  # clipping and A < 0 both occur
    out.loss.sum().backward()
    want["loss"].sum().backward()
    assert_near_truth("cpp", out, logits.grad, want, want_logits.grad, d["logits"], 1.0, fields=("loss", "logp", "kl"))
    assert torch.equal(out.clipped, want["clipped"])


def test_backward_hands_the_kernel_none_for_unused_outputs(monkeypatch):
    # set_materialize_grads(False): an output not used in the loss reaches the kernel as None (it then skips
    # that term) rather than as a tensor of zeros.
    seen = []
    real = torch.ops.openrlhf_lopti.policy_loss_bwd

    def spy(logits, labels, mask, stats, grad_loss, grad_logp, grad_entropy, temperature):
        seen.append((grad_loss is None, grad_logp is None, grad_entropy is None))
        return real(logits, labels, mask, stats, grad_loss, grad_logp, grad_entropy, temperature)

    monkeypatch.setattr(torch.ops.openrlhf_lopti, "policy_loss_bwd", spy)
    d = make_inputs(Case(n=8, v=40, seed=42))
    for output in ("loss", "logp", "entropy"):
        _, out = _call(d, "cpp", return_entropy=True)
        getattr(out, output).sum().backward()
    assert seen == [(False, True, True), (True, False, True), (True, True, False)], seen
