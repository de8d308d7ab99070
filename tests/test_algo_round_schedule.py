"""algo.RoundSchedule: every phase of a round at the first phase's learning rates, the schedule once per round."""

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
