"""verl's own trainer end to end on the CPU: ``CPU=1 bash examples/verl/train_kk_grpo_ar_lopti.sh``, i.e. the real
``python -m verl.trainer.main_ppo`` (Ray, FSDP2 actor and reference on gloo, vLLM's CPU build as the rollout
server, weight sync), 2 RL steps of K&K prompts (responses of at most 32 tokens) on a tiny model.

Four runs, each once per module and read by several tests, none with ``VERL_USE_EXTERNAL_MODULES`` (our package is
a verl plugin: verl loads it in every process): AR+Lopti under verl's default trainer (``trainer.use_v1=true``: nested
per-response fields in TransferQueue) and under the legacy one (``use_v1=false``: padded batches), that one run by
hand (``VERL_PLATFORM=cpu python -m verl.trainer.main_ppo <the script's DRY_RUN overrides>``); GRPO with verl's own
config under the legacy trainer, and the same GRPO run with verl's plugins off (``VERL_USE_EXTERNAL_PLUGINS=none``;
only the CPU seam loaded, ``VERL_USE_EXTERNAL_MODULES=openrlhf_lopti.verl.cpu``), which must train bit for bit as
the run with our plugin loaded. Everything is read off the run's console log (verl's ``console`` logger: one
``step:N - key:value - ...`` line per step) and the HF model verl saves after step 2.

Time: each run is mostly start-up (Ray, vLLM's engine, two FSDP2 engines): 1.7-3.7 minutes measured on the 2-core
machine beside other work. A planted bad key must fail in seconds, before Ray starts, with one line; an error in a Ray
worker must end the run with its line, not hang.
"""

import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from ..run_logs import first_errors

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "verl" / "train_kk_grpo_ar_lopti.sh"
ACTOR = "actor_rollout_ref.actor"
# a quantile threshold: on a tiny random model every sampled token has p ~ 1/vocab, below any eta, and the high
# phase would be empty (a user's eta reaching the round unchanged: test_config.py, test_worker.py)
QUANTILE_INSTEAD_OF_ETA = (f"++{ACTOR}.policy_loss.lopti_eta=null", f"++{ACTOR}.policy_loss.lopti_quantile=0.5")
REWARD = Path(__file__).resolve().parent / "varied_reward.py"  # non-zero advantages on a tiny random model
# verl's variables that load plugins: unset unless a run sets them (our plugin must load without them)
PLUGIN_VARIABLES = ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS", "VERL_PLATFORM")
# Two GRPO runs that verl itself repeats bit for bit. The same responses only with verl's seeded rollout (vLLM's
# per-request seed, rollout/vllm_async_server.py:625-627), which is the same for every request: the responses to one
# prompt are all the same, so one per prompt (4 prompts a step; GRPO's advantage of a one-response group is its
# reward, core_algos.py:315-317: it trains). The same batches only under the legacy trainer: the default one's replay
# buffer hands trajectories over as they finish (measured: two such runs, both with our plugin, apart from step 1 in
# the 7th digit of actor/grad_norm, and by up to 4e-9 in the saved parameters).
REPRODUCIBLE_GRPO = ("actor_rollout_ref.rollout.full_determinism=true", "actor_rollout_ref.rollout.n=1",
                     "data.train_batch_size=4", f"{ACTOR}.ppo_mini_batch_size=4", "trainer.use_v1=false")
