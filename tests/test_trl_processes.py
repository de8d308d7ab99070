"""``LoptiGRPOTrainer`` on 2 processes, launched as TRL users launch it: ``torchrun --nproc_per_node 2`` on CPU (gloo).

One launch (tests/trl_ranks.py) trains one Lopti round with a quantile threshold; then, in this process, the same
global batch (both ranks' micro-batches, with their rollout log-probs and advantages) is trained by one process.
- both ranks decide the same threshold, the quantile of the whole batch's token probabilities;
- each rank's phase masks are its tokens below / at or above it, and the ranks' counts add up to the logged global
  counts, which are the one process's;
- the ranks' update (DDP's mean of their gradients) is the one process's update of the whole batch;
- the same round through the fused lm_head (the output layer runs the loss inside DDP's forward) makes that update;
- a resume from a mid-round checkpoint without the last process's round file fails on every process with the same
  line naming the missing file (before: that process raised alone and the others went on into training, to wait in
  their first collective);
- a reward function that returns -inf for a completion of the last process only fails the generation on every
  process with the same line.

Under DeepSpeed ZeRO-2, ZeRO-3 (gloo, DeepSpeed's CPU accelerator) and FSDP2 (gloo, torch's ``fully_shard``; see
``trl_ranks.fsdp2_settings`` for what its CPU stand-in cannot show), one launch each: the same round makes one
process's update, the fused lm_head the logits path's; two rounds under a linear schedule step at DDP's learning
rates; a resume from the mid-round checkpoint ends at the uninterrupted run's parameters; with AR and Lopti off our
trainer makes TRL's own GRPOTrainer's update under the same sharding; a NaN advantage on the last process stops
every process at the first step with no weight moved, and one in the round's second step (after the first step's
checkpoint) before that step; a round whose second phase has no token takes no optimizer step there (no weight, no
AdamW state moves) and ends on the schedule of a run without Lopti. (FSDP1 does not run on CPU: accelerate asks for
a GPU.)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from openrlhf_lopti.algo.lopti import quantile_threshold  # noqa: E402

from .ds_ranks import free_port  # noqa: E402
from .run_logs import failure_report  # noqa: E402
from .test_trl_trainer import LR, tiny_model, tok  # noqa: E402, F401 (a fixture)
from .trl_ranks import OURS, QUANTILE, build  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def launch(out: Path, *args: str) -> list:
    """``torchrun --nproc_per_node 2 tests/trl_ranks.py OUT [args]``; each rank's saved results."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), "tests/trl_ranks.py", str(out),
           *args]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, failure_report(result.stderr, result.stdout)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Under DDP (accelerate's default for several CPU processes)."""
    return launch(tmp_path_factory.mktemp("trl_ranks"))


# what each sharded launch's trainers ran in (tests/trl_ranks.py, ``wrapper``)
WRAPPERS = {"zero2": ("DeepSpeedEngine", 2), "zero3": ("DeepSpeedEngine", 3), "fsdp2": ("FSDP", 2)}


@pytest.fixture(scope="module", params=list(WRAPPERS))
def sharded_ranks(request, tmp_path_factory):
    """Under DeepSpeed ZeRO-2 / ZeRO-3 (on gloo, DeepSpeed's CPU accelerator) or FSDP2 (gloo); ``kind`` added."""
    runs = launch(tmp_path_factory.mktemp(f"trl_{request.param}"), request.param)
    return [dict(run, kind=request.param) for run in runs]


def logged(run: dict, key: str) -> float:
    return next(h[key] for h in run["logs"] if key in h)


def whole_batch(ranks: list) -> dict:
    """Both ranks' generation batches as one (their phase-1 micro-batch: the whole batch with spg=1), without the
    trainer's own keys; completions right-padded to one length."""
    parts = [{k: v for k, v in run["trained"][0].items() if k not in OURS} for run in ranks]
    width = max(p["completion_ids"].size(1) for p in parts)
    out = {}
    for key, value in parts[0].items():
        if not torch.is_tensor(value) or value.dim() == 0:
            assert all(torch.equal(p[key], value) if torch.is_tensor(value) else p[key] == value for p in parts), key
            out[key] = value  # a global value (num_items_in_batch): the same on both ranks
            continue
        values = [p[key] for p in parts]
        if key.startswith("completion") or key.endswith("per_token_logps"):
            values = [torch.nn.functional.pad(v, (0, width - v.size(1))) for v in values]
        out[key] = torch.cat(values)
    return out


def test_two_processes_decide_one_round_and_make_one_processs_update(ranks, tok, tmp_path):
    assert [run["world"] for run in ranks] == [2, 2] and ranks[0]["backend"] == "gloo"
    one_round_and_one_processs_update(ranks, tok, tmp_path)


def one_round_and_one_processs_update(ranks: list, tok, tmp_path) -> None:
    """The ranks decided the whole batch's threshold and phases, and made one process's update of the whole batch."""
    batch = whole_batch(ranks)
    mask = batch["completion_mask"].bool()
    probs = batch["old_per_token_logps"].float().exp()
    threshold = logged(ranks[0], "lopti/threshold")
    assert logged(ranks[1], "lopti/threshold") == threshold
    assert threshold == pytest.approx(quantile_threshold(probs[mask], QUANTILE), rel=1e-6)  # the whole batch's
    counts = {"low": 0, "high": 0}
    for run in ranks:
        phases = [m for m in run["trained"]]
        assert [m["lopti_phase"] for m in phases] == [0, 1]
        rank_mask = phases[0]["completion_mask"].bool()
        low = rank_mask & (phases[0]["old_per_token_logps"].float().exp() < threshold)
        assert torch.equal(phases[0]["lopti_phase_mask"], low)
        assert torch.equal(phases[1]["lopti_phase_mask"], rank_mask & ~low)
        counts["low"] += int(low.sum())
        counts["high"] += int((rank_mask & ~low).sum())
        for name in counts:
            assert logged(run, f"lopti/{name}/tokens") == logged(ranks[0], f"lopti/{name}/tokens")
    assert counts["low"] > 0 and counts["high"] > 0 and sum(counts.values()) == int(mask.sum())
    assert {name: logged(ranks[0], f"lopti/{name}/tokens") for name in counts} == counts

    one = build(str(tmp_path), tok, per_device_batch=8, replay=batch)
    initial = [p.detach().clone() for p in one.model.parameters()]
    one.train()
    alone = {"logs": one.state.log_history}
    assert logged(alone, "lopti/threshold") == threshold
    assert {name: logged(alone, f"lopti/{name}/tokens") for name in counts} == counts
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))  # kept equal
    # the same update up to fp32 rounding (the ranks sum two halves' gradients, one process one batch's), where a
    # wrong normalisation would be off by the step itself
    same_update(one.model.parameters(), ranks[0]["params"])
    assert any((ours.detach() - p0).abs().max() > 0 for p0, ours in zip(initial, one.model.parameters()))


