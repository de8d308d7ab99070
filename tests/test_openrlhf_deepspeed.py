"""``LoptiActorPPOTrainer`` on the real DeepSpeed engine (CPU accelerator, gloo), as ``--cpu`` runs it.

Pins the per-step state that Lopti's two upstream ``ppo_train`` calls per RL step must keep right: the LR
schedule, the rollout-KL metric, DeepSpeed's gradient-accumulation windows, one quantile threshold across
data-parallel ranks, and a kernel error on one rank failing every rank promptly; and that ZeRO-3 trains as
ZeRO-2 does. Each rank is a process running upstream's ``PolicyModelActor`` code (see ``tests/ds_ranks.py``).
"""

import pytest
import torch

from openrlhf_lopti.algo.lopti import quantile_threshold

from .ds_ranks import base_argv, make_tiny_model, run_ranks, synthetic_experience

VOCAB = 300
# 10 samples per RL step, micro-batches of 1, train.batch_size 4: gas 4, so windows of 4, 4 and 2 micro-batches
# (3 optimizer steps per pass); 2 RL steps, 6 scheduler steps: warm-up then cosine, every step's lr differs.
# KL in the reward (k1, not a loss): the rollout KL metric.
SAMPLES, STEPS = 10, 2
COMMON = ("--rollout.batch_size", "5", "--algo.ar.alpha", "0.3", "--algo.kl.init_coef", "0.01", "--algo.kl.estimator", "k1")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def assert_same_update(a: dict, b: dict, initial: list) -> None:
    """Two runs (their ``steps`` entries) had the same gradients (the global norm DeepSpeed computes before each
    phase's last optimizer step: Adam's first steps hide gradient magnitudes from the parameters) and moved every
    parameter (its sum) the same way, to 1e-4 of how far it moved."""
    for key in ("lopti/low/actor_grad_norm", "lopti/high/actor_grad_norm", "actor_grad_norm"):
        if key in a["status"]:
            assert a["status"][key] == pytest.approx(b["status"][key], rel=1e-4), key
    moved = torch.tensor(a["params"], dtype=torch.float64) - torch.tensor(initial, dtype=torch.float64)
    assert moved.abs().max() > 1e-6  # it trained
    diff = torch.tensor(a["params"], dtype=torch.float64) - torch.tensor(b["params"], dtype=torch.float64)
    assert (diff.abs() <= 1e-4 * moved.abs().max() + 1e-9).all(), diff.abs().max()


def ok(results: list) -> list:
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
    return results


