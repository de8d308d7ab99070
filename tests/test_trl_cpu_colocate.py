"""``LoptiGRPOTrainer`` generating with vLLM colocated on CPU (``use_vllm=True, vllm_mode="colocate"``), on TRL
1.16's real trainer and vLLM's CPU build, launched as a TRL user launches it: ``python`` (1 process) and ``torchrun
--nproc_per_node 2`` (2 processes, gloo). One launch per process count (tests/trl_colocate_run.py: AR + Lopti, an
fp32 engine, 6 optimizer steps = 3 generations, so 2 syncs of moved weights plus the one at the start); each
rank's record is checked for:

- the fp32 engine: vLLM's sampled log-probs equal the fp32 training model's, TRL's
  ``sampling/sampling_logp_difference/max`` below 1e-4 at every generation (measured: 5e-7 to 1.1e-6);
- the sync reaches vLLM's kernels: after the run, the engine (last synced 2 steps earlier) is off the trained
  weights; one more ``sync_weights`` brings it within 1e-4 of them and leaves it far from the first weights;
- the environment: ``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CACHE_ROOT`` get their defaults when unset (the cache in
  the run's output_dir, nothing under the home directory), and are kept when set.

The refusals (server mode and sleep mode on CPU, an unknown ``vllm_dtype``) are checked on the config alone.
The module took 2 to 4 minutes on 2 busy cores (load 7 to 11), most of it imports and vLLM's start (the second launch
reuses the first's compile cache through ``VLLM_CACHE_ROOT``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("vllm")

from openrlhf_lopti.trl import LoptiGRPOConfig  # noqa: E402
from openrlhf_lopti.trl.cpu_colocate import CACHE_DIR, KV_CACHE_GIB, set_environment_defaults  # noqa: E402

from .ds_ranks import free_port  # noqa: E402
from .run_logs import failure_report  # noqa: E402

SCRIPT = Path(__file__).with_name("trl_colocate_run.py")
REPO = SCRIPT.parents[1]
STEPS = 6  # 3 Lopti rounds of 2 optimizer steps: generations at steps 0, 2, 4
# |vLLM's log-prob - the fp32 training model's| of a sampled token, fp32 engine (measured: below 4e-6)
PARITY = 1e-4
# an engine 2 optimizer steps behind is off by 0.05 to 0.11 (measured), 0.29 to 0.31 from the first weights; one that
# was synced without a repack, by 1 to 2.2 at the next generations (measured with the repack taken out)
STALE = 1e-2


def run_launch(command: list, out: Path, world_size: int, env: dict) -> list:
    """Run ``command`` (the script under python or torchrun), return each rank's record."""
    out.mkdir(parents=True)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "XDG_CACHE_HOME"}
    full_env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **env)
    done = subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, failure_report(output)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from openrlhf_lopti.demo.tiny_model import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    # head size 32 (vLLM's CPU attention refuses 16); a vocabulary vLLM does not pad (a multiple of 64)
    model, tokenizer = build_tiny_model(hidden_size=64, num_layers=1, num_heads=2, vocab_size=320, max_positions=128)
    with torch.no_grad():
        model.model.norm.weight.mul_(8)  # peaky next-token distributions: both Lopti phases get tokens
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory) -> tuple:
    """``(records, out, home)`` of ``python tests/trl_colocate_run.py``, with no vLLM variable set and a fresh home."""
    base = tmp_path_factory.mktemp("one")
    home = base / "home"
    home.mkdir()
    out = base / "out"
    command = [sys.executable, str(SCRIPT), str(model_dir), str(out), "float32", str(STEPS)]
    return run_launch(command, out, 1, {"HOME": str(home)}), out, home


@pytest.fixture(scope="module")
def two_processes(model_dir, one_process, tmp_path_factory) -> tuple:
    """``(records, cache_root)`` of ``torchrun --nproc_per_node 2``, with ``VLLM_CACHE_ROOT`` set by the user (the
    first launch's cache: its compiled graphs are reused)."""
    _, first_out, _ = one_process
    cache_root = first_out / "run" / CACHE_DIR
    out = tmp_path_factory.mktemp("two") / "out"
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    command = torchrun + [str(SCRIPT), str(model_dir), str(out), "float32", str(STEPS)]
    return run_launch(command, out, 2, {"VLLM_CACHE_ROOT": str(cache_root)}), cache_root


