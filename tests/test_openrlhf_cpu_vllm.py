"""The ``--cpu`` rollout engine: upstream's ``create_vllm_engines`` / ``RolloutRayActor`` on vLLM's CPU backend.

One real vLLM engine (fp32, a tiny Llama of head size 32) in a local Ray, shared by the tests of this module:
its sampled log-probs against a teacher-forced forward of the same weights, and upstream's weight sync from
this process (rank 0 of the gloo group, as the policy's rank 0 is in a run) through :class:`CPUWorkerWrap`, read
back with ``collective_rpc`` and checked by the log-probs the engine then samples with.
"""

import socket

import pytest
import torch

from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

install_cpu_stubs()

PROMPTS = [[5, 17, 33, 9], [40, 41], [7, 8, 9, 10, 11, 12]]
TEMPERATURE = 0.7
# |vLLM's processed log-prob - log_softmax(logits / T) of the same weights|, fp32 (measured: about 1e-6)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from openrlhf_lopti.demo.tiny_model import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    model, tokenizer = build_tiny_model(hidden_size=64, num_layers=1, num_heads=2, vocab_size=320, max_positions=128)
    with torch.no_grad():
        model.model.norm.weight.mul_(8)  # peaky next-token distributions
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    import ray

    from openrlhf_lopti.openrlhf.cpu.engine import create_cpu_vllm_engines
    from openrlhf_lopti.openrlhf.cpu.runtime import WORKER_NICENESS_ENV

    runtime_env = {"env_vars": {"DS_ACCELERATOR": "cpu"},
                   "worker_process_setup_hook": "openrlhf_lopti.openrlhf.cpu.runtime.setup_cpu_worker"}  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        # as --cpu's own Ray (runtime.init_ray): workers at nice 0, else the engine starves beside other work
        env.setenv(WORKER_NICENESS_ENV, "0")
        ray.init(address="local", num_cpus=3, num_gpus=1, runtime_env=runtime_env, include_dashboard=False)
    try:
        (engine,) = create_cpu_vllm_engines(
            1, 1, str(model_dir), 0, False, True, False, 128, logprobs_mode="processed_logprobs", dtype="float32"
        )
        yield engine
    finally:
        ray.shutdown()


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def sample(engine, max_tokens=8):
    import ray
    from vllm import SamplingParams

    params = SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, logprobs=1, seed=0)
    return ray.get([engine.generate.remote(prompt, params) for prompt in PROMPTS])


def max_logprob_error(model, outputs) -> float:
    """Largest |vLLM's log-prob of a sampled token - the teacher-forced tempered log-softmax of ``model``|."""
    worst = 0.0
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        assert output.prompt_token_ids == prompt and len(tokens) == len(completion.logprobs) > 0
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(logits / TEMPERATURE, -1)[len(prompt) - 1 : -1]
        expected = expected.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        got = torch.tensor([entry[token].logprob for entry, token in zip(completion.logprobs, tokens)])
        worst = max(worst, (got - expected).abs().max().item())
    return worst


def test_sampled_log_probs_are_the_tempered_log_softmax_of_the_same_weights(engine, model_dir):
    error = max_logprob_error(hf_model(model_dir), sample(engine))
    print(f"vLLM CPU vs teacher-forced fp32 log-probs: max |diff| {error:.2e}")
    assert error < LOGPROB_ATOL


def in_vllm_names(hf: dict) -> dict:
    """A Llama's Hugging Face parameters under vLLM's names: q/k/v and gate/up fused, lm_head tied (a vocabulary
    that is a multiple of 64: vLLM pads its embedding to one)."""
    fused = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}
    out = {}
    for name, value in hf.items():
        part = name.split(".")[-2]
        if part in fused:
            target, parts = fused[part]
            out[name.replace(part, target)] = torch.cat([hf[name.replace(part, p)] for p in parts])
        elif part not in ("k_proj", "v_proj", "up_proj") and name != "lm_head.weight":
            out[name] = value
    return out


