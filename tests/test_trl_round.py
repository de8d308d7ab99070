"""TRL's front end drives the one Lopti round with the semantics of the others (issue 32), on TRL 1.16's real trainer.

- a streaming (iterable) dataset trains every generation batch in both phases, as a map-style one does;
- the KL penalty with ``top_entropy_quantile`` is TRL's (the entropy mask is on the surrogate only);
- ``max_steps`` that would stop between the two phases of a round is refused;
- both phases of a round train at one learning rate: the LR schedule moves once per round;
- ``track_direction`` logs ``direction/*`` over the round's tokens;
- a run resumed from a checkpoint cut mid-round trains every later optimizer step on the phase, learning rate and
  batch of the uninterrupted run; a mid-round checkpoint without its round, or resumed under settings other than
  those its round was saved under, is refused in one line; the round is in the checkpoint before it is pushed;
- ``max_steps`` derived from ``num_train_epochs`` is whole rounds;
- a phase without tokens takes no optimizer step (tests/test_lopti_round_contract.py, with the other front ends;
  under DeepSpeed and FSDP2: tests/test_trl_processes.py);
- a micro-step without a token of a phase leaves the per-phase and token means it logs alone.
"""

import os

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset, IterableDataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer  # noqa: E402

from .test_trl_trainer import distinct_words, kk_dataset, recording, settings, tiny_model, tok, train  # noqa: E402, F401 (tok: a fixture)


def prompts_trained(recorded: list) -> list:
    """The prompt (as token ids) of each recorded micro-batch, in order."""
    return [tuple(r["prompt_ids"][0][r["prompt_mask"][0].bool()].tolist()) for r in recorded]


def test_a_streaming_dataset_trains_every_generation_batch_in_both_phases(tmp_path, tok):
    """One prompt per generation: 3 rounds train prompts 0, 1, 2, each twice (low, high), like a map-style dataset.
    (Before: the sampler alone was doubled, so a streaming dataset trained prompts 0, 2, 4.)"""
    rows = kk_dataset(8).to_list()
    runs = {}
    for kind in ("map", "stream"):
        data = Dataset.from_list(rows) if kind == "map" else IterableDataset.from_generator(lambda: iter(rows))
        cfg = LoptiGRPOConfig(**settings(tmp_path / kind, max_steps=6, gradient_accumulation_steps=1,
                                         steps_per_generation=1, lopti_eta=0.5, shuffle_dataset=False))  # fmt: skip
        _, _, recorded = train(LoptiGRPOTrainer, cfg, tok, dataset=data)
        assert [r["lopti_phase"] for r in recorded] == [0, 1] * 3, kind
        runs[kind] = prompts_trained(recorded)
    order = list(dict.fromkeys(runs["map"]))
    assert len(order) == 3 and runs["map"] == [p for p in order for _ in range(2)]
    assert runs["stream"] == runs["map"]


def test_kl_with_top_entropy_quantile_is_trls(tmp_path, tok):
    """Zero advantages (one constant reward): the loss is beta * KL over every token, TRL's; the entropy mask
    (top 20%) must not mask the KL term. (Before: the KL was folded into the masked loss, 10x too small.)"""
    cfg = LoptiGRPOConfig(**settings(tmp_path, beta=0.1, top_entropy_quantile=0.2, gradient_accumulation_steps=1,
                                     steps_per_generation=1))  # fmt: skip
    start = tmp_path / "tiny"  # a path: TRL loads the reference model (beta != 0) from it
    tiny_model(tok).save_pretrained(start)
    tok.save_pretrained(start)

    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = recording(LoptiGRPOTrainer)(model=str(start), reward_funcs=[constant], args=cfg,
                                          train_dataset=kk_dataset(), processing_class=tok)  # fmt: skip
    with torch.no_grad():  # a reference that differs from the policy: a KL worth penalising
        torch.manual_seed(0)
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.recorded = []
    trainer.train()
    inputs = trainer.recorded[0]
    assert float(inputs["advantages"].abs().max()) == 0.0
    with torch.no_grad():
        ours = trainer._compute_loss(trainer.model, dict(inputs))
        trls = GRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs))
    assert float(trls) > 0
    assert float(ours) == pytest.approx(float(trls), rel=1e-4)


