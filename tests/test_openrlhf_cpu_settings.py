"""``--cpu``'s flag checks: an error where the CPU path would change results, a note where it is only speed."""

import pytest

from openrlhf_lopti.cli.train_ppo_ray import parse_args
from openrlhf_lopti.openrlhf.cpu.runtime import cpu_settings

BASE = ["--cpu", "--actor.model_name_or_path", "m", "--reward.remote_url", "reward.py", "--vllm.num_engines", "1"]


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--ds.packing_samples"], "--ds.packing_samples needs flash-attn's variable-length attention"),
        (["--vllm.tensor_parallel_size", "2"], "--vllm.tensor_parallel_size 2: the CPU rollout engine is one process"),
        (["--vllm.num_engines", "0"], "--vllm.num_engines must be >= 1"),
        (["--ds.load_in_4bit"], "--ds.load_in_4bit needs bitsandbytes' CUDA kernels"),
    ],
)
def test_what_would_change_results_is_an_error(flags, error):
    errors, _ = cpu_settings(parse_args(BASE + flags))
    assert len(errors) == 1 and errors[0].startswith(error)


def test_speed_and_transport_settings_are_noted_and_replaced():
    flags = ["--ds.attn_implementation", "flash_attention_2", "--vllm.sync_backend", "nccl", "--vllm.sync_with_ray",
             "--ds.adam_offload", "--vllm.enable_prefix_caching", "--vllm.enforce_eager"]  # fmt: skip
    args = parse_args(BASE + flags)
    errors, notes = cpu_settings(args)
    assert errors == []
    assert args.ds.attn_implementation == "sdpa" and args.vllm.sync_backend == "gloo"
    assert not args.vllm.sync_with_ray and not args.ds.adam_offload
    text = "\n".join(notes)
    for flag in ("flash_attention_2 -> sdpa", "--vllm.sync_backend gloo", "--ds.adam_offload",
                 "--vllm.enable_prefix_caching", "--vllm.enforce_eager"):  # fmt: skip
        assert flag in text


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