def same_update(ours, theirs) -> None:
    """Parameters equal up to fp32 rounding: a few ulps of each (seen: below 1 ulp)."""
    ulp = torch.finfo(torch.float32).eps
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert (a.detach() - b).abs().max() <= 4 * ulp * b.abs().max(), i


def test_the_fused_lm_head_under_ddp_makes_the_logits_paths_update(ranks, tok):
    """``fused_lm_head=True`` on two processes (refused before: it ran the backbone outside DDP): each rank replays
    its own batch of the round, and the update equals the logits path's, on both ranks alike."""
    fused_lm_head_makes_the_logits_paths_update(ranks, tok)


def fused_lm_head_makes_the_logits_paths_update(ranks: list, tok) -> None:
    initial = [p.detach() for p in tiny_model(tok).parameters()]  # the seeded model both runs started from
    for run in ranks:
        def phases(trained: list) -> list:  # each phase's token rows, in any order (TRL shuffles the batch again)
            return [sorted(m["lopti_phase_mask"].tolist()) for m in trained]

        assert phases(run["fused_trained"]) == phases(run["trained"])  # the same round, phase by phase
        for i, (fused, logits, start) in enumerate(zip(run["fused_params"], run["params"], initial)):
            step = logits - start
            # the same update up to fp32 rounding (another order of sums), not off by a share of it
            assert (fused - start - step).abs().max() <= 1e-4 * step.abs().max() + 1e-7, i
    assert any((p - p0).abs().max() > 0 for p, p0 in zip(ranks[0]["fused_params"], initial))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["fused_params"], ranks[1]["fused_params"]))


