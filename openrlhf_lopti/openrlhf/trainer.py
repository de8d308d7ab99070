"""``LoptiActorPPOTrainer``: OpenRLHF 0.11.2's ``ActorPPOTrainer`` with AR, Lopti phases and the fused policy loss.

What each flag changes, and where (the math itself is ``openrlhf_lopti.algo`` / ``openrlhf_lopti.ops``):

- ``--algo.ar.alpha``: ``alpha`` of ``fused_policy_loss``, or, with ``--actor.fused_loss off``,
  ``reweight_advantages`` on ``experience.advantages`` before upstream's ``PolicyLoss``
  (``training_step``). Logged as ``ar/mean_weight``.
- ``--algo.lopti.eta`` / ``.order`` / ``.quantile``: ``ppo_train`` runs upstream's ``ppo_train`` (epochs,
  micro-batches, optimizer steps) once per phase, in order; ``training_step`` replaces
  ``experience.action_mask`` by the phase's tokens (so policy loss, KL and entropy are masked to them) and
  zeroes the other tokens' advantages; each step's forward uses the weights as the earlier steps left them.
  ``experience.action_log_probs`` (the rollout policy's: the PPO anchor and the threshold's p) never change.
  Logged as ``lopti/low_token_frac``, ``lopti/threshold``, ``lopti/<phase>/<metric>`` and the phase's wall
  seconds ``lopti/<phase>/train_s``.
- ``--algo.lopti.denominator``: ``all`` applies the phase mask after the token-mean denominators are counted
  (every response token, as in the authors' code); ``phase`` applies it to the replay-buffer items before
  upstream's ``ppo_train`` counts them.
- ``--actor.fused_loss``: ``_fused_policy_loss`` routes upstream's ``training_step`` through
  ``fused_policy_loss`` (see its docstring): hooks on the ``Actor`` and on ``actor.model`` hand the kernel the
  model's logits in their own dtype and give upstream's step the kernel's log-probs and entropy, so no fp32
  ``[N, V]`` copy of the logits is made; ``off`` leaves upstream's ``PolicyLoss`` in place.
- ``--actor.fused_lm_head``: the same step through ``fused_linear_policy_loss`` on the last hidden states and
  the output layer (``fused.head_to_kernels``), so the logits are never made.
  Either way the kernels' value checks (NaN / +inf logits, non-finite advantages, ...) are read once per optimizer
  step, not per micro-batch (``check="step"``, ``ops/value_status.py``): ``_value_checks_before_the_step`` reads
  them at each accumulation boundary, before DeepSpeed's step, and every data-parallel rank raises the same line
  naming the rank, the RL step, the phase, the micro-batch and the row. The backend that ran is printed once.
- ``--algo.track_direction``: ``ppo_train`` ends with ``_direction_metrics``: one forward-only pass over the
  round's trained micro-batches after the update, logged as ``direction/*`` (``openrlhf_lopti.algo.direction``).
"""

import inspect
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler, Sampler

import openrlhf.trainer.ray.ppo_actor as ppo_actor
from openrlhf.models import aggregate_loss
from openrlhf.models.utils import masked_mean
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
from openrlhf.utils.loss_utils import get_loss_batch_info
from openrlhf.utils.utils import zero_pad_sequences
from openrlhf_lopti.algo import (
    PolicyLossOutput,
    RoundSchedule,
    direction_metrics,
    plan_round,
    reweight_advantages,
    sum_direction_counts,
)
from openrlhf_lopti.ops import LossOptions, StepChecks, fused_linear_policy_loss, fused_policy_loss
from openrlhf_lopti.ops.fused_policy_loss import resolve_backend

from .flags import check_config, fused_backend, fused_loss_blockers, lopti_config
from .fused import ActionRows, fused_log_probs, head_to_kernels, hf_model, lm_head_parts

# Upstream metrics that differ between Lopti phases: logged per phase as lopti/<phase>/<key>.
PER_PHASE_METRICS = (
    "policy_loss", "ppo_clip_ratio", "ppo_kl", "actor_grad_norm", "kl", "entropy_loss", "logprobs_diff",
)  # fmt: skip
# aggregate_loss values: with the "all" denominator a phase's loss is a sum over its tokens divided by every response
# token's count, so the phases' values add up to upstream's single pass. "kl" is one only with --algo.kl.use_loss;
# otherwise it is the rollout's KL (in the reward), the same every phase.
SHARE_METRICS = ("policy_loss", "kl", "entropy_loss")
# masked means over the phase's own tokens.
MEAN_METRICS = ("ppo_clip_ratio", "ppo_kl", "logprobs_diff", "vllm_kl", "is_filter_ratio")
EMPTY_PHASE_WEIGHT = 1e-6  # metric weight of a micro-batch with no token of the running phase


