"""Two data-parallel ranks (gloo, verl's FSDP2 engine, ``torch.multiprocessing.spawn``), each holding different data:
they decide the same Lopti round (a quantile threshold gathered over both ranks, the same phases with the same
global token counts), and their update is the local trainer's on the two ranks' data together.

Rank 1's responses are all high-probability (its rollout log-probs are set to log 0.95), so on its own data it has no
low token at all: it must still run the low phase with rank 0 (FSDP's collectives would hang otherwise), and its
threshold must be the one of both ranks' tokens, not of its own.
"""

import dataclasses
import math
import os
import tempfile
from contextlib import nullcontext

import torch
import torch.multiprocessing as mp

from openrlhf_lopti.algo import LoptiSettings, plan_round

from ..numerics import U32, assert_same_computation
from . import harness
from .test_worker import KL, LR, exact_float64_buffers, full_parameters, run_local

QUANTILE = 0.3
WORLD = 2
PER_RANK = 8
MINI = 8  # global: 4 responses per rank per mini-batch, 2 mini-batches
MICRO = 2


def rank_rows(rank: int) -> slice:
    return slice(rank * PER_RANK, (rank + 1) * PER_RANK)


def _rank_main(rank: int, port: int, path: str, data_file: str, out_dir: str) -> None:
    harness.init_process_group(rank, WORLD, port)
    from verl.utils import tensordict_utils as tu

    from ..numerics import Float64Shadow

    saved = torch.load(data_file, weights_only=False)
    exp, model = saved["exp"], saved["model"]
    rows = rank_rows(rank)
    mine = dataclasses.replace(
        exp,
        rollout=exp.rollout.select(torch.arange(rows.start, rows.stop)),
        old_log_probs=exp.old_log_probs[rows],
        ref_log_probs=exp.ref_log_probs[rows],
        advantages=exp.advantages[rows],
        rewards=exp.rewards[rows],
    )
    result = {}
    for precision in ("fp32", "float64"):
        cfg = harness.compose(harness.actor_overrides(
            path, mini_batch=MINI, micro_batch=MICRO, lr=LR, kl_coef=KL, alpha=0.3, quantile=QUANTILE,
        ))  # fmt: skip
        with Float64Shadow() if precision == "float64" else nullcontext():
            worker = harness.actor_worker(cfg)
            module = worker.actor.engine.module
            if precision == "float64":
                exact_float64_buffers(module, model)
            before = full_parameters(module)
            batch = harness.verl_batch(mine, temperature=saved["temperature"], mini_batch=MINI)
            if precision == "float64":
                for key in ("old_log_probs", "advantages", "ref_log_prob"):
                    batch[key] = batch[key].double()
            out = worker.update_actor(batch)
            after = full_parameters(module)
        plan = worker.actor.last_round
        result[precision] = {
            "threshold": plan.threshold,
            "phases": [(p.name, p.tokens, int(p.mask.sum())) for p in plan.phases],
            "metrics": None if out is None else dict(tu.get(out, "metrics")),
            "delta": {name: after[name] - before[name] for name in before},
        }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_two_ranks_decide_one_round_and_make_the_local_update(tiny, monkeypatch):
    exp = tiny["exp"]
    old = exp.old_log_probs.clone()
    old[rank_rows(1)] = math.log(0.95) * exp.rollout.action_mask[rank_rows(1)]
    exp = dataclasses.replace(exp, old_log_probs=old)
    with tempfile.TemporaryDirectory() as out_dir:
        data_file = os.path.join(out_dir, "data.pt")
        torch.save({"exp": exp, "model": tiny["model"], "temperature": tiny["temperature"]}, data_file)
        mp.spawn(_rank_main, args=(harness.free_port(), tiny["path"], data_file, out_dir), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]

    # the round of both ranks' tokens, decided in one process
    mask = exp.rollout.action_mask
    whole = plan_round(old, mask, LoptiSettings(quantile=QUANTILE), 0.3)
    alone = [plan_round(old[rank_rows(r)], mask[rank_rows(r)], LoptiSettings(quantile=QUANTILE)).threshold
             for r in range(WORLD)]  # fmt: skip
    for r, result in enumerate(ranks):
        got = result["fp32"]
        assert got["threshold"] == whole.threshold, f"rank {r}: threshold {got['threshold']} != {whole.threshold}"
        assert [(name, tokens) for name, tokens, _ in got["phases"]] == [(p.name, p.tokens) for p in whole.phases]
    assert whole.threshold not in alone, "the ranks' own thresholds must differ from the gathered one"
    assert ranks[1]["fp32"]["phases"][0][:1] == ("low",) and ranks[1]["fp32"]["phases"][0][2] == 0  # none local
    assert ranks[0]["fp32"]["phases"][0][2] == whole.phases[0].tokens  # rank 0 holds every low token
    metrics = ranks[0]["fp32"]["metrics"]
    for key, value in whole.metrics.items():
        if key == "ar/mean_weight":  # fp32 sums of per-rank weights: worst-case summation error N * u32 (N tokens)
            bound = whole.phases[0].tokens + whole.phases[1].tokens
            assert abs(metrics[key] - value) <= bound * U32 * value, (key, metrics[key], value)
        else:  # counts and the threshold: exact
            assert metrics[key] == value, key
    assert len(metrics["lopti/low/grad_norm"]) == len(metrics["lopti/high/grad_norm"]) == 2  # both phases ran

    # the update: the local trainer on both ranks' data, each mini-batch = both ranks' next 4 responses
    order = torch.cat([torch.arange(r * PER_RANK + m * 4, r * PER_RANK + m * 4 + 4) for m in range(2)
                       for r in range(WORLD)])  # fmt: skip
    local_exp = dataclasses.replace(
        exp, rollout=exp.rollout.select(order), old_log_probs=exp.old_log_probs[order],
        ref_log_probs=exp.ref_log_probs[order], advantages=exp.advantages[order], rewards=exp.rewards[order],
    )  # fmt: skip
    local_tiny = dict(tiny, exp=local_exp)
    method = dict(alpha=0.3, eta=None, quantile=QUANTILE)
    l32, lm32 = run_local(local_tiny, method, float64=False, micro=MICRO)
    l64, _ = run_local(local_tiny, method, float64=True, monkeypatch=monkeypatch, micro=MICRO)
    assert lm32["lopti/threshold"] == whole.threshold
    v32, v64 = ranks[0]["fp32"]["delta"], ranks[0]["float64"]["delta"]
    for param in l32:
        assert torch.equal(ranks[1]["fp32"]["delta"][param], v32[param]), f"{param}: the ranks' weights differ"
        assert_same_computation(f"two ranks: change of {param}", v32[param], l32[param], v64[param], l64[param],
                                a_name="verl (2 ranks)", b_name="local")  # fmt: skip