# gauges of time and memory, not training: they differ between any two runs
NOT_TRAINING = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/")
RUN_TIMEOUT = 1500  # s; a run takes 3-4 minutes idle, ~6 under load: 4x slack before calling it a hang
# Ray's own start-up, before any verl code runs: ray.init waits a fixed 30 s (not configurable, ray/_private/node.py)
# for its raylet to register with its GCS. In CI, beside the main track's pipeline launches (load average 9 on 2
# cores), both GRPO runs' ray.init gave up so (2026-12-04); such a run never started, so it is launched again.
RAY_NODE_TIMEOUT = "The current node timed out during startup"
RAY_START_TRIES = 3


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny model (``openrlhf_lopti tiny-model``) and K&K data in verl's parquet format, built once."""
    root = tmp_path_factory.mktemp("main_ppo")
    py = sys.executable
    for args in (["-m", "openrlhf_lopti", "tiny-model", "--out", str(root / "tiny")],
                 ["-m", "openrlhf_lopti", "data", "kk", "--out", str(root / "kk"), "--people", "3",
                  "--train-per-n", "8", "--test-per-n", "2"],
                 ["-m", "openrlhf_lopti.verl.data", str(root / "kk")]):  # fmt: skip
        subprocess.run([py, *args], check=True, capture_output=True, text=True)
    return root


def environment(inputs, method: str, **extra: str) -> dict:
    """The script's environment: no verl plugin variable but those in ``extra`` (the plugin loads by itself)."""
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_VARIABLES}
    return dict(env, CPU="1", PYTHON=sys.executable, MODEL=str(inputs / "tiny"), DATA=str(inputs / "kk"),
                METHOD=method, **extra)  # fmt: skip


def launch(inputs, method: str, *overrides: str, timeout: float = RUN_TIMEOUT, by_hand: bool = False,
           **env: str) -> subprocess.CompletedProcess:
    """``CPU=1 bash <the script> <overrides>``, or with ``by_hand`` what a user types instead: ``VERL_PLATFORM=cpu
    python -m verl.trainer.main_ppo`` with the script's ``DRY_RUN=1`` overrides (and a private Ray temp dir)."""
    env = environment(inputs, method, **env)
    command = ["bash", str(SCRIPT), *overrides]
    if by_hand:
        printed = subprocess.run(command, env=dict(env, DRY_RUN="1"), capture_output=True, text=True, check=True)
        command = [sys.executable, "-m", "verl.trainer.main_ppo", *printed.stdout.splitlines()]
        env = {k: v for k, v in env.items() if k not in ("CPU", "PYTHON", "MODEL", "DATA", "METHOD")}
        env["VERL_PLATFORM"] = "cpu"
    for attempt in range(1, RAY_START_TRIES + 1):
        ray_tmp = tempfile.mkdtemp(prefix="verl-ray-", dir="/tmp")  # short: Ray's socket paths < 108 characters
        temp_dir = [f"++ray_kwargs.ray_init._temp_dir={ray_tmp}"] if by_hand else []  # the script makes its own
        try:
            proc = subprocess.run(command + temp_dir, env=env, capture_output=True, text=True, timeout=timeout,
                                  cwd=str(inputs))  # fmt: skip
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
        if proc.returncode == 0 or RAY_NODE_TIMEOUT not in proc.stdout + proc.stderr:
            break
        # a warning, not a print: pytest lists it in the run's summary, so a retry that saved a run is on record
        warnings.warn(f"main_ppo: Ray's node did not start within its 30 s (try {attempt} of {RAY_START_TRIES})")
    return proc


def step_metrics(log: str) -> dict:
    """``{step: {key: value}}`` from verl's console logger lines (``step:N - key:value - ...``)."""
    steps = {}
    for line in log.splitlines():
        match = re.search(r"step:(\d+) - (.*)$", line)
        if match is None:
            continue
        values = steps.setdefault(int(match.group(1)), {})  # verl prints a step's metrics on more than one line
        for part in match.group(2).split(" - "):
            key, _, value = part.rpartition(":")
            number = re.fullmatch(r"(?:np\.\w+\()?([-+0-9.eE]+|nan|inf)\)?", value.strip())
            if number is not None:
                values[key.strip()] = float(number.group(1))
    return steps