def test_a_checkpoint_without_a_processs_round_fails_every_process_in_one_line(ranks):
    assert [run["round_files"] for run in ranks] == [["lopti_round-0.pt", "lopti_round-1.pt"]] * 2  # both saved
    messages = {run["resume_error"] for run in ranks}
    assert len(messages) == 1, messages  # the same line on every process
    message = messages.pop()
    assert "holds the Lopti round of processes [0] but not of [1] (lopti_round-1.pt)" in message, message
    assert message.startswith("resume_from_checkpoint: ") and "\n" not in message


def test_a_bad_reward_on_one_process_fails_every_process_in_one_line(ranks):
    """(A check of each process's own rows only passed every one-process test.)"""
    messages = {run["reward_error"] for run in ranks}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "'last_process_only' returned -inf for completion 4 of the generation batch" in message, message
    assert "\n" not in message


def test_a_bad_value_in_one_processs_evaluation_fails_every_process_in_one_line(ranks):
    """Evaluation reads the loss head's value checks at once, on every process together (before: the process that
    found it raised alone and the others waited in their next collective)."""
    first, last = (run["evaluation_error"] for run in ranks)
    assert first == "a loss-head call on another process found a bad input (its own error names the call and the row)"
    assert last.startswith("advantages must be finite") and "evaluation at optimizer step 0" in last, last
    assert "\n" not in first + last


# ------------------------------------------------------------------------------ DeepSpeed ZeRO-2 / 3 and FSDP2
def test_sharded_two_processes_decide_one_round_and_make_one_processs_update(sharded_ranks, tok, tmp_path):
    """Every trainer of the launch ran in the DeepSpeed engine of the stage or the FSDP version asked for
    (accelerate counted both processes), and the round made one process's update of the whole batch."""
    assert [run["world"] for run in sharded_ranks] == [2, 2]
    expected = WRAPPERS[sharded_ranks[0]["kind"]]
    assert all(run["engines"] == [expected] * 10 for run in sharded_ranks)
    one_round_and_one_processs_update(sharded_ranks, tok, tmp_path)


def test_sharded_the_fused_lm_head_makes_the_logits_paths_update(sharded_ranks, tok):
    """The output layer's loss runs inside DeepSpeed's or FSDP's forward (ZeRO-3 and FSDP gather its weight for the
    layer's call)."""
    fused_lm_head_makes_the_logits_paths_update(sharded_ranks, tok)


def test_sharded_each_phase_steps_at_the_rounds_learning_rates_as_under_ddp(sharded_ranks, ranks):
    """Two rounds under a linear schedule (transformers steps it after DeepSpeed's step): the learning rate each
    optimizer step holds is DDP's, both phases of a round at one rate (the round's rewind held)."""
    for run in (*ranks, *sharded_ranks):
        assert run["rates"] == ranks[0]["rates"]
    first, second = ranks[0]["rates"][0], ranks[0]["rates"][-1]
    assert ranks[0]["rates"] == [first, first, second, second] and second < first


def test_sharded_a_resume_from_the_mid_round_checkpoint_ends_where_the_run_did(sharded_ranks):
    """The engine's checkpoint (each process's ZeRO partition, or FSDP's sharded state and optimizer, under AdamW)
    and the round's file restored together: the high phase trains on the round's batch and ends at the
    uninterrupted run's parameters."""
    for run in sharded_ranks:
        [high] = run["resumed_trained"]  # the round's second phase only, on the saved batch
        assert high["lopti_phase"] == 1
        assert torch.equal(high["completion_ids"], run["adam_trained"][1]["completion_ids"])
        same_update(run["resumed_params"], run["adam_params"])


def test_sharded_with_ar_and_lopti_off_ours_makes_trls_update(sharded_ranks, tok):
    """With AR and Lopti off, our fused-loss path and TRL's own GRPOTrainer, each replaying the rank's batch of the
    round under the same DeepSpeed stage or FSDP, make the same update and log the same metrics."""
    initial = [p.detach() for p in tiny_model(tok).parameters()]
    for run in sharded_ranks:
        same_update(run["off_params"], run["trl_params"])
        assert any((p - p0).abs().max() > 0 for p, p0 in zip(run["trl_params"], initial))
        names = [sorted(k for h in run[logs] for k in h) for logs in ("off_logs", "trl_logs")]
        assert names[0] == names[1]