def merge_phase_status(
    statuses: Dict[str, dict], token_share: Dict[str, float], denominator: str, kl_is_loss: bool
) -> dict:
    """One status dict for the round from upstream's per-phase ``ppo_train`` results.

    Args:
        statuses: phase name -> the status dict upstream's ``ppo_train`` returned for that phase, in the
            order the phases ran.
        token_share: phase name -> its fraction of the batch's response tokens.
        denominator: ``"all"`` or ``"phase"`` (``--algo.lopti.denominator``).
        kl_is_loss: ``--algo.kl.use_loss``: ``kl`` is the KL loss (a per-token metric of the phase's tokens);
            otherwise it is the rollout's KL folded into the reward, the same in every phase.

    Returns:
        Every key of the last phase's status (rewards, lengths, rollout KL, learning rate and grad norm: the
        last optimizer step's, as upstream logs them), then ``lopti/<phase>/<key>`` for
        :data:`PER_PHASE_METRICS`, and the round's value of the per-token metrics: the token-weighted mean over
        phases. With the ``"all"`` denominator a loss (:data:`SHARE_METRICS`) comes from each phase per phase
        token (``training_step`` scales it so), its ``lopti/<phase>/<key>`` is the phase's share (value x token
        share), and the round's value is the sum of the shares: upstream's single pass.
    """
    merged = dict(statuses[list(statuses)[-1]])
    per_token = [key for key in SHARE_METRICS + MEAN_METRICS if key != "kl" or kl_is_loss]
    shares = [key for key in SHARE_METRICS if key in per_token] if denominator == "all" else []
    for name, status in statuses.items():
        for key in PER_PHASE_METRICS:
            if key in status:
                merged[f"lopti/{name}/{key}"] = token_share[name] * status[key] if key in shares else status[key]
    for key in per_token:
        values = {name: status[key] for name, status in statuses.items() if key in status}
        if not values:  # no phase reported it (e.g. entropy_loss with the entropy off): a 0 would read as measured
            continue
        weight = sum(token_share[name] for name in values)
        if key in shares:
            merged[key] = sum(token_share[name] * value for name, value in values.items())
        elif weight > 0:
            merged[key] = sum(token_share[name] * value for name, value in values.items()) / weight
    return merged


def _nonzero_denominators(loss_batch_info: dict) -> dict:
    # A window without any token of the phase (possible with --algo.lopti.denominator phase) counts 0 tokens;
    # its loss is a sum over nothing, so a denominator of 1 gives the right 0 instead of 0/0 = NaN gradients.
    fixed = dict(loss_batch_info)
    for key in ("batch_num_tokens", "global_batch_size"):
        if fixed.get(key) is not None:
            value = torch.as_tensor(fixed[key], dtype=torch.float32)
            fixed[key] = torch.where(value > 0, value, torch.ones_like(value))
    return fixed


class _RoundOrder(Sampler):
    """The sample order of one phase's pass of upstream's ``ppo_train``: epoch k of the round's first pass draws it
    as upstream's shuffled ``DataLoader`` does (a ``RandomSampler`` on torch's global RNG, at the same moment, so
    that pass is upstream's) and records it in ``orders``; epoch k of every later pass replays it."""

    def __init__(self, dataset, orders: list):
        self.shuffled = RandomSampler(dataset)  # refuses what upstream's DataLoader(shuffle=True) refuses, now
        self.orders = orders
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.shuffled)

    def __iter__(self) -> Iterator[int]:  # a generator: the draw happens at the first index, as RandomSampler's
        epoch, self.epoch = self.epoch, self.epoch + 1
        if epoch == len(self.orders):
            self.orders.append(list(self.shuffled))
        yield from self.orders[epoch]


