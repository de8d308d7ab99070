"""End to end: ``examples/scripts/train_kk_grpo_ar_lopti.sh`` with ``CPU=1`` runs OpenRLHF's own ``train(args)``.

The script's exact command line (captured from the script, plus the shrink flags a laptop needs) runs in this
process as the Ray driver: a local Ray with logical GPUs, 2 data-parallel policy ranks under ZeRO-2 with
AR + Lopti and the fused loss on the C++ kernel, 2 reference ranks, 2 CPU rollout engines colocated with them
(the script's ``--train.colocate_all``), KL as a loss, a cosine LR schedule, K&K rewards, eval and checkpoints;
then the same command resumes from its checkpoint with ``--ckpt.load_enable``. Being the driver lets the test
read the rollout engines' weights after training: the weight sync is checked, not assumed.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

from .scripts import REPO, script_launch

SCRIPT = REPO / "examples" / "scripts" / "train_kk_grpo_ar_lopti.sh"
# What fits 2 cores: 2 ranks of everything, 4 prompts x 4 samples per step, 4 steps per episode (16 prompts).
SHRINK = [
    "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2",
    "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "1",
    "--ds.zero_stage", "2", "--ds.param_dtype", "fp32",
    "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--rollout.micro_batch_size", "4",
    "--rollout.max_new_tokens", "24", "--data.max_len", "400",
    "--train.batch_size", "8", "--train.micro_batch_size", "2", "--train.num_episodes", "1",
    "--actor.adam.lr", "1e-3", "--actor.lr_scheduler", "cosine_with_min_lr", "--actor.lr_warmup_ratio", "0.25",
    "--eval.steps", "2", "--ckpt.save_steps", "2", "--logger.logging_steps", "1",
]  # fmt: skip
# The K&K reward (so its scores, eval_score and extra logs are exercised) plus a small length term: a random
# model's K&K reward is the same -3 for every response, which would leave GRPO nothing to learn from.
REWARD = """
from openrlhf_lopti.tasks.reward_kk import reward_func as kk_reward


def reward_func(queries, prompts, labels):
    out = kk_reward(queries, prompts, labels)
    length = [len(q) - len(p) for q, p in zip(queries, prompts)]
    out["rewards"] = out["rewards"] + 0.01 * out["rewards"].new_tensor(length)
    return out
"""


def run(cmd: list) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def scalars(logdir: Path, tag: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


@pytest.fixture
def driver(monkeypatch):
    """This process as the Ray driver of a ``--cpu`` run; what launching rebinds or sets is restored after."""
    install_cpu_stubs()
    import openrlhf.cli.train_ppo_ray as upstream
    import openrlhf.trainer.ppo_trainer as controller
    import ray

    import openrlhf_lopti.openrlhf.cpu.rollout as rollout

    for module, name in ((upstream, "get_strategy"), (upstream, "create_vllm_engines"),
                         (upstream, "PolicyModelActor"), (controller, "PPOTrainer")):  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    engines = []
    create = rollout.create_cpu_rollout_engines

    def create_and_keep(*args, **kwargs):
        engines[:] = create(*args, **kwargs)
        return engines

    monkeypatch.setattr(rollout, "create_cpu_rollout_engines", create_and_keep)
    yield engines
    ray.shutdown()


def test_kk_script_trains_on_cpu_syncs_the_rollout_weights_and_resumes(driver, tmp_path, capfd):
    import ray
    from transformers import AutoModelForCausalLM

    from openrlhf_lopti.cli.train_ppo_ray import main
    from openrlhf_lopti.local.tiny_model import build_tiny_model

    model_dir, data, save = tmp_path / "tiny", tmp_path / "kk", tmp_path / "save"
    model, tokenizer = build_tiny_model(vocab_size=512, max_positions=512)
    with torch.no_grad():
        model.model.norm.weight.mul_(8)  # peaky next-token distributions: tokens on both sides of eta = 0.5
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    run([sys.executable, "-m", "openrlhf_lopti", "data", "kk", "--out", str(data), "--people", "2", "3",
         "--train-per-n", "8", "--test-per-n", "2"])  # fmt: skip
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    env = {"CPU": "1", "MODEL": str(model_dir), "DATA_DIR": str(data), "SAVE_DIR": str(save), "REWARD_FILE": str(reward)}
    _, argv = script_launch(SCRIPT, tmp_path / "script", *SHRINK, env=env)

    main(argv)
    out = capfd.readouterr().out
    assert "fused policy loss: --actor.fused_loss auto -> cpp" in out
    run_dir = save / "kk_grpo_ar_lopti"
    ckpt = run_dir / "ckpt" / "_actor"
    assert {"global_step2", "global_step4", "best_global_step2"} <= {p.name for p in ckpt.iterdir()}
    trained = AutoModelForCausalLM.from_pretrained(run_dir).state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # training moved the weights
    # every rollout engine holds the trained weights: upstream's broadcast_to_vllm reached it after each step
    for engine in driver:
        synced = ray.get(engine.__ray_call__.remote(lambda self: self.model.state_dict()))
        for name, value in trained.items():
            assert torch.equal(synced[name], value), name

    logs = run_dir / "tensorboard" / "kk_grpo_ar_lopti"
    lrs = scalars(logs, "train/actor_lr")
    assert sorted(lrs) == [1, 2, 3, 4] and len(set(lrs.values())) == 4  # warm-up, then cosine: every step moves
    for tag in ("train/lopti/low_token_frac", "train/ar/mean_weight", "train/kl", "train/lopti/high/policy_loss"):
        assert sorted(scalars(logs, tag)) == [1, 2, 3, 4], tag
    assert sorted(scalars(logs, "eval/eval_score")) == [2, 4]

    ray.shutdown()
    main(argv + ["--ckpt.load_enable", "--train.num_episodes", "2"])  # resume: episode 2 from the step-4 state
    assert sorted(scalars(logs, "train/actor_lr")) == [1, 2, 3, 4, 5, 6, 7, 8]  # no step redone
    assert {"global_step6", "global_step8"} <= {p.name for p in ckpt.iterdir()}
    AutoModelForCausalLM.from_pretrained(run_dir)