def test_the_value_checks_are_read_once_per_optimizer_step_under_ddp_zero_and_fsdp(ranks, sharded_ranks):
    """One read (a 4-byte all-reduce and a host sync) per optimizer step; before, twice under ZeRO: its optimizer
    steps the torch one once per parameter group, and the hook fired at each."""
    for run in (*ranks, *sharded_ranks):
        assert run["reads"] == [0, 1]  # the round's two optimizer steps


def test_sharded_a_bad_value_fails_every_process_before_the_step(sharded_ranks, tok):
    """A NaN advantage on the last process: its value check is read by a pre-hook on the torch optimizer (under
    DeepSpeed, the one inside its ZeRO optimizer; before, the hook went on the ZeRO optimizer, which has none, and
    every run under DeepSpeed failed at its first loss); every process raises at the first step, no weight has
    moved."""
    first, last = (run["nan_error"] for run in sharded_ranks)
    assert first == "a loss-head call on another process found a bad input (its own error names the call and the row)"
    assert last.startswith("advantages must be finite") and last.endswith("at optimizer step 1, Lopti phase 'low', "
                                                                          "micro-step 1)"), last  # fmt: skip
    initial = [p.detach() for p in tiny_model(tok).parameters()]
    for run in sharded_ranks:
        assert all(torch.equal(p, p0) for p, p0 in zip(run["nan_params"], initial))


def test_sharded_a_bad_value_in_the_rounds_second_step_fails_before_it(sharded_ranks, tok):
    """A NaN advantage in the high phase, after the checkpoint of the round's first step: every process raises
    before the second step, whose weights stay finite. Before, under FSDP the checkpoint's optimizer save stepped the
    stateless optimizer (torch.distributed.checkpoint creates its state so) and that step took the global step's
    read: the real step skipped it and moved every weight to NaN, and the error came at the next checkpoint."""
    first, last = (run["nan_second_error"] for run in sharded_ranks)
    assert first.startswith("a loss-head call on another process found a bad input"), first
    assert last.startswith("advantages must be finite") and "at optimizer step 2, Lopti phase 'high'" in last, last
    initial = [p.detach() for p in tiny_model(tok).parameters()]
    for run in sharded_ranks:
        assert all(p.isfinite().all() for p in run["nan_second_params"])
        assert any(not torch.equal(p, p0) for p, p0 in zip(run["nan_second_params"], initial))  # step 1 trained


def test_sharded_an_empty_phase_takes_no_optimizer_step(sharded_ranks, tok):
    """A round whose second (high) phase has no token on any process, AdamW with weight decay, a linear schedule:
    the empty phase moves no weight and takes no AdamW step, and the schedule ends the round where the low phase
    left it (one step, as a run without Lopti; tests/test_lopti_round_contract.py without DeepSpeed). DeepSpeed
    counts the step as not applied. (Before, under ZeRO-2 and ZeRO-3 the empty phase's loss failed in DeepSpeed's
    backward: "loss must be a scalar tensor".)"""
    initial = [p.detach() for p in tiny_model(tok).parameters()]
    for run in sharded_ranks:
        assert run["empty_error"] is None, run["empty_error"]
        counts = {name: logged({"logs": run["empty_logs"]}, f"lopti/{name}/tokens") for name in ("low", "high")}
        assert counts["high"] == 0 and counts["low"] > 0, counts
        assert any(not torch.equal(p, p0) for p, p0 in zip(run["empty_phase_2_start"], initial))  # the low phase
        assert all(torch.equal(p, p2) for p, p2 in zip(run["empty_params"], run["empty_phase_2_start"]))
        state = run["empty_optimizer"]
        assert state["steps"] == [1]  # one AdamW step per parameter: the low phase's
        assert run["empty_rates"] == [LR, LR]  # phase 2 at phase 1's rate (the round's rewind)
        last_epoch, rates = state["schedule"]
        assert last_epoch == 1 and set(rates) == {0.0}  # the run's one scheduled step: the linear schedule's end
        if run["kind"].startswith("zero"):
            assert state["engine"] == (2, 1, False)  # two optimizer steps, the second not applied