def test_max_steps_that_cut_a_round_is_refused(tmp_path):
    with pytest.raises(ValueError) as info:  # a round: 2 phases x 2 micro-steps / 2 per optimizer step = 2 steps
        LoptiGRPOConfig(**settings(tmp_path, lopti_eta=0.5, max_steps=3))
    assert "max_steps=3" in str(info.value) and "multiple of 2" in str(info.value) and "\n" not in str(info.value)
    LoptiGRPOConfig(**settings(tmp_path, lopti_eta=0.5, max_steps=4))  # whole rounds: accepted
    LoptiGRPOConfig(**settings(tmp_path, max_steps=3))  # no Lopti: no rounds to cut


class LearningRates(LoptiGRPOTrainer):
    def _compute_loss(self, model, inputs):
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        return super()._compute_loss(model, inputs)


def test_both_phases_of_a_round_train_at_one_learning_rate(tmp_path, tok):
    """Linear decay over 2 rounds of 2 phases (one optimizer step each): lr, lr | lr/2, lr/2. (Before: the schedule
    moved per phase, lr, 3/4 lr, lr/2, lr/4, and phase 2 trained at a later learning rate than phase 1.)"""
    cfg = LoptiGRPOConfig(**settings(tmp_path, max_steps=4, gradient_accumulation_steps=1, steps_per_generation=1,
                                     lopti_eta=0.5, lr_scheduler_type="linear"))  # fmt: skip
    trainer = LearningRates(model=tiny_model(tok), reward_funcs=[distinct_words], args=cfg,
                            train_dataset=kk_dataset(8), processing_class=tok)  # fmt: skip
    trainer.lrs = []
    trainer.train()
    lr = cfg.learning_rate
    assert trainer.lrs == pytest.approx([lr, lr, lr / 2, lr / 2])


def test_track_direction_logs_the_rounds_fig3_counts(tmp_path, tok):
    cfg = LoptiGRPOConfig(**settings(tmp_path, max_steps=2, gradient_accumulation_steps=1, steps_per_generation=1,
                                     lopti_eta=0.5, track_direction=True))  # fmt: skip
    _, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok)
    logged = {k: v for h in trainer.state.log_history for k, v in h.items() if k.startswith("direction/")}
    tokens = sum(logged[f"direction/tokens_q{q}"] for q in (1, 2, 3, 4))
    assert tokens == float(recorded[0]["completion_mask"].sum())  # every response token of the round, once
    assert any(k.startswith("direction/pos_up_q") for k in logged) or logged.get("direction/pos_tokens_q1") == 0


@pytest.mark.parametrize("options", [dict(loss_type="cispo"), dict(fused_loss=False)])
def test_track_direction_on_trls_loss_path_with_ar_and_lopti_off(tmp_path, tok, options):
    """TRL's loss path skips the anchor on-policy; track_direction reads it after the round (before: a KeyError at
    the end of the first step)."""
    cfg = LoptiGRPOConfig(**settings(tmp_path, max_steps=1, track_direction=True, **options))
    _, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok)
    assert trainer.loss_path == "trl"
    logged = {k: v for h in trainer.state.log_history for k, v in h.items() if k.startswith("direction/")}
    assert sum(logged[f"direction/tokens_q{q}"] for q in (1, 2, 3, 4)) > 0


class StepLog(LoptiGRPOTrainer):
    """Records, per micro-step, ``(optimizer step, phase, learning rate)`` and the micro-batch's completions; and the
    files of each checkpoint when TRL pushes it (``push_to_hub``)."""

    def _compute_loss(self, model, inputs):
        self.steps.append((self.state.global_step, inputs["lopti_phase"], self.optimizer.param_groups[0]["lr"]))
        self.completions.append(inputs["completion_ids"].clone())
        return super()._compute_loss(model, inputs)

    def _push_from_checkpoint(self, checkpoint_folder):  # TRL's pushes the folder's files to the Hub
        self.pushed[os.path.basename(checkpoint_folder)] = sorted(os.listdir(checkpoint_folder))


def step_log(cfg, tok, model):
    trainer = StepLog(model=model, reward_funcs=[distinct_words], args=cfg, train_dataset=kk_dataset(8),
                      processing_class=tok)  # fmt: skip
    trainer.steps, trainer.completions = [], []
    return trainer