def check_run(record: dict, world_size: int) -> list:
    """The checks every rank's record passes (module docstring); returns the logged log-prob differences."""
    assert record["world_size"] == world_size and record["backend"] == "gloo"
    assert record["engine_dtype"] == "torch.float32"  # vLLM's "auto" would have made a bf16 engine
    assert record["global_step"] == STEPS
    history = record["log_history"]
    key = "sampling/sampling_logp_difference/max"
    differences = [h[key] for h in history if key in h]
    assert len(differences) == STEPS // 2, differences  # one generation per round, a sync before each
    assert max(differences) < PARITY, differences
    for phase in ("low", "high"):  # both Lopti phases trained tokens
        assert any(h.get(f"lopti/{phase}/tokens", 0) > 0 for h in history), phase
    stale, synced = record["probe_before_sync"], record["probe_after_sync"]
    assert stale["trained"] > STALE, stale  # the engine still has the weights of its last sync
    assert synced["trained"] < PARITY, synced  # one sync: exactly the trained weights, in vLLM's kernels too
    assert synced["first"] > STALE, synced
    print(f"rank of {world_size}: engine vs trained weights {stale['trained']:.2f} before the last sync, "
          f"{synced['trained']:.1e} after; vs the first weights {synced['first']:.2f}")  # fmt: skip
    return differences


def test_one_process_fp32_engine_follows_every_sync(one_process):
    (record,), out, home = one_process
    differences = check_run(record, 1)
    print(f"1 process: sampling_logp_difference/max per generation {differences}, after the last sync "
          f"{record['probe_after_sync']['trained']:.1e}")  # fmt: skip
    cache_root = out / "run" / CACHE_DIR
    assert record["environment"] == {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "VLLM_CACHE_ROOT": str(cache_root)}
    assert any(cache_root.iterdir())  # vLLM wrote its cache there ...
    assert not (home / ".cache" / "vllm").exists()  # ... and not under the home directory


def test_two_processes_under_torchrun(two_processes):
    records, cache_root = two_processes
    for record in records:
        differences = check_run(record, 2)
        print(f"2 processes: sampling_logp_difference/max per generation {differences}")
        # VLLM_CACHE_ROOT set by the user is kept; the KV cache size, unset, gets the default
        assert record["environment"] == {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "VLLM_CACHE_ROOT": str(cache_root)}


def test_environment_defaults_only_where_unset(tmp_path):
    environ = {"VLLM_CACHE_ROOT": "/somewhere", "VLLM_CPU_KVCACHE_SPACE": ""}
    chosen = set_environment_defaults(str(tmp_path), environ)
    assert chosen == {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}  # an empty value is unset (vLLM's int("") fails)
    assert environ == {"VLLM_CACHE_ROOT": "/somewhere", "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
    environ = {}
    set_environment_defaults("relative/run", environ)
    assert environ["VLLM_CACHE_ROOT"] == os.path.join(os.path.abspath("relative/run"), CACHE_DIR)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"vllm_mode": "server"}, "use_vllm with vllm_mode='server' on CPU: TRL's weight sync to a vLLM server needs"),
        ({"vllm_enable_sleep_mode": True}, "vllm_enable_sleep_mode=True on CPU: vLLM has no sleep mode on CPU"),
        ({"vllm_dtype": "fp32"}, "vllm_dtype must be one of ('auto', 'float32', 'bfloat16', 'float16'), got 'fp32'"),
        ({"vllm_mode": "server", "vllm_dtype": "float32"}, "vllm_dtype='float32' sets the colocated engine's dtype"),
    ],
)
def test_what_cannot_run_on_cpu_is_refused_in_one_line(tmp_path, options, message):
    with pytest.raises(ValueError) as error:
        LoptiGRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, report_to="none", **options)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_vllm_dtype_reaches_the_engine_and_is_never_dropped(monkeypatch):
    """``vllm_dtype`` is added to TRL's ``LLM(...)`` call; a dtype TRL passes itself is compared, not silently
    replaced. (Before: ``functools.partial(LLM, dtype=...)``, whose dtype a call's own dtype overrides.)"""
    from types import SimpleNamespace

    from trl.generation import vllm_generation

    from openrlhf_lopti.trl.cpu_colocate import colocated_engine

    calls = []
    monkeypatch.setattr(vllm_generation, "LLM", lambda *a, **k: calls.append(k))
    args = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_dtype="float32", device=torch.device("cuda"))
    with colocated_engine(args):
        vllm_generation.LLM(model="m")
        vllm_generation.LLM(model="m", dtype="float32")
        with pytest.raises(ValueError, match=r"^vllm_dtype='float32', but TRL builds its vLLM engine with "
                                             r"dtype='bfloat16'") as info:  # fmt: skip
            vllm_generation.LLM(model="m", dtype="bfloat16")
    assert "\n" not in str(info.value)
    assert calls == [{"model": "m", "dtype": "float32"}] * 2
