"""``eval_metrics_with_scores``: upstream's eval metrics plus the reward file's scores, against hand-made samples."""

import pytest
import torch

from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

install_cpu_stubs()

from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

from openrlhf_lopti.openrlhf.evaluation import eval_metrics_with_scores  # noqa: E402


def sample(prompt: str, reward: float, score) -> Experience:
    return Experience(
        prompts=[prompt],
        rewards=torch.tensor([reward]),
        scores=None if score is None else torch.tensor([score]),
        response_length=torch.tensor([5]),
        truncated=torch.tensor([False]),
    )


def test_scores_per_datasource_and_over_all_samples():
    loader = [(["kk_3ppl", "kk_3ppl"], ["p1", "p2"], ["l1", "l2"], [None, None]), (["kk_5ppl"], ["p3"], ["l3"], [None])]
    # 2 samples per prompt; K&K rewards in [-3, 3], scores 1.0 exactly when the answer is right
    samples = [sample("p1", 3.0, 1.0), sample("p1", -0.5, 0.0), sample("p2", -3.0, 0.0), sample("p2", 3.0, 1.0)]
    samples += [sample("p3", 3.0, 1.0), sample("p3", 3.0, 1.0)]
    logs = eval_metrics_with_scores(loader, samples, 2)
    assert logs["eval_kk_3ppl_score"] == 0.5 and logs["eval_kk_5ppl_score"] == 1.0
    assert logs["eval_score"] == pytest.approx(4 / 6)  # over samples, not the mean of the per-size means
    assert logs["eval_kk_3ppl_pass1"] == pytest.approx((1.25 + 0.0) / 2)  # upstream's keys stay: mean reward
    assert logs["eval_kk_5ppl_pass2"] == 3.0


def test_no_scores_adds_nothing():
    loader = [(["math"], ["p"], ["l"], [None])]
    logs = eval_metrics_with_scores(loader, [sample("p", 1.0, None), sample("p", 0.0, None)], 2)
    assert not any(key.endswith("_score") for key in logs) and logs["eval_math_pass1"] == 0.5
