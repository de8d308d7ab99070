"""Lopti for verl: :class:`LoptiTrainingWorker`, verl's ``TrainingWorker`` driving ``algo.plan_round``'s phases.

Selected through verl's own extension point ``ActorRolloutRefWorker.actor_worker_cls`` (set by our verl plugin,
:mod:`.plugin`, when verl imports ``engine_workers``). With Lopti off and no AR it is verl's ``TrainingWorker``
unchanged. Its settings come from the loss function verl hands it
(``partial(ppo_loss, config=actor_config)``): ``actor_config.policy_loss`` as ``LoptiPolicyLossConfig``.

One RL step (``train_mini_batch``, called once per step by ``update_actor``):

1. ``algo.plan_round`` on the step's batch: the threshold (``eta``, or the quantile over every data-parallel rank's
   response tokens: ``gather`` is an all-gather over the engine's data-parallel group), each token's phase, the
   order, the metrics (``all_reduce`` is a sum over that group). Every rank decides the same threshold and the
   same phase token counts, so every rank runs and skips the same phases.
2. For each phase with tokens, in order, verl's own ``train_mini_batch`` on the batch with ``response_mask`` replaced
   by the phase's tokens (so the policy loss, KL and entropy are masked to them) and the other tokens' advantages
   zeroed. ``loss_mask`` (what verl's token-mean denominator counts, over the mini-batch on every rank) stays every
   response token, as in the authors' code; ``old_log_probs`` stay the rollout's. The same mini-batches, epochs and
   shuffling seed run in each phase; phase 2's forward passes run on the weights phase 1 updated.
3. The LR-hold rule, ``algo.RoundSchedule`` on the engine's ``lr_scheduler`` and ``optimizer`` (every verl 0.9.1
   engine builds both as attributes: ``workers/engine/fsdp/transformer_impl.py:627``, the Megatron engine's
   ``workers/engine/megatron/transformer_impl.py:610``, Megatron-Core's ``OptimizerParamScheduler``, whose relative
   ``load_state_dict`` ``RoundSchedule`` puts back attribute by attribute): every phase trains at the first phase's
   lr and weight decay and the schedule moves once per RL step. verl steps it on each pass's last mini-batch
   (``engine_workers.py:308``); each later phase starts again from the round's starting point. A phase without a
   token on any rank is not run (no optimizer step, no scheduler step).

The batch comes in either layout verl hands ``update_actor``: padded ``[batch, response_len]`` (``use_v1=false``) or,
under the default trainer (``use_v1=true``), per-response fields as jagged nested tensors (``response_mask``,
``old_log_probs``, ``advantages``: one row per response, its own length; verl's ``ppo_loss`` pads them itself,
``workers/utils/losses.py:91``). ``algo.plan_round`` takes both; each phase's batch keeps the layout it was given.

Metrics (:func:`merge_phase_metrics`): ``lopti/<phase>/<verl key>`` for each phase that ran; verl's own keys over
the whole round (the losses summed over the phases per mini-batch, every other list the phases' lists in update
order, so a mean is over every optimizer step of the round); and the round's
``lopti/threshold``, ``lopti/low_token_frac``, ``lopti/<phase>/tokens`` and ``ar/mean_weight`` (with AR). verl's
driver prefixes everything the actor returns with ``actor/`` (``lopti/threshold`` is logged as
``actor/lopti/threshold``).
"""

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from tensordict import TensorDict
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import ppo_loss

from openrlhf_lopti.algo import LoptiRound, LoptiSettings, RoundSchedule, plan_round

from .config import ar_alpha_of, check_lopti_actor, round_settings

# verl's loss metrics: with Lopti each phase's value is its share of the mini-batch's token mean (the denominator
# counts every response token), so the phases' values add up to the round's loss.
SHARE_METRICS = ("loss", "actor/pg_loss", "actor/entropy_loss", "kl_loss")


def loss_config(loss_fn):
    """The actor config inside verl's loss function ``partial(ppo_loss, config=...)``, or None."""
    keywords = getattr(loss_fn, "keywords", None) or {}
    return keywords.get("config")


def _keep_phase(values: torch.Tensor, phase: torch.Tensor, name: str) -> torch.Tensor:
    """``values`` (the batch's field ``name``) where ``phase`` is True, 0 elsewhere, in ``values``' layout (padded, or
    jagged nested with ``phase``'s offsets: refused in one line otherwise, before a token lands in another row)."""
    if not values.is_nested:
        return torch.where(phase.to(values.device), values, torch.zeros_like(values))
    if values.lengths() is not None or not torch.equal(values.offsets().cpu(), phase.offsets().cpu()):
        raise ValueError(
            f"{name}: a nested field of the Lopti round must have the rows of old_log_probs (contiguous, the same "
            "offsets): its rows differ"
        )
    flat = values.values()
    kept = torch.where(phase.values().to(flat.device), flat, torch.zeros_like(flat))
    return torch.nested.nested_tensor_from_jagged(kept, values.offsets())


class LoptiTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` with AR's metric and Lopti's phases (module docstring)."""

    lopti: Optional[LoptiSettings] = None
    ar_alpha: float = 0.0
    last_round: Optional[LoptiRound] = None  # the latest step's round (tests and diagnostics)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_loss_fn(self, loss_fn):
        """verl's ``set_loss_fn``; reads AR's and Lopti's settings from the actor config inside ``loss_fn`` and
        refuses a verl setting Lopti cannot honour (one line naming the key) before any training."""
        config = loss_config(loss_fn)
        if config is not None and config.policy_loss.get("loss_mode", None) == "ar":
            ar_alpha_of(config)  # verl's PolicyLossConfig (no ar_alpha): refused here, not at the first update
        lopti, alpha = round_settings(config)
        if lopti is not None:
            check_lopti_actor(config, loss_is_ppo=getattr(loss_fn, "func", None) is ppo_loss)
        TrainingWorker.set_loss_fn(self, loss_fn)
        self.lopti, self.ar_alpha = lopti, alpha

    # -- collectives over the engine's data-parallel group (the scope of the quantile and of the counts) --------

    def _dp_group(self):
        group = self.engine.get_data_parallel_group()
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return None
        return group

    def _gather(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's 1-D ``values`` concatenated over every data-parallel rank (ranks may hold different counts)."""
        group = self._dp_group()
        if group is None:
            return values
        device = torch.device(get_device_name())
        local = values.detach().flatten().to(device)
        size = torch.tensor([local.numel()], dtype=torch.long, device=device)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(int(s) for s in sizes))
        padded = torch.zeros(longest, dtype=local.dtype, device=device)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[: int(s)] for part, s in zip(parts, sizes)]).cpu()

    def _all_reduce(self, sums: Dict[str, float]) -> Dict[str, float]:
        """Per-key sums over every data-parallel rank."""
        group = self._dp_group()
        if group is None:
            return sums
        keys = sorted(sums)
        values = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=get_device_name())
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
        return dict(zip(keys, values.cpu().tolist()))

    # -- the round ---------------------------------------------------------------------------------------------

    def plan(self, data: TensorDict) -> LoptiRound:
        """``algo.plan_round`` on this step's batch, over every data-parallel rank."""
        old, mask = data["old_log_probs"], data["response_mask"]
        return plan_round(old, mask, self.lopti, self.ar_alpha, gather=self._gather, all_reduce=self._all_reduce)

    @staticmethod
    def phase_batch(data: TensorDict, phase_mask: torch.Tensor) -> TensorDict:
        """The batch one phase trains on: ``response_mask`` = the phase's tokens, the others' advantages 0;
        everything else (``loss_mask`` and the non-tensor settings included) as in ``data``, in its layout.

        ``phase_mask``: bool, the layout of ``data["response_mask"]`` (``[batch, response_len]`` or jagged nested)."""
        part = data.copy()
        mask = data["response_mask"]
        part["response_mask"] = _keep_phase(mask, phase_mask, "response_mask")
        part["advantages"] = _keep_phase(data["advantages"], phase_mask, "advantages")
        return part

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
    def train_mini_batch(self, data: TensorDict) -> TensorDict:
        """One RL step: verl's ``train_mini_batch`` once per Lopti phase (module docstring)."""
        if self.lopti is None and self.ar_alpha == 0:
            return TrainingWorker.train_mini_batch(self, data)
        plan = self.plan(data)
        if self.last_round is None:  # once per worker: the layout verl hands it (use_v1=true: nested)
            layout = "nested (jagged rows)" if data["old_log_probs"].is_nested else "padded"
            print(f"[openrlhf-lopti] verl worker: the round's per-response fields are {layout}", flush=True)
        self.last_round = plan
        phases = [phase for phase in plan.phases if phase.tokens > 0]  # the same on every rank: global counts
        if self.lopti is None or not phases:
            return self._with_metrics(TrainingWorker.train_mini_batch(self, data), [], plan)
        schedule = RoundSchedule(getattr(self.engine, "lr_scheduler", None), getattr(self.engine, "optimizer", None))
        outputs = []
        for k, phase in enumerate(phases):
            if k == 0:
                schedule.start_round()
            else:
                schedule.start_phase()
            outputs.append((phase.name, TrainingWorker.train_mini_batch(self, self.phase_batch(data, phase.mask))))
        return self._with_metrics(outputs[-1][1], outputs, plan)

    @staticmethod
    def _with_metrics(output: Optional[TensorDict], phases: List[tuple], plan: LoptiRound) -> Optional[TensorDict]:
        """``output`` (the last pass's, or None on a rank that returns nothing) with the round's metrics."""
        if output is None:
            return None
        if not phases:
            merged = dict(tu.get(output, "metrics"))
        else:
            merged = merge_phase_metrics({name: tu.get(out, "metrics") for name, out in phases})
        merged.update(plan.metrics)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": merged}).cpu()


def merge_phase_metrics(phases: Dict[str, dict]) -> dict:
    """One metrics dict for the round from each phase's ``train_mini_batch`` metrics (name -> list of values).

    ``lopti/<phase>/<key>`` keeps each phase's list. Under verl's own key: for the losses (:data:`SHARE_METRICS`,
    each phase's value its share of the mini-batch's token mean) the element-wise sum over the phases, i.e. the
    round's loss per mini-batch as one pass would log it; for every other key the phases' lists one after the other
    (a mean is then over every optimizer step or micro-batch of the round).
    """
    merged: dict = {}
    for name, metrics in phases.items():
        for key, value in metrics.items():
            merged[f"lopti/{name}/{key}"] = list(value) if isinstance(value, list) else [value]
    keys = dict.fromkeys(key for metrics in phases.values() for key in metrics)
    for key in keys:
        lists = [merged[f"lopti/{name}/{key}"] for name in phases if f"lopti/{name}/{key}" in merged]
        if key in SHARE_METRICS and len({len(values) for values in lists}) == 1:
            merged[key] = [sum(values) for values in zip(*lists)]
        else:
            merged[key] = [value for values in lists for value in values]
    return merged
