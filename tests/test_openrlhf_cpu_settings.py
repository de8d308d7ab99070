"""``--cpu``'s flag checks: an error where the CPU path would change results or vLLM's CPU backend refuses the
setting, a note where it is only speed, memory or transport; what vLLM honours on CPU passes unchanged."""

import pytest

from openrlhf_lopti.cli.train_ppo_ray import parse_args
from openrlhf_lopti.openrlhf.cpu.runtime import cpu_settings

BASE = ["--cpu", "--actor.model_name_or_path", "m", "--reward.remote_url", "reward.py", "--vllm.num_engines", "1"]


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--ds.packing_samples"], "--ds.packing_samples needs flash-attn's variable-length attention"),
        # upstream turns packing on for dynamic batching: the message names the flag given (it named packing)
        (["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "24"],
         "--train.dynamic_batch_enable (it packs samples) needs flash-attn's variable-length attention"),
        (["--vllm.tensor_parallel_size", "2"], "--vllm.tensor_parallel_size 2: --cpu runs one vLLM CPU worker per engine"),
        (["--data.max_images_per_prompt", "1", "--algo.advantage.estimator", "reinforce"], "--data.max_images_per_prompt: the CPU install leaves out torchvision"),
        (["--vllm.num_engines", "0"], "--vllm.num_engines must be >= 1"),
        (["--ds.load_in_4bit"], "--ds.load_in_4bit needs bitsandbytes' CUDA kernels"),
    ],
)
def test_what_would_change_results_is_an_error(flags, error):
    errors, _ = cpu_settings(parse_args(BASE + flags))
    assert len(errors) == 1 and errors[0].startswith(error)


def test_speed_and_transport_settings_are_noted_and_replaced():
    flags = ["--ds.attn_implementation", "flash_attention_2", "--vllm.sync_backend", "nccl", "--vllm.sync_with_ray",
             "--ds.adam_offload", "--vllm.enable_sleep", "--ds.enable_sleep", "--train.colocate_all"]  # fmt: skip
    args = parse_args(BASE + flags)
    errors, notes = cpu_settings(args)
    assert errors == []
    assert args.ds.attn_implementation == "sdpa" and args.vllm.sync_backend == "gloo"
    assert not args.vllm.sync_with_ray and not args.ds.adam_offload
    assert not args.vllm.enable_sleep and not args.ds.enable_sleep  # vLLM's CPU platform refuses sleep mode
    text = "\n".join(notes)
    for flag in ("flash_attention_2 -> sdpa", "--vllm.sync_backend gloo", "--ds.adam_offload",
                 "--vllm.enable_sleep: vLLM's CPU backend has no sleep mode", "--ds.enable_sleep"):  # fmt: skip
        assert flag in text
    assert len(notes) == 5


def test_what_vllm_honours_on_cpu_passes_unchanged():
    flags = ["--vllm.enable_prefix_caching", "--vllm.enforce_eager", "--rollout.top_p", "0.9",
             "--vllm.gpu_memory_utilization", "0.5", "--ds.attn_implementation", "sdpa", "--vllm.sync_backend", "gloo"]  # fmt: skip
    args = parse_args(BASE + flags)
    assert cpu_settings(args) == ([], [])
    assert args.vllm.enable_prefix_caching and args.rollout.top_p == 0.9


def test_a_plain_cpu_command_needs_nothing_changed():
    args = parse_args(BASE + ["--ds.attn_implementation", "sdpa", "--vllm.sync_backend", "gloo"])
    assert cpu_settings(args) == ([], [])


def test_fp32_parameters_need_cpu(capsys):
    assert parse_args(BASE + ["--ds.param_dtype", "fp32"]).ds.param_dtype == "fp32"
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE[1:] + ["--ds.param_dtype", "fp32"])
    assert exit_info.value.code == 2
    assert "--ds.param_dtype fp32 needs --cpu" in capsys.readouterr().err


def test_errors_stop_the_launch_before_ray_starts(monkeypatch):
    import openrlhf_lopti.openrlhf.cpu.runtime as runtime

    monkeypatch.setattr(runtime, "init_ray", lambda args: pytest.fail("Ray must not start"))
    with pytest.raises(SystemExit, match="--cpu: --ds.packing_samples needs flash-attn"):
        runtime.launch_on_cpu(parse_args(BASE + ["--ds.packing_samples"]))


def test_a_model_path_without_a_config_is_one_line_before_ray(monkeypatch, tmp_path):
    """A mistyped --actor.model_name_or_path was transformers' 48-line traceback from the --cpu pre-checks."""
    import openrlhf_lopti.openrlhf.cpu.runtime as runtime

    monkeypatch.setattr(runtime, "init_ray", lambda args: pytest.fail("Ray must not start"))
    for model in (str(tmp_path / "no-such-model"), str(tmp_path)):
        with pytest.raises(SystemExit) as exit_info:
            runtime.launch_on_cpu(parse_args(BASE + ["--actor.model_name_or_path", model]))
        message = str(exit_info.value)
        assert message.startswith(f"--cpu: --actor.model_name_or_path {model}: cannot read its config.json (")
        assert "\n" not in message


