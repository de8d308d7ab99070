"""algo.RoundSchedule: every phase of a round at the first phase's learning rates, the schedule once per round."""

import pytest
import torch

from openrlhf_lopti.algo import RoundSchedule


def _sgd_with_schedule():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


def _phase(optimizer, scheduler, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_later_phases_replay_the_first_phases_rates_and_the_schedule_moves_once_per_round():
    optimizer, scheduler = _sgd_with_schedule()
    hold = RoundSchedule(scheduler, optimizer)
    seen = []
    for _ in range(2):  # rounds
        hold.start_round()
        phases = []
        for k in range(2):  # phases
            if k:
                hold.start_phase()
            phases.append(_phase(optimizer, scheduler, steps=3))
        assert phases[0] == phases[1]
        seen.append(phases[0])
    plain_optimizer, plain_scheduler = _sgd_with_schedule()
    plain = _phase(plain_optimizer, plain_scheduler, steps=6)  # the same run without Lopti: one pass per round
    assert seen[0] + seen[1] == plain
    assert scheduler.state_dict()["last_epoch"] == plain_scheduler.state_dict()["last_epoch"] == 6


def test_the_optimizers_rates_are_restored_too_and_no_scheduler_is_a_no_op():
    optimizer, scheduler = _sgd_with_schedule()
    hold = RoundSchedule(scheduler)  # the optimizer is read off the scheduler
    hold.start_round()
    _phase(optimizer, scheduler, steps=2)
    optimizer.param_groups[0]["lr"] = 123.0  # a framework that sets the lr by hand between steps
    hold.start_phase()
    assert optimizer.param_groups[0]["lr"] == 1.0
    none = RoundSchedule(None)
    none.start_round()
    none.start_phase()


def test_a_rounds_start_survives_a_checkpoint_between_its_phases():
    """A run cut after phase 1 and resumed in a new process: phase 2 replays phase 1's rates, as uninterrupted."""
    optimizer, scheduler = _sgd_with_schedule()
    hold = RoundSchedule(scheduler, optimizer)
    hold.start_round()
    first = _phase(optimizer, scheduler, steps=2)
    saved = {"hold": hold.state_dict(), "scheduler": scheduler.state_dict()}
    optimizer2, scheduler2 = _sgd_with_schedule()  # the resumed process: its schedule as the checkpoint left it
    scheduler2.load_state_dict(saved["scheduler"])
    resumed = RoundSchedule(scheduler2, optimizer2)
    resumed.load_state_dict(saved["hold"])
    resumed.start_phase()
    assert _phase(optimizer2, scheduler2, steps=2) == first
    assert scheduler2.state_dict()["last_epoch"] == 2


# ---- schedulers whose load_state_dict is not a plain restore, and the other front ends' schedulers (issue 45) ----


def _rounds_against_a_plain_run(build, rounds=4, steps=3, step=lambda scheduler: scheduler.step()):
    """``rounds`` Lopti rounds of two phases of ``steps`` optimizer steps each under :class:`RoundSchedule`, against the
    same schedule stepped ``rounds x steps`` times without Lopti: each step's (lr, weight decay) and the final state."""

    def values(optimizer):
        return [(g["lr"], g.get("weight_decay")) for g in optimizer.param_groups]

    optimizer, scheduler = build()
    hold = RoundSchedule(scheduler, optimizer)
    lopti = []
    for _ in range(rounds):
        hold.start_round()
        phases = []
        for k in range(2):
            if k:
                hold.start_phase()
            phases.append([])
            for _ in range(steps):
                phases[-1].append(values(optimizer))
                optimizer.step()
                step(scheduler)
        assert phases[0] == phases[1]  # phase 2 replays phase 1's rates and weight decays
        lopti += phases[0]
    plain_optimizer, plain_scheduler = build()
    plain = []
    for _ in range(rounds * steps):
        plain.append(values(plain_optimizer))
        plain_optimizer.step()
        step(plain_scheduler)
    assert lopti == plain
    return scheduler, plain_scheduler


def test_megatron_cores_scheduler_keeps_the_count_of_a_run_without_lopti():
    """Megatron-Core's ``OptimizerParamScheduler`` (verl's Megatron engine: ``verl/utils/megatron/optimizer.py``, stepped
    with ``step(1)``), the real class: warm-up, cosine decay and a weight decay that rises with the step count.
    Its ``load_state_dict`` adds the loaded count to the current one. (Before: the count was never put back, 6 after
    round 1 and 18 after round 2 where the plain run has 3 and 6, and round 1's phase 2 trained at step 3's weight
    decay: ``phases[0] == phases[1]`` failed.)"""
    scheduler_module = pytest.importorskip("megatron.core.optimizer_param_scheduler")

    def build():
        param = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.AdamW([param], lr=0.0, weight_decay=0.0)
        scheduler = scheduler_module.OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=4, lr_decay_steps=12,
            lr_decay_style="cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=12, wd_incr_style="linear",
        )  # fmt: skip
        return optimizer, scheduler

    scheduler, plain = _rounds_against_a_plain_run(build, step=lambda s: s.step(1))
    assert scheduler.num_steps == plain.num_steps == 12


def test_deepspeeds_and_transformers_schedulers_keep_the_count_of_a_run_without_lopti():
    """DeepSpeed's ``WarmupDecayLR`` (OpenRLHF's actor under DeepSpeed's own scheduler config; its ``load_state_dict``
    sets the count but not the rates) and transformers' cosine-with-warm-up (TRL's, OpenRLHF's default)."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from transformers import get_cosine_schedule_with_warmup

    def deepspeed():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        return optimizer, lr_schedules.WarmupDecayLR(optimizer, total_num_steps=12, warmup_max_lr=1.0,
                                                     warmup_num_steps=4, warmup_type="linear")  # fmt: skip

    def transformers():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        return optimizer, get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=12)

    ds, ds_plain = _rounds_against_a_plain_run(deepspeed)
    assert ds.state_dict() == ds_plain.state_dict()
    hf, hf_plain = _rounds_against_a_plain_run(transformers)
    assert hf.state_dict()["last_epoch"] == hf_plain.state_dict()["last_epoch"] == 12


def test_a_scheduler_that_cannot_be_put_back_is_refused_in_one_line():
    """Never a silently wrong schedule: a loader that neither restores its state nor has it as attributes."""

    class Opaque:
        def __init__(self, optimizer):
            self.optimizer, self._count = optimizer, [0]

        def state_dict(self):
            return {"count": self._count[0]}

        def load_state_dict(self, state):
            self._count[0] += state["count"]

        def step(self):
            self._count[0] += 1

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    hold = RoundSchedule(Opaque(optimizer))
    hold.start_round()
    hold.scheduler.step()
    with pytest.raises(ValueError, match=r"^Opaque: the Lopti round cannot put this LR scheduler back") as info:
        hold.start_phase()
    assert "\n" not in str(info.value)
