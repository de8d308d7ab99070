"""``openrlhf_lopti.trl.reward_check`` in TRL 1.16's real trainer: a NaN or inf a reward function returns fails the
generation in one line naming the function; a ``None`` (TRL's "not applicable") still trains, as in TRL.

(Before: a NaN reward trained with a loss of 0, an inf one with NaN advantages, without a word.)
"""

import math

import pytest

pytest.importorskip("trl")

from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer  # noqa: E402

from .test_trl_trainer import distinct_words, kk_dataset, settings, tiny_model, tok  # noqa: E402, F401 (tok: a fixture)


def one_bad(value):
    def bad_reward(completions, **kwargs):
        return [value if i == 2 else 1.0 for i in range(len(completions))]

    return bad_reward


def run(tmp_path, tok, reward_funcs):
    cfg = LoptiGRPOConfig(**settings(tmp_path, gradient_accumulation_steps=1, steps_per_generation=1, lopti_eta=0.5,
                                     max_steps=2))  # fmt: skip
    trainer = LoptiGRPOTrainer(model=tiny_model(tok), reward_funcs=reward_funcs, args=cfg,
                               train_dataset=kk_dataset(), processing_class=tok)  # fmt: skip
    trainer.train()
    return trainer


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_reward_that_is_not_finite_is_refused_naming_its_function(tmp_path, tok, value):
    with pytest.raises(ValueError) as info:
        run(tmp_path, tok, [distinct_words, one_bad(value)])
    message = str(info.value)
    assert "'bad_reward'" in message and f"returned {value}" in message and "completion 2" in message
    assert "\n" not in message


def test_none_is_trls_not_applicable_and_trains(tmp_path, tok):
    def partial_reward(completions, **kwargs):
        return [None if i == 2 else 0.5 for i in range(len(completions))]

    trainer = run(tmp_path, tok, [distinct_words, partial_reward])
    assert trainer.state.global_step == 2
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
