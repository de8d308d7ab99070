"""Multi-node on one machine: ``examples/scripts/multinode_kk_grpo_ar_lopti.sh`` head / worker / submit with ``CPU=1``.

A Ray head and a second raylet (a second Ray node), each declaring one logical GPU, started by the script's own
``head`` and ``worker`` roles; then ``submit`` runs the script's ``ray job submit`` with the tiny model and a
few steps, keeping the script's ZeRO-3, bf16 and colocation settings (sleep mode is off on CPU). The policy's two
data-parallel ranks and the two vLLM engines (vLLM's CPU backend, bf16 like the policy) must land on the two
nodes, so one engine runs on the second raylet and gets its weights from the policy's rank 0 on the head (Ray's
state API records the node of every actor); the job must succeed and the saved model must load with
``from_pretrained``.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from .ds_ranks import free_port
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


def ray_cli(*args: str, env: dict) -> str:
    result = subprocess.run([str(Path(sys.executable).parent / "ray"), *args], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def alive_nodes(env: dict) -> set:
    """Node ids Ray's state API lists as alive (empty while the head is still starting)."""
    try:
        listed = json.loads(ray_cli("list", "nodes", "--format", "json", env=env))
    except (AssertionError, json.JSONDecodeError):  # not up yet: an error, or "No resource in the cluster"
        return set()
    return {node["node_id"] for node in listed if node["state"] == "ALIVE"}


@pytest.fixture
def cluster(tmp_path):
    """Head and worker started by the script; every process of this cluster is killed after the test."""
    bin_dir = str(Path(sys.executable).parent)
    env = dict(
        os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HEAD_IP="127.0.0.1", NUM_NODES="2", GPUS_PER_NODE="1",
        RAY_PORT=str(free_port()), DASHBOARD_PORT=str(free_port()), CPU="1", PYTHON=sys.executable,
    )  # fmt: skip
    env["RAY_ADDRESS"] = f"127.0.0.1:{env['RAY_PORT']}"
    short = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # this cluster's sockets and logs (paths < 108 bytes)
    procs = []
    try:
        for role, nodes in (("head", 1), ("worker", 2)):
            extra = ["--block", "--num-cpus", "3"] + ([f"--temp-dir={short}"] if role == "head" else [])
            log = open(tmp_path / f"{role}.log", "w")
            procs.append(
                subprocess.Popen(["bash", str(SCRIPT), role, *extra], env=env, start_new_session=True, stdout=log,
                                 stderr=subprocess.STDOUT)  # fmt: skip
            )
            deadline = time.monotonic() + 180
            while len(alive_nodes(env)) < nodes:
                assert time.monotonic() < deadline, (tmp_path / f"{role}.log").read_text()[-3000:]
                time.sleep(2)
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

    from openrlhf_lopti.local.tiny_model import build_tiny_model

    model_dir, data, save = tmp_path / "tiny", tmp_path / "kk", tmp_path / "save"
    model, tokenizer = build_tiny_model(vocab_size=512, max_positions=512)
    with torch.no_grad():
        model.model.norm.weight.mul_(8)  # peaky: tokens on both sides of Lopti's eta
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    subprocess.run(
        [sys.executable, "-m", "openrlhf_lopti", "data", "kk", "--out", str(data), "--people", "2", "3",
         "--train-per-n", "4", "--test-per-n", "2"],
        check=True, capture_output=True,
    )  # fmt: skip
    env = dict(cluster, MODEL=str(model_dir), DATA_DIR=str(data), SAVE_DIR=str(save))
    env.pop("RAY_ADDRESS")  # the script submits through the head's dashboard address
    result = subprocess.run(["bash", str(SCRIPT), "submit", *SHRINK], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    logs = result.stdout + result.stderr
    assert "succeeded" in logs and "Global step 2:" in logs  # 8 prompts, 4 per step: the whole episode

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
