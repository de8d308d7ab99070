"""``python -m openrlhf_lopti.cli.train_ppo_ray``: upstream's parser + ours, parse-time errors, example scripts."""

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_lopti.cli import train_ppo_ray as cli
from openrlhf_lopti.openrlhf.cpu.stubs import STUB_MARKER
from openrlhf_lopti.openrlhf.flags import check_config, fused_backend, lopti_config

from .run_logs import failure_report
from .scripts import MODULE, REPO, SCRIPTS, script_launch
# The least a valid upstream invocation needs (no reward model: the remote reward file stands in).
BASE = ["--actor.model_name_or_path", "m", "--reward.remote_url", "reward.py"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    # timeout: a hang guard (seconds when idle), wide enough for a machine busy with other work
    return subprocess.run(
        [sys.executable, "-m", MODULE, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )


def test_help_lists_upstream_and_our_flags_without_the_gpu_stack():
    result = run_cli("--help")
    assert result.returncode == 0, failure_report(result.stderr, result.stdout)
    for flag in ("--actor.policy_loss_type", "--algo.advantage.estimator", "--vllm.num_engines"):  # upstream
        assert flag in result.stdout
    for flag in ("--algo.ar.alpha", "--algo.lopti.eta", "--algo.lopti.order", "--algo.lopti.quantile",
                 "--algo.lopti.denominator", "--actor.fused_loss"):  # fmt: skip
        assert flag in result.stdout


def test_bad_value_of_our_flag_exits_2_with_the_flag_named():
    result = run_cli(*BASE, "--algo.lopti.eta", "1.5")
    assert result.returncode == 2, failure_report(result.stderr, result.stdout)
    assert "argument --algo.lopti.eta: eta must be a probability threshold in (0, 1], got 1.5" in result.stderr


def test_launch_without_the_gpu_stack_says_so():
    if importlib.util.find_spec("flash_attn") is not None and not getattr(sys.modules.get("flash_attn"), STUB_MARKER, False):
        pytest.skip("real flash-attn installed (GPU install): the same command would start Ray")
    result = run_cli(*BASE, "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2")
    assert result.returncode != 0, failure_report(result.stderr, result.stdout)
    assert "launching needs OpenRLHF's GPU stack" in result.stderr and "flash_attn" in result.stderr, failure_report(result.stderr)  # vLLM is here


@pytest.mark.parametrize(
    "args, message",
    [
        (["--algo.ar.alpha", "-0.1"], "argument --algo.ar.alpha: alpha must be in [0, 1], got -0.1"),
        (["--algo.ar.alpha", "nan"], "argument --algo.ar.alpha: alpha must be in [0, 1]"),
        (["--algo.lopti.eta", "x"], "argument --algo.lopti.eta: not a number: 'x'"),
        (["--algo.lopti.eta", "0.5", "--algo.lopti.quantile", "1"], "argument --algo.lopti.quantile: quantile"),
        (["--algo.lopti.eta", "0.5", "--algo.lopti.quantile", "0.3"], "--algo.lopti.eta=0.5 and --algo.lopti.quantile=0.3"),
        (["--actor.eps_clip", "nan"], "error: --actor.eps_clip must be a number, got nan"),  # named the other flag
        (["--algo.lopti.order", "middle"], "argument --algo.lopti.order: invalid choice"),
        (["--algo.lopti.denominator", "some"], "argument --algo.lopti.denominator: invalid choice"),
        (["--actor.fused_loss", "cuda"], "argument --actor.fused_loss: invalid choice"),
        (["--algo.lopti.eta", "0.5", "--actor.policy_loss_type", "gspo"], "GSPO's ratio is one per sequence"),
        (
            ["--algo.lopti.eta", "0.5", "--actor.loss_agg_mode", "seq-mean-token-mean"],
            "--algo.lopti.denominator all with --actor.loss_agg_mode seq-mean-token-mean",
        ),
        (
            ["--actor.fused_loss", "triton", "--actor.policy_loss_type", "gspo"],
            "--actor.fused_loss triton does not support --actor.policy_loss_type gspo",
        ),
        (
            ["--actor.fused_loss", "torch", "--ds.ring_attn_size", "2"],
            "--actor.fused_loss torch does not support --ds.ring_attn_size > 1",
        ),
        (
            ["--algo.track_direction", "--ds.ring_attn_size", "2"],
            "--algo.track_direction with --ds.ring_attn_size > 1: its forward-only pass",
        ),
        (
            ["--algo.track_direction", "--data.max_images_per_prompt", "1"],
            "--algo.track_direction with --data.max_images_per_prompt > 0",
        ),
        (
            ["--train.async_enable", "--ckpt.best_metric_key", "eval_score"],
            "--ckpt.best_metric_key eval_score with --train.async_enable",
        ),
        (
            ["--train.async_enable", "--ckpt.best_metric_key", "eval_kk_score"],
            "--ckpt.best_metric_key eval_kk_score with --train.async_enable",
        ),
    ],
)
def test_bad_values_and_combinations_fail_at_parse_time(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(BASE + args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err[:300]  # one line: before, upstream's 178-line usage came first


def test_the_denominator_without_lopti_is_refused_as_the_order_is(capsys):
    """``--algo.lopti.denominator phase`` with Lopti off was accepted and did nothing (``--algo.lopti.order`` is
    refused there)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(BASE + ["--algo.lopti.denominator", "phase"])
    assert exit_info.value.code == 2
    assert "--algo.lopti.denominator phase without Lopti has nothing to divide" in capsys.readouterr().err
    assert cli.parse_args(BASE + ["--algo.lopti.denominator", "phase", "--algo.lopti.eta", "0.5"]).algo.lopti.eta == 0.5


def test_flags_are_nested_as_upstream_nests_its_own_and_a_quantile_alone_switches_lopti_on():
    args = cli.parse_args(BASE + ["--algo.ar.alpha", "0.3", "--algo.lopti.quantile", "0.4", "--algo.lopti.order", "high_first"])
    assert args.algo.ar.alpha == 0.3 and args.algo.lopti.quantile == 0.4 and args.algo.lopti.eta == 0.0
    assert args.algo.lopti.order == "high_first" and args.algo.lopti.denominator == "all"
    assert args.algo.kl.estimator  # upstream's own nesting beside ours
    config = lopti_config(args)
    assert config.lopti_enabled and config.lopti_quantile == 0.4 and config.ar_alpha == 0.3
    assert not lopti_config(cli.parse_args(BASE)).lopti_enabled


def test_fused_loss_lists_every_backend_there_is(capsys):
    from openrlhf_lopti.ops.fused_policy_loss import BACKENDS

    assert fused_backend(cli.parse_args(BASE + ["--cpu", "--actor.fused_loss", "cpp"])) == "cpp"
    with pytest.raises(SystemExit):
        cli.parse_args(BASE + ["--actor.fused_loss", "cuda"])
    err = capsys.readouterr().err
    for choice in (*BACKENDS, "off"):
        assert f"'{choice}'" in err, err


def test_a_backend_named_for_the_wrong_device_fails_at_parse_time(monkeypatch, capsys):
    """`--cpu --actor.fused_loss triton` and `--actor.fused_loss cpp` on a GPU run parsed, then failed at the first
    loss call inside a Ray actor, after the first rollout (the local trainer refused them up front)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for flags, says in (
        (["--cpu", "--actor.fused_loss", "triton"], "--actor.fused_loss triton needs a CUDA device, or "
                                                    "TRITON_INTERPRET=1 in the environment to run on cpu"),
        (["--actor.fused_loss", "cpp"], "--actor.fused_loss cpp runs on CPU only, not cuda; use --actor.fused_loss auto"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            cli.parse_args(BASE + flags)
        assert exit_info.value.code == 2 and says in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs the kernel on CPU (the tests' way)
    assert fused_backend(cli.parse_args(BASE + ["--cpu", "--actor.fused_loss", "triton"])) == "triton"


def test_async_with_an_upstream_best_metric_and_track_direction_alone_parse():
    cli.parse_args(BASE + ["--train.async_enable", "--ckpt.best_metric_key", "eval_kk_pass1"])
    cli.parse_args(BASE + ["--algo.track_direction"])


def test_parse_runs_upstream_post_processing_and_keeps_our_flags():
    args = cli.parse_args(
        BASE
        + ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8"]
        + ["--algo.ar.alpha", "0.3", "--algo.lopti.eta", "0.5", "--algo.lopti.denominator", "phase"]
    )
    # upstream's own post-processing ran: hierarchized, clip range filled in, remote_url split, no critic
    assert args.actor.eps_clip_low_high == (0.2, 0.2)
    assert args.reward.remote_url == ["reward.py"]
    assert args.critic.model_name_or_path is None
    assert lopti_config(args).ar_alpha == 0.3 and args.algo.lopti.eta == 0.5
    assert args.algo.lopti.order == "low_first" and args.algo.lopti.denominator == "phase"
    assert args.actor.fused_loss == "auto" and args.algo.lopti.quantile is None


def test_upstream_checks_still_apply():
    # upstream asserts that group estimators get more than one sample per prompt
    with pytest.raises(AssertionError, match="requires n_samples_per_prompt > 1"):
        cli.parse_args(BASE + ["--algo.advantage.estimator", "rloo"])


def test_fused_auto_falls_back_to_upstream_loss_where_it_cannot_run():
    gspo = cli.parse_args(BASE + ["--actor.policy_loss_type", "gspo", "--algo.ar.alpha", "0.2"])
    assert fused_backend(gspo) is None  # auto -> upstream's PolicyLoss (AR on the advantages)
    plain = cli.parse_args(BASE)
    assert fused_backend(plain) == "auto"
    off = cli.parse_args(BASE + ["--actor.fused_loss", "off"])
    assert fused_backend(off) is None
    check_config(gspo)  # no error: auto is allowed to fall back


def test_missing_main_block_is_reported_with_the_file(tmp_path, monkeypatch):
    fake = tmp_path / "train_ppo_ray.py"
    fake.write_text("import argparse\n\ndef main():\n    parser = argparse.ArgumentParser()\n    parser.parse_args()\n")
    spec = importlib.machinery.ModuleSpec(cli.UPSTREAM_MODULE, None, origin=str(fake))
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(RuntimeError, match=str(fake)):
        cli.build_parser()


# ---------------------------------------------------------------- example scripts
def trainer_argv(script: Path, tmp_path: Path) -> list:
    """The arguments ``script`` passes to ``openrlhf_lopti.cli.train_ppo_ray``, captured without launching."""
    return script_launch(script, tmp_path)[1]


def test_there_are_scripts_for_every_variant():
    names = {script.name for script in SCRIPTS}
    assert {
        "train_kk_grpo.sh",
        "train_kk_grpo_ar.sh",
        "train_kk_grpo_lopti.sh",
        "train_kk_grpo_ar_lopti.sh",
        "train_kk_reinforce_pp_ar_lopti.sh",
        "train_math_grpo_ar.sh",
        "multinode_kk_grpo_ar_lopti.sh",
    } <= names
    for script in SCRIPTS:
        assert "set -euo pipefail" in script.read_text(), script.name


@pytest.mark.parametrize("script", SCRIPTS, ids=[script.name for script in SCRIPTS])
def test_example_script_flags_parse_with_our_parser(script, tmp_path):
    argv = trainer_argv(script, tmp_path)
    args = cli.parse_args(argv)  # our flags, upstream's flags and upstream's own post-parse checks
    name = script.name
    cfg = lopti_config(args)
    assert cfg.ar_alpha == (0.1 if "math" in name else 0.3 if "_ar" in name else 0.0)
    assert cfg.lopti_eta == (0.5 if "lopti" in name else 0.0)
    # the GRPO baseline is upstream's step exactly (tests/test_openrlhf_trainer.py); the others use the kernels
    assert cfg.fused_loss == ("off" if name == "train_kk_grpo.sh" else "auto")
    assert args.actor.eps_clip_low_high == [0.2, 0.24]
    assert args.actor.adam.lr == 1e-6 and args.algo.kl.init_coef == 0.001
    if "reinforce" in name:
        assert args.algo.advantage.estimator == "reinforce" and not args.algo.kl.use_loss
        assert args.algo.kl.estimator == "k1"
    else:
        assert args.algo.advantage.estimator == "group_norm" and args.algo.kl.use_loss
        assert args.algo.kl.estimator == "k3"
    assert args.rollout.temperature == (1.0 if "math" in name else 0.7)
    assert args.rollout.batch_size == (128 if "math" in name else 64)
    assert args.rollout.n_samples_per_prompt == 8
    assert args.reward.remote_url == ["reward.py"]
    assert args.data.input_key == "prompt" and args.data.label_key == "label" and args.data.apply_chat_template
    if name.startswith("multinode"):
        assert args.actor.num_nodes == 2 and args.vllm.num_engines * args.vllm.tensor_parallel_size == 16
    # K&K: the best checkpoint is the one of the best accuracy over all sizes (LoptiPPOTrainer's eval_score),
    # not upstream's default, the first *_pass1 key: the 3-person mean reward
    assert args.ckpt.best_metric_key == ("eval_score" if "kk" in name else "")
    assert not args.cpu and args.ds.packing_samples and "flash" in args.ds.attn_implementation


@pytest.mark.parametrize("script", SCRIPTS, ids=[script.name for script in SCRIPTS])
def test_example_scripts_take_cpu_model_and_shrink_flags(script, tmp_path):
    program, argv = script_launch(script, tmp_path, "--rollout.max_new_tokens", "16", env={"CPU": "1", "MODEL": "/models/tiny"})
    if script.name.startswith("multinode"):
        assert program == str(tmp_path / "record")  # the job command runs $PYTHON, like the rest of the script
    args = cli.parse_args(argv)
    assert args.cpu and args.actor.model_name_or_path == "/models/tiny" and args.rollout.max_new_tokens == 16
    assert not args.ds.packing_samples  # flash-attn only: left out on CPU


@pytest.mark.parametrize("nested", [False, True], ids=["text-model", "multimodal"])
def test_fused_lm_head_on_a_local_model_that_transforms_its_logits_fails_at_parse_time(nested, tmp_path, capsys):
    """A Gemma-2-style soft cap in a local model's config.json (or its ``text_config``) is refused before any Ray or
    model start-up; the trainer's own check (test_openrlhf_trainer) would find it only minutes later."""
    import json

    fields = {"final_logit_softcapping": 30.0}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": fields} if nested else fields))
    argv = ["--actor.model_name_or_path", str(tmp_path), "--reward.remote_url", "reward.py", "--actor.fused_lm_head"]
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == 2
    assert (
        "--actor.fused_lm_head does not support models that transform their logits (final_logit_softcapping=30.0); "
        "run without --actor.fused_lm_head"
    ) in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"final_logit_softcapping": None}))  # Gemma 1: no cap
    assert lopti_config(cli.parse_args(argv)).fused_lm_head
    assert lopti_config(cli.parse_args(BASE + ["--actor.fused_lm_head"])).fused_lm_head  # a hub id: checked at load