def config(model, *flags, steps=STEPS, samples=SAMPLES, max_steps=6, kl_in_reward=True, **extra):
    return {
        "argv": base_argv(model, *flags), "model": str(model), "max_steps": max_steps, "steps": steps,
        "samples": samples, "vocab": VOCAB, "kl_in_reward": kl_in_reward, **extra,
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """One rank each: AR only, and AR + Lopti (both phases have tokens: probabilities spread over (0, 1))."""
    tmp = tmp_path_factory.mktemp("runs")
    return {
        "ar": ok(run_ranks(tmp, 1, config(model, *COMMON)))[0],
        "ar+lopti": ok(run_ranks(tmp, 1, config(model, *COMMON, "--algo.lopti.eta", "0.5")))[0],
    }


def test_lopti_moves_the_lr_schedule_exactly_as_one_upstream_pass(runs):
    off_lrs = [step["status"]["actor_lr"] for step in runs["ar"]["steps"]]
    assert len(set(off_lrs)) == STEPS  # the schedule moves
    assert [step["status"]["actor_lr"] for step in runs["ar+lopti"]["steps"]] == off_lrs
    assert [step["lr"] for step in runs["ar+lopti"]["steps"]] == [step["lr"] for step in runs["ar"]["steps"]]
    assert {step["phase"] for step in runs["ar+lopti"]["engine_steps"]} == {"low", "high"}  # both phases ran


def test_rollout_kl_metric_is_not_summed_over_phases(runs):
    # the mean over samples of each response's mean rollout KL, as the synthetic experience defines it
    expected = synthetic_experience(0, 0, SAMPLES, VOCAB, True).info["kl"].mean().item()
    assert runs["ar"]["steps"][0]["status"]["kl"] == pytest.approx(expected, rel=1e-5)
    assert runs["ar+lopti"]["steps"][0]["status"]["kl"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("method", ["ar", "ar+lopti"])
def test_each_pass_ends_on_an_optimizer_step(method, runs):
    # the last, short window must not run into the next phase or the next step
    calls = runs[method]["engine_steps"]
    passes = STEPS * (2 if method == "ar+lopti" else 1)
    assert len(calls) == SAMPLES * passes
    for i in range(passes):
        window = calls[SAMPLES * i : SAMPLES * (i + 1)]
        assert [c["boundary"] for c in window] == [False, False, False, True] * 2 + [False, True], i
        assert len({c["phase"] for c in window}) == 1
    per_step = 3 * passes // STEPS
    assert [step["optimizer_steps"] for step in runs[method]["steps"]] == [per_step, 2 * per_step]


def test_kl_loss_share_is_summed_over_phases(model, tmp_path):
    flags = ("--algo.kl.use_loss", "--algo.kl.init_coef", "0.01", "--algo.kl.estimator", "k3", "--algo.lopti.eta", "0.5")
    lopti = ok(run_ranks(tmp_path, 1, config(model, *flags, steps=1, samples=8, kl_in_reward=False)))[0]
    status = lopti["steps"][0]["status"]
    assert status["kl"] == pytest.approx(status["lopti/low/kl"] + status["lopti/high/kl"], rel=1e-6)


def test_quantile_threshold_is_one_for_all_data_parallel_ranks_under_zero3(model, tmp_path):
    flags = ("--algo.lopti.quantile", "0.5", "--train.batch_size", "8")
    cfg = config(model, *flags, steps=1, samples=8, low_p_per_rank=[0.9, 0.1], kl_in_reward=False)
    cfg["argv"] += ["--algo.track_direction"]
    zero2 = ok(run_ranks(tmp_path, 2, cfg))
    zero3 = ok(run_ranks(tmp_path, 2, {**cfg, "argv": cfg["argv"] + ["--ds.zero_stage", "3"]}))
    thresholds = [r["steps"][0]["threshold"] for r in zero2]
    probs = []
    for rank, low_p in enumerate([0.9, 0.1]):
        experience = synthetic_experience(rank, 0, 8, VOCAB, False, low_p)
        probs.append(experience.action_log_probs.exp()[experience.action_mask])
    expected = quantile_threshold(torch.cat(probs), 0.5)
    assert thresholds == [pytest.approx(expected, rel=1e-6)] * 2
    # --algo.track_direction: every rank logs the direction counts summed over both ranks' tokens
    for result in zero2 + zero3:
        status = result["steps"][0]["status"]
        counted = sum(value for key, value in status.items() if key.startswith("direction/tokens_"))
        assert counted == sum(len(p) for p in probs)
    # ZeRO-3 (parameters partitioned over the two ranks) trains the same parameters as ZeRO-2
    for a, b in zip(zero2, zero3):
        assert_same_update(b["steps"][0], a["steps"][0], b["initial_params"])


def test_track_direction_runs_as_many_forwards_on_every_rank_as_training_under_zero3(model, tmp_path):
    """Ranks holding 8 and 6 samples, micro-batches of 3: each trains 2 micro-batches a pass (upstream's loader drops
    the remainder). Before, the direction pass ran ceil(8 / 3) = 3 forwards on rank 0 and 2 on rank 1; under ZeRO-3
    each forward gathers the parameters, so rank 0 waited in its third forward while rank 1 was in the counts'
    all-reduce. Now it runs the trained micro-batches, and counts their tokens on both ranks. This tiny model's
    parameters are all below ZeRO-3's persistence threshold, so its forwards gather nothing and the test shows the
    count (before: 73 tokens, the remainder's included), not the hang, which is read from DeepSpeed's code."""
    flags = ("--algo.lopti.eta", "0.5", "--ds.zero_stage", "3", "--train.micro_batch_size", "3",
             "--train.batch_size", "6", "--algo.track_direction")  # fmt: skip
    cfg = config(model, *flags, steps=1, samples=8, samples_per_rank=[8, 6], kl_in_reward=False)
    results = ok(run_ranks(tmp_path, 2, cfg))
    trained = sum(
        int(synthetic_experience(rank, 0, samples, VOCAB, False).action_mask[:6].sum())
        for rank, samples in enumerate([8, 6])
    )  # fmt: skip
    for result in results:
        status = result["steps"][0]["status"]
        assert sum(value for key, value in status.items() if key.startswith("direction/tokens_")) == trained


def test_zero3_gathers_on_gloo_never_read_a_parameter_before_it_arrives(model, tmp_path):
    """The ``--cpu`` strategy's DeepSpeed config on two gloo ranks: 2000 blocking gathers of every parameter, each
    read at once (``ds_ranks.stale_gathers``). DeepSpeed 0.19.6 waits for the last of its per-parameter collectives
    only, and gloo finishes them in any order: with upstream's config about 7% of these gathers read a parameter
    before its values arrived (135 of 2000 here, idle), which is how a ZeRO-3 ``--cpu`` run could compute with
    uninitialized memory after an optimizer step. The strategy makes the gathers sequential."""
    results = ok(run_ranks(tmp_path, 2, config(model, "--ds.zero_stage", "3", steps=0, gather_trials=2000)))
    assert [result["stale_gathers"] for result in results] == [0, 0]


def test_round_counts_are_summed_over_data_parallel_ranks_only(model, tmp_path):
    """Two ranks holding the same experience, one data-parallel replica (a mesh of dp 1 x sp 2, as ring attention
    makes it; see ``ds_ranks.declare_mesh``): the round's token counts and the direction counts are the replica's,
    not twice them (a sum over every rank counts each token once per rank of the sp group)."""
    flags = ("--algo.ar.alpha", "0.3", "--algo.lopti.eta", "0.5", "--train.batch_size", "8", "--algo.track_direction")
    cfg = config(model, *flags, steps=1, samples=8, kl_in_reward=False, mesh=[1, 2, 1], data_rank_per_rank=[0, 0])
    results = ok(run_ranks(tmp_path, 2, cfg))
    experience = synthetic_experience(0, 0, 8, VOCAB, False)
    p, response = experience.action_log_probs.exp(), experience.action_mask
    low = int((response & (p < 0.5)).sum())
    assert 0 < low < int(response.sum())
    for result in results:
        status = result["steps"][0]["status"]
        assert status["lopti/low/tokens"] == low and status["lopti/high/tokens"] == int(response.sum()) - low
        assert status["lopti/low_token_frac"] == pytest.approx(low / int(response.sum()))
        counted = sum(value for key, value in status.items() if key.startswith("direction/tokens_"))
        assert counted == int(response.sum())
    assert results[0]["steps"][0]["params"] == results[1]["steps"][0]["params"]  # one replica: the same update


@pytest.mark.parametrize("poison", ["advantage", "logits"])
def test_a_kernel_error_on_one_rank_fails_every_rank_promptly(poison, model, tmp_path):
    cfg = config(model, "--algo.ar.alpha", "0.3", "--algo.lopti.eta", "0.5", "--train.batch_size", "8",
                 samples=8, kl_in_reward=False)  # fmt: skip
    cfg.update(poison=[1, 1], poison_logits=poison == "logits", linger_s=120)
    results = run_ranks(tmp_path, 2, cfg)  # a hang is gloo's 30 minutes: the default bound (600 s) tells it apart
    expected = "advantages must be finite" if poison == "advantage" else "has no finite log-sum-exp"
    for result in results:
        assert result["error"] != "timeout", "a rank hung in a collective"
        assert expected in result["error"], result["error"]
        assert "RL step 2" in result["error"] and "micro-batch" in result["error"] and "rank 1" in result["error"]
        assert len(result["steps"]) == 1  # the first step trained on both ranks


def test_fused_lm_head_under_zero3_trains_like_the_logits_kernel(model, tmp_path):
    """The output layer's weight (tied to the input embedding in this model) is partitioned under ZeRO-3: the
    fused lm_head must see it gathered in the forward and the backward, and its gradient must reach it."""
    flags = ("--algo.ar.alpha", "0.3", "--algo.lopti.eta", "0.5", "--ds.zero_stage", "3", "--actor.entropy_coef", "0.1")
    cfg = config(model, *flags, steps=1, samples=8, kl_in_reward=False)
    logits = ok(run_ranks(tmp_path, 1, cfg))[0]
    lm_head = ok(run_ranks(tmp_path, 1, {**cfg, "argv": cfg["argv"] + ["--actor.fused_lm_head"]}))[0]
    assert_same_update(lm_head["steps"][0], logits["steps"][0], lm_head["initial_params"])
    for key in ("policy_loss", "entropy_loss", "lopti/high/policy_loss"):
        assert lm_head["steps"][0]["status"][key] == pytest.approx(logits["steps"][0]["status"][key], rel=1e-4)
