"""End to end: ``examples/scripts/train_kk_grpo_ar_lopti.sh`` with ``CPU=1`` runs OpenRLHF's own ``train(args)``.

The script's exact command line (captured from the script, plus the shrink flags a laptop needs) runs in this
process as the Ray driver: a local Ray with logical GPUs, 2 data-parallel policy ranks under ZeRO-2 with
AR + Lopti and the fused loss on the C++ kernel, 2 reference ranks, 2 vLLM engines (vLLM's CPU backend, through
upstream's ``create_vllm_engines``) colocated with them (the script's ``--train.colocate_all``), KL as a loss, a
cosine LR schedule, K&K rewards, eval and checkpoints; then the same command resumes from its checkpoint with
``--ckpt.load_enable``. The controller is upstream's with one addition (:func:`checked_sync_controller`): after
every weight sync it reads every policy rank's parameters and every engine's (vLLM's own, through
``collective_rpc``) and records whether they are equal bit for bit (fp32).

The resume also turns on ``--algo.advantage.is_correction_level`` (TIS), so AR + Lopti run on vLLM's real rollout
log-probs through upstream's ``PolicyLoss``: upstream logs ``vllm_kl``, the mean of vLLM's sampled log-probs minus
the trainer's recomputed log-probs of the same tokens, which is bounded here (fp32 on both sides). TIS had a launch
of its own until CI time ran short (TESTING.md, "The suite's time budget"): a ``--cpu`` launch is about two minutes
of start-up.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openrlhf_lopti.openrlhf.cpu.runtime import WORKER_NICENESS_ENV
from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

from .run_logs import failure_report
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
    assert result.returncode == 0, failure_report(("stderr", result.stderr), ("stdout", result.stdout))


def scalars(logdir: Path, tag: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def checked_sync_controller(log_path: Path):
    """``LoptiPPOTrainer`` (upstream's controller) whose ``broadcast_to_vllm`` then compares, for every vLLM engine,
    vLLM's parameters (``collective_rpc("model_weights")``) with the policy rank 0's, and appends one JSON line
    to ``log_path``. Defined in a function so Ray pickles it by value (the tests package is not importable there)."""
    import json

    import ray

    from openrlhf_lopti.openrlhf.evaluation import LoptiPPOTrainer

    def policy_weights(actor):
        return {name: p.detach().clone() for name, p in actor.actor.model.module.named_parameters()}

    def in_vllm_names(hf: dict) -> dict:
        """A Llama's Hugging Face parameters under vLLM's names: q/k/v and gate/up fused, lm_head tied."""
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

    class CheckedSyncTrainer(LoptiPPOTrainer.__ray_actor_class__):
        def broadcast_to_vllm(self):
            super().broadcast_to_vllm()
            ranks = ray.get([rank.__ray_call__.remote(policy_weights) for rank in self.actor_model_group._actor_handlers])
            expected = in_vllm_names(ranks[0])
            with open(log_path.with_name("ranks.jsonl"), "a") as log:  # data-parallel ranks differing from rank 0
                log.write(json.dumps([[n for n in ranks[0] if not torch.equal(r[n], ranks[0][n])] for r in ranks[1:]]) + "\n")
            for engine in self.vllm_engines:
                (weights,) = ray.get(engine.collective_rpc.remote("model_weights"))
                record = {
                    "names_equal": sorted(weights) == sorted(expected),
                    "dtypes": sorted({str(w.dtype) for w in weights.values()}),
                    "unequal": [n for n in expected if n not in weights or not torch.equal(weights[n], expected[n])],
                }
                with open(log_path, "a") as log:
                    log.write(json.dumps(record) + "\n")

    return ray.remote(CheckedSyncTrainer)


@pytest.fixture
def driver(monkeypatch, tmp_path):
    """This process as the Ray driver of a ``--cpu`` run whose controller checks every weight sync (the path of
    its log is yielded); what launching rebinds or sets is restored after."""
    install_cpu_stubs()
    import openrlhf.cli.train_ppo_ray as upstream
    import openrlhf.trainer.ppo_trainer as controller
    import ray

    import openrlhf_lopti.openrlhf.evaluation as evaluation

    for module, name in ((upstream, "get_strategy"), (upstream, "create_vllm_engines"),
                         (upstream, "PolicyModelActor"), (upstream, "ReferenceModelActor"),
                         (controller, "PPOTrainer")):  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # A hang guard, not what these tests time: the sync group's rendezvous waits for vLLM engines that start in
    # niced Ray workers, and beside two busy processes that took more than the 60 s default ("1/3 clients joined"
    # after 61 s); 10x that. The error-at-sync test bounds its own time (SYNC_ERROR_BOUND_S).
    monkeypatch.setenv("OPENRLHF_LOPTI_CPU_SYNC_TIMEOUT", "600")
    # Unset, as a user's shell leaves it: the launch sets Ray's worker niceness itself; undone after the test, so
    # that no later test's Ray inherits it from this process.
    monkeypatch.setenv(WORKER_NICENESS_ENV, "")
    monkeypatch.delenv(WORKER_NICENESS_ENV)
    log = tmp_path / "syncs.jsonl"
    monkeypatch.setattr(evaluation, "LoptiPPOTrainer", checked_sync_controller(log))
    yield log
    ray.shutdown()


def sync_records(log: Path) -> list:
    import json

    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def tiny_kk(tmp_path: Path, train_per_n: int) -> dict:
    """A tiny model (head size 32, peaky), K&K data and the reward file: the script's environment."""
    from openrlhf_lopti.demo.tiny_model import build_tiny_model

    model_dir, data = tmp_path / "tiny", tmp_path / "kk"
    model, tokenizer = build_tiny_model(vocab_size=512, max_positions=512)
    with torch.no_grad():
        model.model.norm.weight.mul_(8)  # peaky next-token distributions: tokens on both sides of eta = 0.5
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    run([sys.executable, "-m", "openrlhf_lopti", "data", "kk", "--out", str(data), "--people", "2", "3",
         "--train-per-n", str(train_per_n), "--test-per-n", "2"])  # fmt: skip
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return {"CPU": "1", "MODEL": str(model_dir), "DATA_DIR": str(data), "SAVE_DIR": str(tmp_path / "save"),
            "REWARD_FILE": str(reward)}  # fmt: skip


# Upstream's TIS (its --algo.advantage.is_correction_* help): the token ratio clipped. seq-mask-TIS and ICEPOP ran
# here too until CI time ran short: on these fp32 runs every ratio is within 1e-3 of 1 (the first token's excess,
# below), so they masked nothing and took TIS's path to upstream's PolicyLoss. Lopti's sequence gate is tested where ratios can leave the band: planted on
# upstream's own experiences and PolicyLoss in test_openrlhf_trainer.py
# (test_lopti_keeps_upstreams_sequence_gate_on_the_whole_response).
TIS = ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip"]
# |mean(vLLM's sampled log-prob - the trainer's recomputed one)| per step, fp32 on both sides. Not 0 after weights
# that moved: upstream's min_tokens=1 has vLLM report the first response token's log-prob with the stop tokens
# blocked, larger than the trainer's by -log(1 - p_EOS) (docs/TESTS.md); every other token agrees to about 6e-8.
# Measured on the resume's steps 5-8: 4e-6 to 7e-6 (2e-5 at most in docs/TESTS.md's runs); 1e-4 leaves that excess
# 14x room, while a log-prob of another token or position is off by O(1) nats per token.
VLLM_KL_BOUND = 1e-4


def test_kk_script_trains_on_cpu_syncs_the_vllm_weights_and_resumes_under_tis(driver, tmp_path, capfd):
    import ray
    from transformers import AutoModelForCausalLM

    from openrlhf_lopti.cli.train_ppo_ray import main

    env = tiny_kk(tmp_path, train_per_n=8)
    save = Path(env["SAVE_DIR"])
    initial = AutoModelForCausalLM.from_pretrained(env["MODEL"]).state_dict()
    _, argv = script_launch(SCRIPT, tmp_path / "script", *SHRINK, env=env)

    main(argv)
    out = capfd.readouterr().out
    assert "fused policy loss: --actor.fused_loss auto -> cpp" in out
    run_dir = save / "kk_grpo_ar_lopti"
    ckpt = run_dir / "ckpt" / "_actor"
    assert {"global_step2", "global_step4", "best_global_step2"} <= {p.name for p in ckpt.iterdir()}
    trained = AutoModelForCausalLM.from_pretrained(run_dir).state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # training moved the weights
    # after each of the 4 steps' weight syncs, both vLLM engines held exactly the policy's fp32 weights
    records = sync_records(driver)
    assert len(records) == 4 * 2, records
    assert driver.with_name("ranks.jsonl").read_text().split() == ["[[]]"] * 4  # the 2 policy ranks stayed equal
    for record in records:
        assert record == {"names_equal": True, "dtypes": ["torch.float32"], "unequal": []}

    logs = run_dir / "tensorboard" / "kk_grpo_ar_lopti"
    lrs = scalars(logs, "train/actor_lr")
    assert sorted(lrs) == [1, 2, 3, 4] and len(set(lrs.values())) == 4  # warm-up, then cosine: every step moves
    for tag in ("train/lopti/low_token_frac", "train/ar/mean_weight", "train/kl", "train/lopti/high/policy_loss"):
        assert sorted(scalars(logs, tag)) == [1, 2, 3, 4], tag
    assert sorted(scalars(logs, "eval/eval_score")) == [2, 4]

    ray.shutdown()
    # resume: episode 2 from the step-4 state, with TIS on (upstream's PolicyLoss on vLLM's rollout log-probs)
    main(argv + ["--ckpt.load_enable", "--train.num_episodes", "2"] + TIS)
    assert "using upstream's PolicyLoss because of --algo.advantage.is_correction_level" in capfd.readouterr().out
    assert sorted(scalars(logs, "train/actor_lr")) == [1, 2, 3, 4, 5, 6, 7, 8]  # no step redone
    vllm_kl, filtered = scalars(logs, "train/vllm_kl"), scalars(logs, "train/is_filter_ratio")
    print(f"TIS: vllm_kl per step {vllm_kl}, is_filter_ratio {filtered}")
    assert sorted(vllm_kl) == [5, 6, 7, 8] and sorted(filtered) == [5, 6, 7, 8], (vllm_kl, filtered)
    assert all(abs(value) < VLLM_KL_BOUND for value in vllm_kl.values()), vllm_kl
    assert all(value == 0 for value in filtered.values()), filtered  # no token out of TIS's band
    for tag in ("train/lopti/low_token_frac", "train/ar/mean_weight", "train/lopti/high/policy_loss"):
        assert sorted(scalars(logs, tag)) == [1, 2, 3, 4, 5, 6, 7, 8], tag
    # resuming syncs the loaded weights first (upstream's fit), then after each of steps 5-8
    records = sync_records(driver)
    assert len(records) == (4 + 1 + 4) * 2 and all(r["names_equal"] and not r["unequal"] for r in records)
    assert driver.with_name("ranks.jsonl").read_text().split() == ["[[]]"] * (4 + 1 + 4)
    assert {"global_step6", "global_step8"} <= {p.name for p in ckpt.iterdir()}
    AutoModelForCausalLM.from_pretrained(run_dir)


def timed_sync_controller(mark: Path):
    """``LoptiPPOTrainer`` whose ``broadcast_to_vllm`` first writes the time it began to ``mark`` (once)."""
    import time

    from openrlhf_lopti.openrlhf.evaluation import LoptiPPOTrainer

    class TimedSyncTrainer(LoptiPPOTrainer.__ray_actor_class__):
        def broadcast_to_vllm(self):
            if not mark.exists():
                mark.write_text(repr(time.time()))
            super().broadcast_to_vllm()

    import ray

    return ray.remote(TimedSyncTrainer)


# How long after the first weight sync began the run must have ended with the planted error (measured: about 5 s).
SYNC_ERROR_BOUND_S = 60


def test_an_error_at_the_weight_sync_ends_the_run_with_its_line_not_a_hang(driver, tmp_path, monkeypatch):
    """The engines are made to run bf16 under ``--ds.param_dtype fp32`` (the policy sends fp32): the vLLM worker
    refuses the first weight and the run must end with that line within SYNC_ERROR_BOUND_S of the sync's start.
    Before, the worker raised before entering the broadcast, the policy's rank 0 waited in it for gloo's 30 minutes
    and the run with it. A watchdog interrupts the run (and fails the test) if it outlives the bound by a minute."""
    import _thread
    import threading
    import time

    import openrlhf_lopti.openrlhf.cpu.engine as engine
    import openrlhf_lopti.openrlhf.evaluation as evaluation
    from openrlhf_lopti.cli.train_ppo_ray import main

    mark = tmp_path / "sync_began"
    monkeypatch.setattr(evaluation, "LoptiPPOTrainer", timed_sync_controller(mark))
    monkeypatch.setattr(engine, "engine_dtype", lambda param_dtype: "bfloat16")  # the planted mismatch
    env = tiny_kk(tmp_path, train_per_n=2)  # 4 prompts: one step, then the first sync
    # one policy rank and one vLLM engine; no KL, so upstream starts no reference model (one process fewer: CI time)
    one_each = ["--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--algo.kl.init_coef", "0"]
    flags = SHRINK + one_each + ["--train.batch_size", "16", "--eval.steps", "-1", "--ckpt.save_steps", "-1",
                                 "--rollout.max_new_tokens", "8"]  # fmt: skip
    _, argv = script_launch(SCRIPT, tmp_path / "script", *flags, env=env)

    done = threading.Event()

    def watchdog():
        while not done.wait(1):
            if mark.exists() and time.time() - float(mark.read_text()) > SYNC_ERROR_BOUND_S + 60:
                _thread.interrupt_main()
                return

    threading.Thread(target=watchdog, daemon=True).start()
    error, interrupted = None, False
    try:
        main(argv)
    except KeyboardInterrupt:
        interrupted = True
    except Exception as exc:  # noqa: BLE001 - the run's error is what the test checks
        error = exc
    finally:
        ended = time.time()
        done.set()
    if interrupted:
        pytest.fail(f"the run still waited {SYNC_ERROR_BOUND_S + 60} s after its first weight sync began")
    assert error is not None, "the run succeeded with the engines in bf16 and the policy in fp32"
    message = str(error)
    assert mark.exists(), f"the run ended before its first weight sync:\n{failure_report(message)}"
    seconds = ended - float(mark.read_text())
    print(f"the run ended {seconds:.2f} s after the first weight sync began: {type(error).__name__}")
    line = "--cpu weight sync: the policy sent model.embed_tokens.weight in torch.float32, the engine runs torch.bfloat16"
    assert line in message, failure_report(message)
    assert seconds < SYNC_ERROR_BOUND_S