def run(inputs, tmp_path_factory, method: str, *overrides: str, by_hand: bool = False, **env: str) -> dict:
    """One run: its exit code, log, per-step metrics and checkpoint folder (the HF model after step 2)."""
    out = tmp_path_factory.mktemp(f"run-{method.replace('+', '-')}")
    proc = launch(inputs, method, f"trainer.default_local_dir={out}", "trainer.save_freq=2",
                  f"{ACTOR}.checkpoint.save_contents=[hf_model]", f"reward.custom_reward_function.path={REWARD}",
                  *overrides, by_hand=by_hand, **env)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"main_ppo exited {proc.returncode}: {first_errors(log)}\n{log[-3000:]}"
    return {"log": log, "steps": step_metrics(log), "out": out}


@pytest.fixture(scope="module")
def grpo_v0(inputs, tmp_path_factory):
    return run(inputs, tmp_path_factory, "grpo", *REPRODUCIBLE_GRPO)


@pytest.fixture(scope="module")
def grpo_v0_without_plugins(inputs, tmp_path_factory):
    """The GRPO run with verl's plugins off: verl without our package, but for the CPU seam it needs here."""
    return run(inputs, tmp_path_factory, "grpo", *REPRODUCIBLE_GRPO, VERL_USE_EXTERNAL_PLUGINS="none",
               VERL_USE_EXTERNAL_MODULES="openrlhf_lopti.verl.cpu")  # fmt: skip


@pytest.fixture(scope="module")
def ar_lopti_v1(inputs, tmp_path_factory):
    return run(inputs, tmp_path_factory, "ar+lopti", *QUANTILE_INSTEAD_OF_ETA)


@pytest.fixture(scope="module")
def ar_lopti_v0(inputs, tmp_path_factory):
    return run(inputs, tmp_path_factory, "ar+lopti", *QUANTILE_INSTEAD_OF_ETA, "trainer.use_v1=false", by_hand=True)


def saved_model(result) -> dict:
    """The HF model verl saved after step 2: ``{name: tensor}``."""
    from safetensors.torch import load_file

    saved = list(Path(result["out"]).glob("global_step_2/actor/huggingface/*.safetensors"))
    assert saved, f"no HF model saved under {result['out']}"
    after = {}
    for path in saved:
        after.update(load_file(str(path)))
    return after


def saved_minus_initial(result, inputs) -> float:
    """The largest change of any parameter between the tiny model and the HF model verl saved after step 2."""
    from safetensors.torch import load_file

    before = load_file(str(inputs / "tiny" / "model.safetensors"))
    after = saved_model(result)
    common = set(before) & set(after)
    assert common, f"no parameter in common: {sorted(before)[:3]} vs {sorted(after)[:3]}"
    return max(float((after[k].float() - before[k].float()).abs().max()) for k in common)


def check_trained(result, inputs) -> None:
    """Both steps logged; after step 1's update the rollout engine samples from the updated weights (vLLM's
    probabilities of step 2 equal the actor's recomputed ones); the parameters changed."""
    steps = result["steps"]
    assert sorted(steps) == [1, 2], f"steps logged: {sorted(steps)}"
    for step in (1, 2):
        assert "actor/pg_loss" in steps[step] and torch.isfinite(torch.tensor(steps[step]["actor/grad_norm"]))
    # vLLM (fp32) against the FSDP actor (fp32) on the same tokens and weights: rounding only (measured 3e-9..8e-9)
    assert steps[2]["training/rollout_probs_diff_max"] < 1e-5, steps[2]
    assert saved_minus_initial(result, inputs) > 0


def check_ar_lopti(result) -> None:
    """The round's metrics at every step: a threshold inside (0, 1), both phases trained (each logs its own verl
    metrics), AR's mean weight within [1 - alpha, 1]."""
    for step, metrics in result["steps"].items():
        assert 0 < metrics["actor/lopti/threshold"] < 1, (step, metrics)
        assert 0 < metrics["actor/lopti/low_token_frac"] < 1, (step, metrics)
        assert 0.7 <= metrics["actor/ar/mean_weight"] <= 1.0, (step, metrics)  # alpha 0.3
        for phase in ("low", "high"):
            assert metrics[f"actor/lopti/{phase}/tokens"] > 0 and f"actor/lopti/{phase}/grad_norm" in metrics