def test_upstream_weight_sync_reaches_vllm_and_its_kernels(engine, model_dir):
    """Upstream's protocol (``init_process_group`` then per parameter ``update_weight`` + a broadcast from rank 0,
    the last with ``empty_cache=True``): vLLM's parameters become the sent ones bit for bit, and what it samples
    follows them (its CPU GEMMs use packed copies of the weights, repacked after the last parameter)."""
    import ray

    from openrlhf_lopti.openrlhf.cpu.sync import gloo_init_process_group

    model = hf_model(model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5 * param.std().clamp(min=1e-3))
    assert max_logprob_error(model, sample(engine)) > 1e-2  # the engine still has the old weights

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    joined = engine.init_process_group.remote("127.0.0.1", port, 1, 2, "openrlhf", backend="gloo", use_ray=False)
    group = gloo_init_process_group("127.0.0.1", port, 0, 2, None)
    ray.get(joined)
    params = list(model.named_parameters())
    for i, (name, param) in enumerate(params):
        received = engine.update_weight.remote(name, dtype=param.dtype, shape=param.shape, empty_cache=i == len(params) - 1)
        group.broadcast(param.data, src=0, stream=None)
        ray.get(received)

    (weights,) = ray.get(engine.collective_rpc.remote("model_weights"))
    expected = in_vllm_names(dict(model.named_parameters()))
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], value), name
    ray.get(engine.reset_prefix_cache.remote())  # upstream's call after a sync (--vllm.enable_prefix_caching)
    error = max_logprob_error(model, sample(engine))
    print(f"after the weight sync: max |diff| {error:.2e}")
    assert error < LOGPROB_ATOL


def test_a_weight_the_engine_refuses_ends_the_sync_with_its_error_not_a_hang(engine, model_dir):
    """A weight in another dtype than the engine's (here bf16 into the fp32 engine: what a policy in one dtype and
    engines in another would send): the worker still receives it, so this process's broadcast (the policy's rank 0)
    completes, and the worker's TypeError reaches the caller of ``update_weight`` in seconds. Before, the worker raised
    before entering the broadcast and rank 0 waited in it for gloo's timeout (30 minutes), the whole run with it. Then
    a correct sync over the same group still works."""
    import threading
    import time

    import ray

    from openrlhf_lopti.openrlhf.cpu.sync import gloo_init_process_group

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    joined = engine.init_process_group.remote("127.0.0.1", port, 1, 2, "openrlhf", backend="gloo", use_ray=False)
    group = gloo_init_process_group("127.0.0.1", port, 0, 2, None)
    ray.get(joined)

    name, param = next(iter(hf_model(model_dir).named_parameters()))
    sent = param.detach().to(torch.bfloat16)
    start = time.monotonic()
    refused = engine.update_weight.remote(name, dtype=sent.dtype, shape=sent.shape, empty_cache=False)
    broadcast = threading.Thread(target=group.broadcast, args=(sent,), kwargs={"src": 0}, daemon=True)
    broadcast.start()
    broadcast.join(60)
    assert not broadcast.is_alive(), "the policy's broadcast waits for a worker that refused the weight"
    with pytest.raises(ray.exceptions.RayTaskError) as error:
        ray.get(refused, timeout=60)
    seconds = time.monotonic() - start
    print(f"refused weight: the error reached the caller in {seconds:.2f} s")
    # (vLLM's collective_rpc passes the worker's message on, as "Worker failed with error '...'", not its type)
    assert f"--cpu weight sync: the policy sent {name} in torch.bfloat16, the engine runs torch.float32" in str(error.value)

    value = param.detach().clone()  # the group is still in step: a correct weight goes through
    received = engine.update_weight.remote(name, dtype=value.dtype, shape=value.shape, empty_cache=True)
    group.broadcast(value, src=0, stream=None)
    ray.get(received, timeout=120)