def test_a_head_size_vllms_cpu_attention_refuses_stops_the_launch_before_ray(monkeypatch, tmp_path):
    import openrlhf_lopti.openrlhf.cpu.runtime as runtime
    from openrlhf_lopti.demo.tiny_model import build_tiny_model

    def args_for(heads: int):
        path = tmp_path / f"heads{heads}"
        build_tiny_model(hidden_size=64, num_layers=1, num_heads=heads, vocab_size=300)[0].save_pretrained(path)
        return parse_args(BASE + ["--actor.model_name_or_path", str(path)])

    assert runtime.check_model_head_size(args_for(2)) == []  # head size 32: tiny-model's default
    refused = args_for(4)  # head size 16
    monkeypatch.setattr(runtime, "init_ray", lambda args: pytest.fail("Ray must not start"))
    with pytest.raises(SystemExit) as exit_info:
        runtime.launch_on_cpu(refused)
    message = str(exit_info.value)
    assert "\n" not in message
    assert message.startswith(f"--cpu: --actor.model_name_or_path {refused.actor.model_name_or_path}: head size 16 ")
    assert "(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)" in message


def tiny_mixtral(path):
    """A tiny Mixtral (4 experts, top 2, head size 32) saved with its tokenizer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from openrlhf_lopti.demo.tiny_model import build_tiny_model

    config = MixtralConfig(vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128)  # fmt: skip
    MixtralForCausalLM(config).save_pretrained(path)
    build_tiny_model(hidden_size=64, num_layers=1, num_heads=2, vocab_size=320)[1].save_pretrained(path)
    return path


def test_a_mixture_of_experts_model_stops_the_launch_before_ray(monkeypatch, tmp_path):
    import openrlhf_lopti.openrlhf.cpu.runtime as runtime

    model = tiny_mixtral(tmp_path / "mixtral")
    monkeypatch.setattr(runtime, "init_ray", lambda args: pytest.fail("Ray must not start"))
    with pytest.raises(SystemExit) as exit_info:
        runtime.launch_on_cpu(parse_args(BASE + ["--actor.model_name_or_path", str(model)]))
    message = str(exit_info.value)
    assert "\n" not in message
    assert message.startswith(f"--cpu: --actor.model_name_or_path {model}: a mixture-of-experts model (num_local_experts = 4)")


@pytest.mark.parametrize(
    "fields, found",
    [
        ({"num_local_experts": 8}, ("num_local_experts", 8)),  # Mixtral, GPT-OSS
        ({"num_experts": 60}, ("num_experts", 60)),  # Qwen2-MoE, OLMoE
        ({"n_routed_experts": 64}, ("n_routed_experts", 64)),  # DeepSeek
        ({"text_config": {"num_experts": 16}}, ("num_experts", 16)),  # a multimodal wrapper
        ({"ffn_config": {"moe_num_experts": 16}}, ("moe_num_experts", 16)),  # DBRX
        ({"num_experts": 0}, None),
        ({"num_experts": None, "hidden_size": 64}, None),
        ({}, None),
    ],
)
def test_moe_configs_are_recognised(fields, found):
    from types import SimpleNamespace

    from openrlhf_lopti.openrlhf.cpu.runtime import moe_experts

    if isinstance(fields.get("text_config"), dict):
        fields = {**fields, "text_config": SimpleNamespace(**fields["text_config"])}
    assert moe_experts(SimpleNamespace(**fields)) == found


def test_the_cli_refuses_a_moe_model_in_one_line_within_seconds(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from .run_logs import failure_report
    from .scripts import REPO

    model = tiny_mixtral(tmp_path / "mixtral")
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "openrlhf_lopti.cli.train_ppo_ray", *BASE, "--actor.model_name_or_path", str(model)],
        capture_output=True, text=True, cwd=REPO, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    seconds = time.monotonic() - start
    print(f"refused in {seconds:.1f} s")
    assert result.returncode == 1, failure_report(result.stderr, result.stdout)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"--cpu: --actor.model_name_or_path {model}: a mixture-of-experts model"), result.stderr
    assert "Traceback" not in result.stderr and "ray" not in result.stderr.lower().replace("array", "")
    # Times real work: parsing and config.json only, no Ray, no vLLM (measured: about 10 s on 2 loaded cores; the
    # bound allows 10x); that no Ray started is also read from stderr above.
    assert seconds < 100


def test_the_local_ray_runs_its_workers_at_the_drivers_priority(monkeypatch):
    """Ray's default worker niceness (15) starved the DeepSpeed ranks and vLLM engines beside two busy processes
    (the weight sync's rendezvous timed out); a real local Ray, started as ``--cpu`` starts it, and a real task."""
    import os

    import ray

    from openrlhf_lopti.openrlhf.cpu.runtime import WORKER_NICENESS_ENV, init_ray

    monkeypatch.setenv(WORKER_NICENESS_ENV, "x")
    monkeypatch.delenv(WORKER_NICENESS_ENV)  # absent now, and absent again after the test
    init_ray(parse_args(BASE))
    try:
        niceness = ray.get(ray.remote(lambda: os.nice(0)).remote(), timeout=600)
    finally:
        ray.shutdown()
    assert niceness == os.nice(0)


def test_a_users_worker_niceness_is_kept(monkeypatch):
    """A ``RAY_worker_niceness`` the user set reaches the local Ray that ``--cpu`` starts unchanged (the test above
    clears it first: an overwrite passed it)."""
    import os

    import ray

    from openrlhf_lopti.openrlhf.cpu.runtime import WORKER_NICENESS_ENV, init_ray

    seen = []
    monkeypatch.setenv(WORKER_NICENESS_ENV, "7")
    monkeypatch.setattr(ray, "init", lambda *a, **k: seen.append(os.environ.get(WORKER_NICENESS_ENV)))
    init_ray(parse_args(BASE))
    assert seen == ["7"]  # what the raylet that ray.init starts reads