def test_grpo_with_verls_own_config(grpo_v0, inputs):
    check_trained(grpo_v0, inputs)
    assert not any(key.startswith(("actor/lopti/", "actor/ar/")) for key in grpo_v0["steps"][1])


def test_our_plugin_leaves_a_run_without_our_keys_as_verl_trains_it(grpo_v0, grpo_v0_without_plugins):
    """Loaded into every process of a GRPO run that never heard of AR, our plugin changes nothing: the same metrics
    at every step and the same saved parameters, bit for bit, as with verl's plugins off."""
    on, off = grpo_v0["steps"], grpo_v0_without_plugins["steps"]
    assert sorted(on) == sorted(off) == [1, 2], (sorted(on), sorted(off))
    for step in on:
        keys = {k for k in set(on[step]) | set(off[step]) if not k.startswith(NOT_TRAINING)}
        assert {"actor/pg_loss", "actor/grad_norm", "critic/advantages/mean", "training/rollout_probs_diff_max"} <= keys
        assert {k for k in keys if k not in on[step] or k not in off[step]} == set(), step
        differ = {k: (on[step][k], off[step][k]) for k in keys if on[step][k] != off[step][k]
                  and not (math.isnan(on[step][k]) and math.isnan(off[step][k]))}  # fmt: skip
        assert not differ, (step, differ)
    with_plugin, without = saved_model(grpo_v0), saved_model(grpo_v0_without_plugins)
    assert sorted(with_plugin) == sorted(without)
    assert all(torch.equal(with_plugin[k], without[k]) for k in with_plugin)


def test_ar_and_lopti_under_the_default_trainer(ar_lopti_v1, inputs):
    """The round ran on what verl's default trainer really hands the worker: nested per-response fields."""
    check_trained(ar_lopti_v1, inputs)
    check_ar_lopti(ar_lopti_v1)
    assert "verl worker: the round's per-response fields are nested (jagged rows)" in ar_lopti_v1["log"]


def test_ar_and_lopti_under_the_legacy_trainer(ar_lopti_v0, inputs):
    check_trained(ar_lopti_v0, inputs)
    check_ar_lopti(ar_lopti_v0)
    assert "verl worker: the round's per-response fields are padded" in ar_lopti_v0["log"]


def test_a_bad_key_fails_in_seconds_with_one_line(inputs):
    """A planted bad value of our key: hydra builds the actor config in the driver, before Ray starts."""
    start = time.monotonic()
    proc = launch(inputs, "ar+lopti", f"++{ACTOR}.policy_loss.ar_alpha=1.5", timeout=300)
    elapsed, log = time.monotonic() - start, proc.stdout + proc.stderr
    # ~12 s idle, 17 s beside busy processes (importing verl and hydra); 10x that before calling it slow
    assert proc.returncode != 0 and elapsed < 170, (proc.returncode, elapsed)
    lines = [line for line in log.splitlines() if "ar_alpha: alpha must be in [0, 1], got 1.5" in line]
    assert lines, log[-3000:]
    assert "Started a local Ray instance" not in log  # refused before any cluster started


def test_an_error_in_a_worker_ends_the_run_with_its_line(inputs):
    """A setting Lopti refuses, found by the actor worker (a Ray actor) when it gets its loss function: main_ppo
    exits non-zero with our one-line error in its output, without hanging (52 s at load 5, mostly start-up)."""
    start = time.monotonic()
    proc = launch(inputs, "ar+lopti", f"{ACTOR}.loss_agg_mode=seq-mean-token-mean", timeout=600)
    elapsed, log = time.monotonic() - start, proc.stdout + proc.stderr
    assert proc.returncode != 0 and elapsed < 500, (proc.returncode, elapsed)  # about 10x the 43-52 s measured
    ours = "ConfigError: actor_rollout_ref.actor.loss_agg_mode: Lopti's two phases add up to one pass only for"
    assert ours in log, log[-3000:]
    assert "WorkerDict.actor_rollout_ref_init_model" in log  # raised in the worker, reported by the driver
