"""``LoptiActorPPOTrainer`` on the real DeepSpeed engine (CPU accelerator, gloo), as ``--cpu`` runs it.

Pins the per-step state that Lopti's two upstream ``ppo_train`` calls per RL step must keep right: the LR
schedule, the rollout-KL metric, DeepSpeed's gradient-accumulation windows, one quantile threshold across
data-parallel ranks, and a kernel error on one rank failing every rank promptly. Each rank is a process
running upstream's ``PolicyModelActor`` code (see ``tests/ds_ranks.py``).
"""

import pytest
import torch

from openrlhf_lopti.algo.lopti import quantile_threshold

from .ds_ranks import base_argv, make_tiny_model, run_ranks, synthetic_experience

VOCAB = 300


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def ok(results: list) -> list:
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
    return results


def config(model, *flags, steps=3, samples=8, max_steps=6, kl_in_reward=False, **extra):
    return {
        "argv": base_argv(model, *flags), "model": str(model), "max_steps": max_steps, "steps": steps,
        "samples": samples, "vocab": VOCAB, "kl_in_reward": kl_in_reward, **extra,
    }  # fmt: skip


def test_lopti_moves_the_lr_schedule_exactly_as_one_upstream_pass(model, tmp_path):
    # 8 samples, train.batch_size 4, micro-batch 1: 2 optimizer steps per pass; 6 scheduler steps in all,
    # warm-up then cosine: every step's lr differs.
    off = ok(run_ranks(tmp_path, 1, config(model, "--algo.ar_alpha", "0.3")))[0]
    lopti = ok(run_ranks(tmp_path, 1, config(model, "--algo.ar_alpha", "0.3", "--algo.lopti_eta", "0.5")))[0]
    off_lrs = [step["status"]["actor_lr"] for step in off["steps"]]
    assert len(set(off_lrs)) == 3  # the schedule moves
    assert [step["status"]["actor_lr"] for step in lopti["steps"]] == off_lrs
    assert [step["lr"] for step in lopti["steps"]] == [step["lr"] for step in off["steps"]]
    phases = {step["phase"] for step in lopti["engine_steps"]}
    assert phases == {"low", "high"}  # both phases ran, each with its optimizer steps


def test_rollout_kl_metric_is_not_summed_over_phases(model, tmp_path):
    flags = ("--algo.kl.init_coef", "0.01", "--algo.kl.estimator", "k1")  # KL in the reward, not a loss
    off = ok(run_ranks(tmp_path, 1, config(model, *flags, steps=1, kl_in_reward=True)))[0]
    lopti = ok(run_ranks(tmp_path, 1, config(model, *flags, "--algo.lopti_eta", "0.5", steps=1, kl_in_reward=True)))[0]
    # the mean over samples of each response's mean rollout KL, as the synthetic experience defines it
    expected = synthetic_experience(0, 0, 8, VOCAB, True).info["kl"].mean().item()
    assert off["steps"][0]["status"]["kl"] == pytest.approx(expected, rel=1e-5)
    assert lopti["steps"][0]["status"]["kl"] == pytest.approx(expected, rel=1e-5)


def test_kl_loss_share_is_summed_over_phases(model, tmp_path):
    flags = ("--algo.kl.use_loss", "--algo.kl.init_coef", "0.01", "--algo.kl.estimator", "k3")
    lopti = ok(run_ranks(tmp_path, 1, config(model, *flags, "--algo.lopti_eta", "0.5", steps=1)))[0]
    status = lopti["steps"][0]["status"]
    assert status["kl"] == pytest.approx(status["lopti/low/kl"] + status["lopti/high/kl"], rel=1e-6)


@pytest.mark.parametrize("lopti", [False, True])
def test_each_pass_ends_on_an_optimizer_step(lopti, model, tmp_path):
    # 10 samples per step with gas 4: windows of 4, 4 and 2 micro-batches; the last must not run into the
    # next phase or the next step.
    flags = ("--algo.ar_alpha", "0.3") + (("--algo.lopti_eta", "0.5") if lopti else ())
    result = ok(run_ranks(tmp_path, 1, config(model, *flags, "--rollout.batch_size", "5", steps=2, samples=10)))[0]
    calls = result["engine_steps"]
    passes = 2 * (2 if lopti else 1)
    assert len(calls) == 10 * passes
    for i in range(passes):
        window = calls[10 * i : 10 * (i + 1)]
        assert [c["boundary"] for c in window] == [False, False, False, True] * 2 + [False, True], i
        assert len({c["phase"] for c in window}) == 1
    assert [step["optimizer_steps"] for step in result["steps"]] == [3 * passes // 2, 3 * passes]


def test_quantile_threshold_is_one_for_all_data_parallel_ranks(model, tmp_path):
    flags = ("--algo.lopti_eta", "0.5", "--algo.lopti_quantile", "0.5", "--train.batch_size", "8")
    results = ok(run_ranks(tmp_path, 2, config(model, *flags, steps=1, low_p_per_rank=[0.9, 0.1])))
    thresholds = [r["steps"][0]["threshold"] for r in results]
    probs = []
    for rank, low_p in enumerate([0.9, 0.1]):
        experience = synthetic_experience(rank, 0, 8, VOCAB, False, low_p)
        probs.append(experience.action_log_probs.exp()[experience.action_mask])
    expected = quantile_threshold(torch.cat(probs), 0.5)
    assert thresholds == [pytest.approx(expected, rel=1e-6)] * 2


def test_a_kernel_error_on_one_rank_fails_every_rank_promptly(model, tmp_path):
    cfg = config(model, "--algo.ar_alpha", "0.3", "--algo.lopti_eta", "0.5", "--train.batch_size", "8", steps=2)
    cfg.update(poison=[1, 1], linger_s=120)
    results = run_ranks(tmp_path, 2, cfg, timeout=100)
    for result in results:
        assert result["error"] != "timeout", "a rank hung in a collective"
        assert "advantages must be finite" in result["error"]
        assert "RL step 2" in result["error"] and "micro-batch" in result["error"] and "rank 1" in result["error"]
        assert len(result["steps"]) == 1  # the first step trained on both ranks