def cut_settings(out, **changed) -> dict:
    return settings(out, **{**dict(max_steps=6, gradient_accumulation_steps=1, steps_per_generation=1, lopti_eta=0.5,
                                   lr_scheduler_type="linear", save_strategy="steps", save_steps=3), **changed})


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory, tok):
    """3 rounds of 2 optimizer steps (one per phase), linear LR decay, a checkpoint at step 3: after round 1's
    low phase, in the middle of the round."""
    out = tmp_path_factory.mktemp("cut")
    start = out / "tiny"
    tiny_model(tok).save_pretrained(start)
    cfg = LoptiGRPOConfig(**cut_settings(out))
    whole = step_log(cfg, tok, str(start))
    whole.pushed, cfg.push_to_hub = {}, True  # set after __init__, which would create the Hub repository
    whole.train()
    cfg.push_to_hub = False  # the later trainers of this config push nothing
    return cfg, str(start), whole


def test_a_run_resumed_mid_round_trains_every_step_as_the_uninterrupted_run(cut_run, tok):
    """(Before: TRL's micro-step counter restarted at 0, so step 3 trained the low phase of a new batch at the
    learning rate of step 4, and every later step the other phase.)"""
    cfg, start, whole = cut_run
    lr = cfg.learning_rate
    assert [(step, phase) for step, phase, _ in whole.steps] == [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0), (5, 1)]
    assert [rate for _, _, rate in whole.steps] == pytest.approx([lr, lr, 2 * lr / 3, 2 * lr / 3, lr / 3, lr / 3])
    checkpoint = os.path.join(cfg.output_dir, "checkpoint-3")
    resumed = step_log(cfg, tok, start)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.steps == whole.steps[3:]  # the same optimizer steps, phases and learning rates, exactly
    assert resumed.state.global_step == 6
    assert torch.equal(resumed.completions[0], whole.completions[3])  # round 1's high phase: round 1's batch
    assert torch.equal(resumed.completions[0], whole.completions[2])
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert os.path.exists(os.path.join(checkpoint, "lopti_round-0.pt"))  # cut mid-round: the round is saved
    assert not os.path.exists(os.path.join(cfg.output_dir, "checkpoint-6", "lopti_round-0.pt"))  # a round's end


def test_the_round_is_in_the_checkpoint_before_it_is_pushed(cut_run):
    """(Before: the round file was written after TRL's checkpoint had pushed the folder: a checkpoint pulled from the
    Hub lacked it.)"""
    _, _, whole = cut_run
    assert "lopti_round-0.pt" in whole.pushed["checkpoint-3"], whole.pushed
    assert "lopti_round-0.pt" not in whole.pushed["checkpoint-6"]  # a round's end: no round to carry


@pytest.mark.parametrize(
    "changed, saved",
    [(dict(lopti_eta=0.3), "lopti_eta=0.5"), (dict(steps_per_generation=2, max_steps=12), "steps_per_generation=1"),
     # the batch itself: without reference log-probs (a KeyError before), old log-probs at another temperature
     (dict(beta=0.1), "beta=0.0"), (dict(temperature=0.5), "temperature=1.0")],
    ids=["eta", "steps_per_generation", "beta", "temperature"],
)  # fmt: skip
def test_a_resume_under_other_settings_is_refused_naming_the_setting_and_both_values(cut_run, tok, changed, saved):
    """The round file holds the settings its batch and phases mean something under. (Before: another eta trained
    the rest of the round on the old threshold's phases without a word; another steps_per_generation
    ended in an IndexError inside TRL's loop.)"""
    cfg, start, _ = cut_run
    other = LoptiGRPOConfig(**cut_settings(cfg.output_dir, **changed))
    key = next(iter(changed))
    with pytest.raises(ValueError) as info:
        step_log(other, tok, start).train(resume_from_checkpoint=os.path.join(cfg.output_dir, "checkpoint-3"))
    message = str(info.value)
    assert f"was saved with {saved}, this run has {key}={changed[key]}" in message, message
    assert message.startswith("resume_from_checkpoint: ") and "\n" not in message