class LoptiActorPPOTrainer(ActorPPOTrainer):
    """OpenRLHF's Ray actor trainer with Advantage Reweighting, Lopti and ``fused_policy_loss``.

    Same constructor as upstream's ``ActorPPOTrainer``; our settings come from ``strategy.args``
    (``openrlhf_lopti.openrlhf.flags``). With ``ar_alpha=0``, Lopti off and ``fused_loss=off`` every step is
    upstream's, unchanged.
    """

    def __init__(self, strategy, actor, *args, **kwargs):
        check_config(strategy.args)  # before upstream's __init__ opens the vLLM weight-sync group
        super().__init__(strategy, actor, *args, **kwargs)
        self.lopti = lopti_config(self.args)
        self.fused_backend: Optional[str] = fused_backend(self.args)
        if self.lopti.fused_lm_head:
            lm_head_parts(hf_model(self.actor), flag="--actor.fused_lm_head")  # raises now for a layer it cannot fuse
        if self.lopti.fused_loss == "auto" and self.fused_backend is None:
            self.strategy.print(
                "[openrlhf-lopti] --actor.fused_loss auto: using upstream's PolicyLoss because of "
                + "; ".join(fused_loss_blockers(self.args))
            )
        elif self.fused_backend is not None:
            device = torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu")
            chosen = resolve_backend(self.fused_backend, device)
            self.strategy.print(f"[openrlhf-lopti] fused policy loss: --actor.fused_loss {self.fused_backend} -> {chosen}")
        self._explicit_boundaries = False  # set by _passes_end_on_optimizer_steps, read by training_step
        self.lopti_phase: Optional[str] = None  # the Lopti phase running now: set by ppo_train, read by training_step
        self.lopti_threshold: float = self.lopti.lopti_eta  # this round's probability threshold (eta or quantile)
        # replay item id -> phase name -> bool mask of the item's tokens in that phase, as this round decided them
        self._phase_tokens: Dict[int, Dict[str, torch.Tensor]] = {}
        # replay item id -> its whole response mask, while --algo.lopti.denominator phase masks the items to a phase
        self._whole_responses: Dict[int, torch.Tensor] = {}
        self.rl_step = 0  # RL steps trained (ppo_train calls); LoptiPolicyModelActor sets it on resume
        self._micro_batch = ""  # where training_step is, for error messages
        self._value_checks = StepChecks()  # the fused loss's value checks since the last optimizer step
        self._backend_ran: Optional[str] = None  # printed once, at the first fused call

    # ------------------------------------------------------------------ Lopti rounds
    def ppo_train(self, kl_ctl: float) -> Dict[str, float]:
        """Upstream's ``ppo_train``, once per Lopti phase in order when Lopti is on, plus our round metrics.

        With AR or Lopti on, every pass of upstream's ``ppo_train`` ends on an optimizer step (see
        :meth:`_passes_end_on_optimizer_steps`), and the LR schedule moves once per RL step as upstream's single
        pass moves it: each later phase starts from the schedule's state at the start of the step, so each phase
        trains with the learning rates upstream's pass would use, and the step ends where upstream's ends.
        """
        self.rl_step += 1
        status = self._ppo_train(kl_ctl)
        if self.lopti.track_direction:
            status.update(self._direction_metrics())
        return status

    def _ppo_train(self, kl_ctl: float) -> Dict[str, float]:
        if self.lopti.ar_alpha == 0 and not self.lopti.lopti_enabled:
            return super().ppo_train(kl_ctl)
        items = self.replay_buffer.items
        # The round is algo.plan_round's over every data-parallel rank's items (every rank takes part in its
        # collectives, even one with an empty buffer); each token's phase is decided there once, and every later
        # use (the "phase" denominators, each micro-batch's step on the device) reads that decision.
        old_log_probs = torch.cat([torch.zeros(0)] + [i.action_log_probs.flatten().cpu().float() for i in items])
        response = torch.cat([torch.zeros(0, dtype=torch.bool)] + [i.action_mask.flatten().cpu().bool() for i in items])
        lopti_round = plan_round(
            old_log_probs, response, self.lopti.lopti, self.lopti.ar_alpha,
            gather=self._gather_over_dp, all_reduce=self._sum_metrics_over_dp,
        )  # fmt: skip
        metrics = dict(lopti_round.metrics)
        if not self.lopti.lopti_enabled or sum(phase.tokens for phase in lopti_round.phases) == 0:
            with self._passes_end_on_optimizer_steps():
                return {**super().ppo_train(kl_ctl), **metrics}

        self.lopti_threshold = lopti_round.threshold
        sizes = [item.action_log_probs.numel() for item in items]
        per_phase = {phase.name: phase.mask.split(sizes) for phase in lopti_round.phases}
        self._phase_tokens = {
            id(item): {name: parts[i].reshape(item.action_log_probs.shape) for name, parts in per_phase.items()}
            for i, item in enumerate(items)
        }
        tokens = sum(phase.tokens for phase in lopti_round.phases)
        share = {phase.name: phase.tokens / tokens for phase in lopti_round.phases}
        statuses = {}
        orders: list = []  # each epoch's sample order, drawn by the first phase, replayed by the second
        schedule = RoundSchedule(self.actor_scheduler)
        schedule.start_round()
        for phase in lopti_round.phases:
            name = phase.name
            if phase.tokens == 0:  # same decision on every rank: the counts are global
                self.strategy.print(f"[openrlhf-lopti] Lopti: no '{name}' tokens in this batch, phase skipped")
                continue
            self.strategy.print(f"[openrlhf-lopti] Lopti phase '{name}': {share[name]:.1%} of the tokens")
            if statuses:  # a later phase: upstream's single pass would not have moved the schedule yet
                schedule.start_phase()
            self.lopti_phase = name
            started = time.perf_counter()
            try:
                with self._replay_items_in_phase() if self.lopti.lopti_denominator == "phase" else nullcontext():
                    with self._passes_end_on_optimizer_steps(), self._batches_carry_phases():
                        with self._aux_loss_scaled(share[name]), self._phases_share_the_sample_order(orders):
                            statuses[name] = super().ppo_train(kl_ctl)
            finally:
                self.lopti_phase = None
            metrics[f"lopti/{name}/train_s"] = time.perf_counter() - started  # wall seconds of the phase's pass
        merged = merge_phase_status(statuses, share, self.lopti.lopti_denominator, self.args.algo.kl.use_loss)
        return {**merged, **metrics}

    def _sum_over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (any shape) summed over the data-parallel ranks, a float64 copy.

        The ranks of one ring-attention or tensor-parallel group hold the same experience, so a sum over every rank
        (``strategy.all_reduce``) would count it once per rank of the group. float64: token counts stay exact past
        2^24."""
        if not (dist.is_available() and dist.is_initialized()):
            return values.to(torch.float64, copy=True)
        # on the device the backend reduces on, as upstream's strategy.all_reduce does (utils/deepspeed/deepspeed.py)
        total = values.to(device=torch.cuda.current_device(), dtype=torch.float64, copy=True)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.strategy.ds_device_mesh["dp"].get_group())
        return total

    def _sum_metrics_over_dp(self, sums: Dict[str, float]) -> Dict[str, float]:
        """The round's metric sums (``plan_round``'s ``all_reduce``), each summed over the data-parallel ranks."""
        keys = list(sums)
        total = self._sum_over_dp(torch.tensor([float(sums[key]) for key in keys], dtype=torch.float64))
        return dict(zip(keys, total.tolist()))

    def _gather_over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """``[n]`` CPU tensor -> every data-parallel rank's, concatenated (the quantile's scope)."""
        if not (dist.is_available() and dist.is_initialized()):
            return values
        group = self.strategy.ds_device_mesh["dp"].get_group()
        gathered = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(gathered, values, group=group)
        return torch.cat(gathered)

    @torch.no_grad()
    def _direction_metrics(self) -> Dict[str, float]:
        """``direction/*`` of this round's update (``--algo.track_direction``), summed over data-parallel ranks.

        One forward-only pass over the replay buffer with the updated weights, made the way experience making
        made the rollout log-probs (eval mode; our kernels when the fused loss is on), so that only the update
        moves a token's log-prob. Its micro-batches are a training pass's, in order: upstream's loader without the
        shuffle (``drop_last``, dynamic batches), so every data-parallel rank runs as many forwards as its
        training passes did; under ZeRO-3 each forward is a collective, and a rank with one more (a remainder
        upstream does not train) would wait forever. Costs one forward pass over the step's trained experience.
        """
        device = torch.cuda.current_device()
        kernels = self.fused_backend is not None
        buffer, batches = self.replay_buffer, []
        loader = DataLoader(buffer, batch_size=buffer.sample_batch_size, drop_last=True, collate_fn=buffer.collate_fn)
        self.actor.eval()
        try:
            with fused_log_probs(self.actor, self.fused_backend, self.lopti.fused_lm_head) if kernels else nullcontext():
                for experience in loader:
                    experience = experience.to_device(device)
                    new = self.actor(experience.sequences, experience.action_mask, experience.attention_mask)
                    old, mask = experience.action_log_probs, experience.action_mask
                    batches.append((old, new, experience.advantages, mask))
        finally:
            self.actor.train()
        counts = sum_direction_counts(batches, device=device)
        return direction_metrics(self._sum_over_dp(counts))

    @contextmanager
    def _aux_loss_scaled(self, share: float) -> Iterator[None]:
        """A MoE model's router-balancing loss (``--actor.aux_loss_coef``) at ``share`` of its coefficient for one phase.

        Upstream's ``training_step`` adds ``aux_loss * aux_loss_coef`` in every micro-batch of every pass, and the
        aux loss is over all the micro-batch's tokens whatever the phase; each phase then weighs it by its share
        of the round's tokens, so that over the round it counts once, as in upstream's single pass.
        """
        actor_args = self.args.actor
        coef = actor_args.aux_loss_coef
        actor_args.aux_loss_coef = coef * share
        try:
            yield
        finally:
            actor_args.aux_loss_coef = coef

    @contextmanager
    def _passes_end_on_optimizer_steps(self) -> Iterator[None]:
        """DeepSpeed's accumulation windows restart with each pass of upstream's ``ppo_train`` and its last window
        ends on an optimizer step, as ``iter_grad_accum_global_norm``'s loss normalisers assume.

        DeepSpeed counts micro-steps over the whole run, so when a pass has a number of micro-batches that is
        not a multiple of ``gas`` (e.g. the short last batch of an episode), its last window would otherwise
        take gradients from the next pass: the other Lopti phase or the next RL step. ``training_step`` sets the
        boundary of each micro-batch explicitly (:meth:`_set_accumulation_boundary`); dynamic batching decides
        its own optimizer steps and is left alone.
        """
        self._explicit_boundaries = not self.args.train.dynamic_batch_enable
        try:
            yield
        finally:
            self._explicit_boundaries = False
            engine = self.actor.model
            if hasattr(engine, "set_gradient_accumulation_boundary"):
                engine._is_gradient_accumulation_boundary = None  # back to DeepSpeed's own micro-step counter

    def _set_accumulation_boundary(self, step: int) -> None:
        """Micro-batch ``step`` of this epoch ends a window if it is the ``gas``-th of it or the epoch's last.

        ``--train.enable_ema`` follows the same windows: upstream's ``moving_average`` (called after every
        micro-batch) counts micro-batches itself and updates when its count, incremented first, is a multiple of
        ``gas``; the count is set here so that this happens exactly when DeepSpeed steps.
        """
        per_epoch = len(self.replay_buffer) // self.replay_buffer.sample_batch_size  # DataLoader(drop_last=True)
        gas = max(int(self.strategy.accumulated_gradient), 1)
        boundary = (step + 1) % gas == 0 or step + 1 >= per_epoch
        self.actor.model.set_gradient_accumulation_boundary(boundary)
        if self.ema_model is not None:
            self.strategy.time_steps["ema"] = gas - 1 if boundary else 0  # gas > 1 here whenever boundary is False

    def _phase_mask(self, action_mask: torch.Tensor, phase_tokens: torch.Tensor) -> torch.Tensor:
        """Bool mask (shape of ``action_mask``) of the running phase's tokens: ``phase_tokens``, the round's mask of
        that phase (same shape, from ``plan_round`` in ``_ppo_train``), read as it is, never re-derived."""
        return action_mask.bool() & phase_tokens.to(action_mask.device).bool()

    @contextmanager
    def _batches_carry_phases(self) -> Iterator[None]:
        """Each micro-batch upstream's ``ppo_train`` collates carries the running phase's tokens, as the round decided
        them, as ``experience.lopti_phase_tokens`` (padded like ``action_mask``; ``Experience.to_device`` moves it
        with the rest)."""
        buffer = self.replay_buffer
        collate = buffer.collate_fn

        def collate_with_phases(batch):
            experience = collate(batch)
            items = batch[0] if buffer.dynamic_batch else batch  # dynamic batching hands one list of items
            tokens = [self._phase_tokens[id(item)][self.lopti_phase] for item in items]
            experience.lopti_phase_tokens = zero_pad_sequences(tokens, "right", stack=True)
            if self._whole_responses:  # --algo.lopti.denominator phase: action_mask is the phase's; the gate's mask
                whole = [self._whole_responses[id(item)] for item in items]
                experience.lopti_response_mask = zero_pad_sequences(whole, "right", stack=True)
            return experience

        buffer.collate_fn = collate_with_phases  # upstream's DataLoader takes it when ppo_train builds one
        try:
            yield
        finally:
            del buffer.collate_fn  # the class's own again

    @contextmanager
    def _phases_share_the_sample_order(self, orders: list) -> Iterator[None]:
        """Every phase of the round trains the same samples in the same micro-batches, epoch by epoch.

        Upstream's ``ppo_train`` builds a shuffled ``DataLoader(drop_last=True)`` per pass: each phase would draw its
        own order and, when the buffer is not a multiple of the micro-batch size, drop its own random remainder, so
        some responses would train only their low or only their high tokens. Here the first phase's pass draws
        upstream's order and records it (:class:`_RoundOrder`); the later phases replay it. An unshuffled pass
        (ring attention, tensor parallel, dynamic batching) is left as upstream builds it."""
        data_loader = ppo_actor.DataLoader

        def same_order(dataset, *args, shuffle=False, **kwargs):
            if shuffle:
                kwargs["sampler"] = _RoundOrder(dataset, orders)
            return data_loader(dataset, *args, **kwargs)

        ppo_actor.DataLoader = same_order  # what upstream's ppo_train calls
        try:
            yield
        finally:
            ppo_actor.DataLoader = data_loader

    @contextmanager
    def _replay_items_in_phase(self) -> Iterator[None]:
        """Mask the replay-buffer items to the running phase, so upstream's ``ppo_train`` (and dynamic
        batching) count only the phase's tokens in the token-mean denominators."""
        items = self.replay_buffer.items
        saved = [item.action_mask for item in items]
        self._whole_responses = {id(item): mask for item, mask in zip(items, saved)}  # for the sequence gate
        try:
            for item in items:
                phase_tokens = self._phase_tokens[id(item)][self.lopti_phase]
                item.action_mask = self._phase_mask(item.action_mask, phase_tokens).to(item.action_mask.dtype)
            yield
        finally:
            self._whole_responses = {}
            for item, mask in zip(items, saved):
                item.action_mask = mask

    # ------------------------------------------------------------------ one micro-batch
    def training_step(
        self, experience: Experience, kl_ctl: float, step: int, loss_batch_info: Optional[Dict] = None
    ) -> Dict[str, float]:
        """Upstream's ``training_step`` on the running Lopti phase's tokens, with AR and the fused loss."""
        if loss_batch_info is None:
            # Upstream's training_step makes this same call when it gets None (dynamic batching); making it
            # here, before the phase mask replaces action_mask, keeps the denominators at all response tokens.
            loss_batch_info = get_loss_batch_info(
                self.strategy,
                experience.action_mask,
                replay_buffer=self.replay_buffer,
                step=step,
                dynamic_batch=self.args.train.dynamic_batch_enable,
            )
        if self._explicit_boundaries:
            self._set_accumulation_boundary(step)
        phase = f", Lopti phase '{self.lopti_phase}'" if self.lopti_phase else ""
        self._micro_batch = f"RL step {self.rl_step}{phase}, micro-batch {step + 1} of the epoch"
        response_mask, advantages = experience.action_mask, experience.advantages
        try:
            if self.lopti_phase is not None:
                phase = self._phase_mask(response_mask, experience.lopti_phase_tokens)
                experience.action_mask = phase.to(response_mask.dtype)
                experience.advantages = advantages * phase  # the other phase's tokens get no policy gradient
                loss_batch_info = _nonzero_denominators(loss_batch_info)
            if self.fused_backend is None:
                if self.lopti.ar_alpha > 0:
                    experience.advantages = reweight_advantages(
                        experience.advantages, experience.action_log_probs, self.lopti.ar_alpha
                    )
                whole = getattr(experience, "lopti_response_mask", None)  # the phase denominator's replay
                with self._sequence_gate_on_the_whole_response(response_mask if whole is None else whole):
                    status = super().training_step(experience, kl_ctl, step, loss_batch_info)
            else:
                with self._fused_policy_loss(experience), self._value_checks_before_the_step():
                    status = super().training_step(experience, kl_ctl, step, loss_batch_info)
        finally:
            experience.action_mask, experience.advantages = response_mask, advantages
        if self.lopti_phase is not None and self.lopti.lopti_denominator == "all":
            self._losses_per_phase_token(status, response_mask)
        if status["num_action_tokens"] == 0:
            # A micro-batch without tokens of this phase still runs (its zero loss keeps the optimizer-step
            # windows aligned), but its masked means are 0/0 and upstream's ppo_train divides its token-weighted
            # metrics by this count: report zeros with a negligible weight instead.
            status["metrics"] = {
                key: torch.nan_to_num(value, nan=0.0) if isinstance(value, torch.Tensor) else value
                for key, value in status["metrics"].items()
            }
            status["num_action_tokens"] = EMPTY_PHASE_WEIGHT
        return status

    def _losses_per_phase_token(self, status: dict, response_mask: torch.Tensor) -> None:
        """A phase's losses of this micro-batch (:data:`SHARE_METRICS`), scaled from "a sum over the phase's tokens /
        every response token's count" to per phase token: x (response tokens / phase tokens) of the micro-batch.

        Upstream's ``ppo_train`` weights each micro-batch's value by its ``num_action_tokens``, here the phase's
        tokens, where its single pass weights by every response token: unscaled, a phase's sum over micro-batches
        whose mix of low and high tokens differs was off (up to 2x the single pass with skewed micro-batches, and
        the KL loss feeds ``--algo.kl.target``'s controller). Scaled, ``merge_phase_status``'s token-share sum is
        upstream's single-pass value."""
        phase_tokens = float(status["num_action_tokens"])
        scale = float(response_mask.sum()) / phase_tokens if phase_tokens > 0 else 0.0
        for key in SHARE_METRICS:
            if key in status["metrics"] and (key != "kl" or self.args.algo.kl.use_loss):
                status["metrics"][key] = status["metrics"][key] * scale

    @contextmanager
    def _fused_policy_loss(self, experience: Experience) -> Iterator[None]:
        """Run upstream's ``training_step`` with our kernels producing the policy loss (and entropy).

        Upstream's step calls ``self.actor(sequences, action_mask, ..., return_entropy=...)`` for the action
        log-probs (and ``output.entropy``), then ``self.actor_loss_fn(...)`` for the policy loss. For this one
        step:

        - a forward pre-hook on the ``Actor`` passes ``action_mask=None`` and ``return_entropy=False``, so
          ``Actor.forward`` makes neither its log-prob pass nor its entropy pass and returns the model output;
        - :func:`~.fused.head_to_kernels` runs ``fused_policy_loss`` on the model's logits in their own dtype
          (the kernel divides by the actor's ``temperature`` itself), or, with ``--actor.fused_lm_head``,
          ``fused_linear_policy_loss`` on the last hidden states and the output layer, so the logits never
          exist; ``Actor.forward`` then gets empty logits, so no fp32 ``[N, V]`` copy is ever made;
        - a forward hook on the ``Actor`` returns the fused log-probs as the action log-probs (upstream's KL
          term and metrics then use them, and gradients flow through them) and, when upstream asked for
          entropy, sets ``output.entropy`` to the fused per-token entropy (0 outside the micro-batch's
          ``action_mask``, which upstream's entropy loss masks out anyway);
        - ``actor_loss_fn`` aggregates the fused per-token loss the way ``PolicyLoss`` does.

        Everything else in the step (KL, entropy loss, aux loss, backward, optimizer step, EMA, metrics) is
        upstream's code. Hooks rather than a copy of ``training_step`` / ``Actor.forward``: they stay upstream's.
        """
        actor, policy_loss = self.actor, self.actor_loss_fn
        rows = ActionRows(
            experience.sequences, experience.attention_mask, experience.action_mask,
            getattr(actor, "packing_samples", False),
        )  # fmt: skip
        old, advantages = rows.rows(experience.action_log_probs.float()), rows.rows(experience.advantages.float())
        options = LossOptions(
            alpha=self.lopti.ar_alpha, eps_low=policy_loss.clip_eps_low, eps_high=policy_loss.clip_eps_high,
            dual_clip=policy_loss.dual_clip, temperature=actor.temperature, backend=self.fused_backend, check="step",
        )  # fmt: skip
        step: Dict[str, object] = {}  # what the hooks of this one forward pass to each other

        def logits_only(module, args, kwargs):
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
            step["entropy"] = bool(bound.arguments.get("return_entropy", False))
            bound.arguments["action_mask"] = None
            bound.arguments["return_entropy"] = False  # the kernel computes it; Actor.forward's logits are empty
            return bound.args, bound.kwargs

        def checked(compute: Callable[[], PolicyLossOutput]) -> PolicyLossOutput:
            # Shapes and options are checked at once (the same on every rank: they follow the batch's layout and
            # the flags); values only set status bits, read before the optimizer step on every rank together.
            out = compute()
            self._value_checks.add(out.status, self._micro_batch)
            if self._backend_ran is None:
                self._backend_ran = out.backend
                self.strategy.print(f"[openrlhf-lopti] fused policy loss ran on the {out.backend} backend; value "
                                    "checks are read once per optimizer step")  # fmt: skip
            return out

        def on_logits(logits: torch.Tensor) -> PolicyLossOutput:
            flat = logits.reshape(-1, logits.shape[-1])  # a view: no copy of the [N, V] logits
            return checked(
                lambda: fused_policy_loss(
                    flat, rows.labels, old, advantages, rows.mask, return_entropy=step["entropy"], options=options
                )
            )

        def on_hidden(hidden: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
            flat = hidden.reshape(-1, hidden.shape[-1])
            out = checked(
                lambda: fused_linear_policy_loss(
                    flat, weight, rows.labels, old, advantages, rows.mask, bias=bias,
                    return_entropy=step["entropy"], options=options,
                )  # fmt: skip
            )
            step["detached"] = out.kl, out.clipped
            entropy = out.entropy if out.entropy is not None else torch.zeros_like(out.loss)
            return torch.stack([out.loss, out.logp, entropy], -1).reshape(*hidden.shape[:-1], 3)

        def fused_action_log_probs(module, args, kwargs, output):
            if "columns" in found:  # the fused lm_head's per-position loss, log-prob, entropy
                columns = found.pop("columns").reshape(-1, 3)
                kl, clipped = step.pop("detached")
                entropy = columns[:, 2] if step["entropy"] else None
                out = PolicyLossOutput(loss=columns[:, 0], logp=columns[:, 1], kl=kl, clipped=clipped, entropy=entropy)
            else:
                out = found.pop("result")
            step["out"] = PolicyLossOutput(
                loss=rows.to_actions(out.loss),
                logp=rows.to_actions(out.logp),
                kl=rows.to_actions(out.kl),
                clipped=rows.to_actions(out.clipped),
                entropy=None if out.entropy is None else rows.positions(out.entropy)[:, :-1],
            )
            if step["entropy"]:
                output.entropy = step["out"].entropy  # upstream's training_step reads output.entropy[:, -A:]
            return step["out"].logp, output

        def aggregated_loss(log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, **info):
            out = step.pop("out")
            loss = aggregate_loss(out.loss, action_mask, token_level_loss=policy_loss.token_level_loss, **info)
            clip_ratio = masked_mean(out.clipped.float(), action_mask, dim=None)
            ppo_kl = masked_mean(-(log_probs - old_log_probs).detach(), action_mask, dim=None)
            return loss, clip_ratio, ppo_kl, None, None

        with head_to_kernels(actor, self.lopti.fused_lm_head, on_logits, on_hidden) as found:
            handles = [
                actor.register_forward_pre_hook(logits_only, with_kwargs=True),
                actor.register_forward_hook(fused_action_log_probs, with_kwargs=True),
            ]
            self.actor_loss_fn = aggregated_loss
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()
                self.actor_loss_fn = policy_loss

    @contextmanager
    def _sequence_gate_on_the_whole_response(self, response_mask: torch.Tensor) -> Iterator[None]:
        """In a Lopti phase, upstream's sequence-level importance-sampling gate (``--algo.advantage.is_correction_level
        seq``) reads the whole response, as it does without Lopti, not the phase's tokens.

        Upstream's ``PolicyLoss`` gates each sequence on ``masked_mean(log pi_train - log pi_rollout, action_mask)``,
        and in a phase ``action_mask`` holds the phase's tokens only: each sequence would be kept or dropped on part
        of its tokens, differently per phase, and one with no token of the phase counted as filtered. Here the loss
        call gets the whole response as its mask: the other phase's tokens have advantage 0, so they add exactly 0
        to the loss and to its token-mean sum (``check_config`` allows token-mean aggregation only with this), and the
        gate, ``vllm_kl`` and the filtered share are upstream's over the whole response. ``ppo_clip_ratio`` and
        ``ppo_kl`` stay the phase's: they come from a second, gradient-free call on the phase's mask.
        """
        policy_loss = self.actor_loss_fn
        if self.lopti_phase is None or getattr(policy_loss, "is_correction_level", "off") != "seq":
            yield
            return

        def gated_on_the_whole_response(log_probs, old_log_probs, advantages, action_mask=None, **info):
            loss, _, _, vllm_kl, filtered = policy_loss(log_probs, old_log_probs, advantages, response_mask, **info)
            with torch.no_grad():
                _, clip_ratio, ppo_kl, _, _ = policy_loss(log_probs, old_log_probs, advantages, action_mask, **info)
            return loss, clip_ratio, ppo_kl, vllm_kl, filtered

        self.actor_loss_fn = gated_on_the_whole_response
        try:
            yield
        finally:
            self.actor_loss_fn = policy_loss

    @contextmanager
    def _value_checks_before_the_step(self) -> Iterator[None]:
        """Upstream's ``training_step`` with the fused loss's value checks read right before each real optimizer
        step (an accumulation boundary of the DeepSpeed engine), on every rank: no rank updates weights from a
        bad row, and no rank is left alone in a collective."""
        strategy = self.strategy
        optimizer_step = strategy.optimizer_step

        def checked_step(optimizer, model, scheduler, *args, **kwargs):
            engine = getattr(model, "model", model)
            if getattr(engine, "is_gradient_accumulation_boundary", lambda: True)():
                self._raise_on_every_rank_if_any_failed()
            return optimizer_step(optimizer, model, scheduler, *args, **kwargs)

        strategy.optimizer_step = checked_step
        try:
            yield
        finally:
            strategy.optimizer_step = optimizer_step

    def _raise_on_every_rank_if_any_failed(self) -> None:
        """Read the value checks of every fused call since the last optimizer step and raise on every data-parallel
        rank if any rank found a bad row, naming that rank, the call and the row.

        One scalar all-reduce (a host sync) per optimizer step, over every rank; the messages are gathered only
        when a rank failed.
        """
        checks, self._value_checks = self._value_checks, StepChecks()
        error = None
        try:
            checks.raise_if_bad()
        except ValueError as exc:
            error = exc
        failed = self.strategy.all_reduce(0.0 if error is None else 1.0, op="max")  # over every rank
        if not failed:
            return
        distributed = dist.is_available() and dist.is_initialized()
        message = None if error is None else f"rank {dist.get_rank() if distributed else 0}: {error}"
        messages = [message]
        if distributed:
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, message)
        first = next(m for m in messages if m is not None)
        raise ValueError(f"fused_policy_loss found a bad input before the optimizer step, on {first}") from error
