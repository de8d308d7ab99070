"""Multi-node on one machine: ``examples/scripts/multinode_kk_grpo_ar_lopti.sh`` head / worker / submit with ``CPU=1``.

A Ray head and a second raylet (a second Ray node), each declaring one logical GPU, started by the script's own
``head`` and ``worker`` roles; then ``submit`` runs the script's ``ray job submit`` with the tiny model and a
few steps, keeping the script's ZeRO-3, bf16 and colocation settings (sleep mode is off on CPU). The policy's two
data-parallel ranks and the two vLLM engines (vLLM's CPU backend, bf16 like the policy) must land on the two
nodes, so one engine runs on the second raylet and gets its weights from the policy's rank 0 on the head (Ray's
state API records the node of every actor); the job must succeed and the saved model must load with
``from_pretrained``.

On a machine loaded by other work every wait here is long but bounded (docs/CPU.md, "The multi-node test under
load"): the nodes get 5 minutes to come up, Ray's health checks of the raylets tolerate a minute of silence, a
submission that finds the head's job agent not yet up (Ray gives it 10 s) is made again, and the job gets 30
minutes. A failure's message starts with the first error line of the job's output and of the cluster's Ray logs
(``tests/run_logs.py``), not the tail of Ray's output.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from .ds_ranks import free_port
from .run_logs import failure_report, ray_log_files
from .scripts import REPO

SCRIPT = REPO / "examples" / "scripts" / "multinode_kk_grpo_ar_lopti.sh"
# The script's ZeRO-3 and bf16 stay: the weight sync gathers each partitioned parameter before broadcasting it.
# With the fused lm_head, the policy's and the reference's log-prob passes gather the output layer too.
SHRINK = [
    "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "1",  # --train.colocate_all: 1 engine per GPU
    "--actor.fused_lm_head",
    "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--rollout.micro_batch_size", "4",
    "--rollout.max_new_tokens", "16", "--data.max_len", "400",
    "--train.batch_size", "8", "--train.micro_batch_size", "2", "--train.num_episodes", "1", "--eval.steps", "1",
]  # fmt: skip
NODE_START_S = 300  # each `ray start` until Ray's state API lists the node alive (about 10 s on an idle machine)
JOB_S = 1800  # the whole job (measured: 94 s on 2 cores at a load average of 7; the test 142 s)
AGENT_RETRY_S = 180  # resubmitting while the head's job agent is not up yet
NO_AGENT = "No available agent to submit job"
# Ray's GCS declares a raylet dead after health_check_failure_threshold failed checks of health_check_timeout_ms
# each (defaults 5 x 10 s): a raylet starved of CPU for under a minute would be dropped, and its actors with it.
RAY_HEALTH = {"RAY_health_check_failure_threshold": "20", "RAY_health_check_timeout_ms": "30000"}


def ray_cli(*args: str, env: dict) -> str:
    """``ray <args>``; Ray's state API calls get 2 minutes (default 30 s) on a loaded machine."""
    timeout = ["--timeout", "120"] if args[:1] == ("list",) else []
    result = subprocess.run([str(Path(sys.executable).parent / "ray"), *args, *timeout], env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, failure_report(("stderr", result.stderr), ("stdout", result.stdout))
    return result.stdout


def alive_nodes(env: dict) -> set:
    """Node ids Ray's state API lists as alive (empty while the head is still starting)."""
    try:
        listed = json.loads(ray_cli("list", "nodes", "--format", "json", env=env))
    except (AssertionError, json.JSONDecodeError):  # not up yet: an error, or "No resource in the cluster"
        return set()
    return {node["node_id"] for node in listed if node["state"] == "ALIVE"}


def submit(env: dict, ray_temp_dir: Path) -> str:
    """The script's ``submit`` (its ``ray job submit``, which streams the job's output until it ends); made again while
    the head's job agent is not up (the job never started). Returns the output of the run that succeeded."""
    deadline = time.monotonic() + AGENT_RETRY_S
    while True:
        start = time.monotonic()
        try:
            result = subprocess.run(["bash", str(SCRIPT), "submit", *SHRINK], env=env, capture_output=True, text=True,
                                    timeout=JOB_S)  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            output = b"".join(x for x in (exc.stdout, exc.stderr) if x).decode(errors="replace")
            pytest.fail(f"the job did not end within {JOB_S} s\n" + failure_report(("job output", output),
                                                                                    *ray_log_files(ray_temp_dir)))  # fmt: skip
        logs = result.stdout + result.stderr
        print(f"submit: exit {result.returncode} after {time.monotonic() - start:.0f} s")
        if result.returncode != 0 and NO_AGENT in logs and time.monotonic() < deadline:
            time.sleep(5)
            continue
        assert result.returncode == 0 and "succeeded" in logs, failure_report(
            ("job output", logs), *ray_log_files(ray_temp_dir)
        )
        return logs


@pytest.fixture
def ray_default_agent_port_taken():
    """Ray's default dashboard-agent port (52365) held for the test, as another local Ray holds it in CI: ``make
    test`` runs tests/verl beside the main track, and each of verl's local clusters binds that port on the machine's
    address and on 127.0.0.1. The head's agent lost it once (its HTTP service off, ``ray job submit`` answered "No
    available agent" for 3 minutes); so each node of this cluster gets a free agent port. Nothing to do when
    another process holds the port already."""
    from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT

    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", DEFAULT_DASHBOARD_AGENT_LISTEN_PORT))
            sock.listen()
        except OSError:
            pass
        yield


@pytest.fixture
def cluster(tmp_path, ray_default_agent_port_taken):
    """Head and worker started by the script; every process of this cluster is killed after the test."""
    bin_dir = str(Path(sys.executable).parent)
    env = dict(
        os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HEAD_IP="127.0.0.1", NUM_NODES="2", GPUS_PER_NODE="1",
        RAY_PORT=str(free_port()), DASHBOARD_PORT=str(free_port()), CPU="1", PYTHON=sys.executable, **RAY_HEALTH,
    )  # fmt: skip
    env["RAY_ADDRESS"] = f"127.0.0.1:{env['RAY_PORT']}"
    env.pop("RAY_worker_niceness", None)  # the script's CPU=1 sets it (checked at the end of the test)
    # the weight-sync group's hang guard, as in test_openrlhf_cpu_pipeline.py: its 60 s default was crossed beside
    # two busy processes while the engines started; 10x that
    env["OPENRLHF_LOPTI_CPU_SYNC_TIMEOUT"] = "600"
    short = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # this cluster's sockets and logs (paths < 108 bytes)
    procs = []
    try:
        for role, nodes in (("head", 1), ("worker", 2)):
            extra = ["--block", "--num-cpus", "3", f"--dashboard-agent-listen-port={free_port()}"]
            extra += [f"--temp-dir={short}"] if role == "head" else []
            log = open(tmp_path / f"{role}.log", "w")
            procs.append(
                subprocess.Popen(["bash", str(SCRIPT), role, *extra], env=env, start_new_session=True, stdout=log,
                                 stderr=subprocess.STDOUT)  # fmt: skip
            )
            deadline = time.monotonic() + NODE_START_S
            while len(alive_nodes(env)) < nodes:
                assert time.monotonic() < deadline, f"the {role} node is not alive after {NODE_START_S} s\n" + failure_report(
                    tmp_path / f"{role}.log", *ray_log_files(short)
                )
                time.sleep(2)
        env["RAY_TEMP_DIR_OF_TEST"] = short  # for the test's failure messages (Ray does not read it)
        yield env
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        # Ray's daemons (GCS, raylets, dashboard) leave the script's process groups: find them by the temp dir
        # (they ignore SIGTERM while their raylet's children shut down)
        subprocess.run(["pkill", "-9", "-f", short], check=False)
        shutil.rmtree(short, ignore_errors=True)


def test_multinode_script_places_ranks_on_both_nodes_and_trains(cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from openrlhf_lopti.demo.tiny_model import build_tiny_model

    model_dir, data, save = tmp_path / "tiny", tmp_path / "kk", tmp_path / "save"
    model, tokenizer = build_tiny_model(vocab_size=512, max_positions=512)
    with torch.no_grad():
        model.model.norm.weight.mul_(8)  # peaky: tokens on both sides of Lopti's eta
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    made = subprocess.run(
        [sys.executable, "-m", "openrlhf_lopti", "data", "kk", "--out", str(data), "--people", "2", "3",
         "--train-per-n", "4", "--test-per-n", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, failure_report(made.stderr, made.stdout)
    env = dict(cluster, MODEL=str(model_dir), DATA_DIR=str(data), SAVE_DIR=str(save))
    env.pop("RAY_ADDRESS")  # the script submits through the head's dashboard address
    logs = submit(env, Path(cluster["RAY_TEMP_DIR_OF_TEST"]))
    assert "Global step 2:" in logs, failure_report(logs)  # 8 prompts, 4 per step: the whole episode

    nodes = alive_nodes(cluster)
    listed = ray_cli("list", "actors", "--detail", "--format", "json", "--filter", "class_name=LoptiPolicyModelActor",
                     env=cluster)  # fmt: skip
    policy_nodes = [actor["node_id"] for actor in json.loads(listed)]
    assert len(policy_nodes) == 2 and set(policy_nodes) == nodes  # one data-parallel rank on each node
    listed = ray_cli("list", "actors", "--detail", "--format", "json", "--filter", "class_name=CPURolloutActor",
                     env=cluster)  # fmt: skip
    engine_nodes = [actor["node_id"] for actor in json.loads(listed)]
    assert len(engine_nodes) == 2 and set(engine_nodes) == nodes  # a vLLM engine on each node, the second one too
    AutoModelForCausalLM.from_pretrained(save / "kk_grpo_ar_lopti_2nodes")  # the final model, saved by rank 0

    # CPU=1 starts the raylets with RAY_worker_niceness=0: Ray's default (15) starved the ranks and engines beside
    # other work. A task on each node reports its worker's niceness.
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=cluster["RAY_ADDRESS"])
    try:
        where = ray.remote(lambda: (ray.get_runtime_context().get_node_id(), os.nice(0)))
        pinned = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                  for node in nodes]  # fmt: skip
        assert dict(ray.get(pinned, timeout=600)) == {node: os.nice(0) for node in nodes}
    finally:
        ray.shutdown()