def test_another_runs_round_file_in_a_reused_folder_neither_blocks_a_resume_nor_stays(cut_run, tok, tmp_path):
    """A run at a round's end writes no round file, but one of an earlier run with other settings could be in the
    folder (the same output_dir): it refused the valid resume ("saved with steps_per_generation=2"), and a new
    checkpoint at a round's end kept it. Now a checkpoint at a round's end ignores it, and the save removes it."""
    import shutil

    cfg, start, _ = cut_run
    stale = torch.load(os.path.join(cfg.output_dir, "checkpoint-3", "lopti_round-0.pt"), weights_only=False)
    stale["settings"]["steps_per_generation"] = 2  # as an earlier run's
    shutil.copytree(os.path.join(cfg.output_dir, "checkpoint-6"), tmp_path / "checkpoint-6")
    for step in (6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir(exist_ok=True)
        torch.save(stale, tmp_path / f"checkpoint-{step}" / "lopti_round-0.pt")
    more = LoptiGRPOConfig(**cut_settings(tmp_path, max_steps=8, save_steps=2))
    resumed = step_log(more, tok, start)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    assert [(step, phase) for step, phase, _ in resumed.steps] == [(6, 0), (7, 1)]  # a new round, both phases
    assert (tmp_path / "checkpoint-8" / "trainer_state.json").exists()
    assert not (tmp_path / "checkpoint-8" / "lopti_round-0.pt").exists()


def test_a_mid_round_checkpoint_without_its_round_is_refused(cut_run, tok, tmp_path):
    import shutil

    cfg, start, _ = cut_run
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(os.path.join(cfg.output_dir, "checkpoint-3"), checkpoint)
    (checkpoint / "lopti_round-0.pt").unlink()  # e.g. saved by a trainer that did not save rounds
    with pytest.raises(ValueError) as info:
        step_log(cfg, tok, start).train(resume_from_checkpoint=str(checkpoint))
    message = str(info.value)
    assert "resume_from_checkpoint" in message and "micro-step 1" in message and "\n" not in message


def test_max_steps_from_epochs_is_whole_rounds(tmp_path, tok):
    """5 prompts, one per generation: an epoch is 5 rounds of 2 optimizer steps; half an epoch is 5 steps, which
    would end on a low phase. (Before: 5 steps, the last round without its high phase.)"""
    cfg = LoptiGRPOConfig(**settings(tmp_path, max_steps=-1, num_train_epochs=0.5, gradient_accumulation_steps=1,
                                     steps_per_generation=1, lopti_eta=0.5))  # fmt: skip
    trainer = step_log(cfg, tok, tiny_model(tok))
    trainer.train_dataset = kk_dataset(5)
    trainer.train()
    assert trainer.state.global_step == 6
    assert [phase for _, phase, _ in trainer.steps] == [0, 1] * 3


def test_a_micro_step_without_the_phases_tokens_leaves_the_logged_means_alone():
    """Two micro-steps of the high phase: 10 tokens (every one clipped, entropy 2) and none. What TRL's ``log``
    makes of them (NaN dropped, then the mean; trl 1.16's ``GRPOTrainer.log``) is the 10 tokens' means: 1.0 and 2.0.
    (Before: the empty micro-step appended a 0, logged as 0.5 and 1.0.) ``_log_loss_metrics`` is bound to an object
    holding what it reads, one process."""
    import math
    from collections import defaultdict
    from types import SimpleNamespace

    one_process = SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t)
    bound = SimpleNamespace(accelerator=one_process, _metrics={"train": defaultdict(list)}, epsilon_low=0.2,
                            epsilon_high=0.28, args=SimpleNamespace(lopti_order="low_first"))  # fmt: skip
    b, t = 2, 5
    for rows in (torch.ones(b, t, dtype=torch.bool), torch.zeros(b, t, dtype=torch.bool)):
        n = int(rows.sum())
        out = SimpleNamespace(logp=torch.zeros(n), entropy=torch.full((n,), 2.0),
                              clipped=torch.ones(n, dtype=torch.bool))  # fmt: skip
        LoptiGRPOTrainer._log_loss_metrics(bound, "train", {"lopti_phase": 1}, out, rows, torch.zeros(b, t),
                                           torch.ones(b, t), None, torch.tensor(0.0))  # fmt: skip

    def logged(key: str) -> float:  # trl 1.16 GRPOTrainer.log: NaN values dropped, then the mean
        valid = [v for v in bound._metrics["train"][key] if not math.isnan(v)]
        return sum(valid) / len(valid)

    assert logged("lopti/high/clip_ratio") == 1.0 and logged("entropy") == 2.0
    assert logged("clip_ratio/high_mean") == 0.0 and logged("clip_ratio/region_mean") == 0.0  # ratio 1: none
