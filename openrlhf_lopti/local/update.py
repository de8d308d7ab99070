"""The policy update on one batch of experience: Lopti phases x epochs x mini-batches x micro-batches.

The per-token loss is :func:`openrlhf_lopti.ops.fused_policy_loss` (AR is its ``alpha``) and the phases
are :func:`openrlhf_lopti.algo.plan_round`'s: the same round the OpenRLHF, TRL and verl front ends drive. A Lopti round
(PAPER_NOTES.md §4, the authors' code):

- phase k trains on its tokens only: other tokens' advantages are zeroed AND the phase mask is the
  loss mask, so their clipped surrogate, KL and entropy all drop out;
- the token-mean denominator is every response token of the mini-batch in both phases, not the
  phase's count, so the two phases together weigh tokens as one plain GRPO pass does;
- ``old_log_probs`` stay the rollout's, while phase 2's forward runs on the weights phase 1 updated;
- both phases step one optimizer, so phase 2's AdamW step also carries the first moment phase 1 just filled.
  ``lopti_moments="per-phase"`` (opt-in, not the paper's) gives each phase its own optimizer instead
  (:func:`build_optimizers`), whose moments only ever see that phase's gradients;
- each phase takes a full optimizer step, so under AdamW (steps of about ``lr`` per coordinate whatever the
  gradient's size) Lopti moves the weights about twice as far per mini-batch as GRPO; under SGD the two steps
  add up to GRPO's one. ``lopti_lr_scale`` (opt-in, not the paper's) scales Lopti's steps (``cfg.step_lr``).

What cannot change the update is not computed (:func:`phase_part`): a response without a token of the running
phase adds exactly 0 to the loss and to every gradient (its tokens are all masked), so it gets no forward and
no backward, nor does a micro-batch made only of such responses; the rest runs up to the micro-batch's last
token of the phase only (a causal LM's earlier outputs do not depend on later tokens), and the lm_head (with
``fused_lm_head``) and the loss only on the phase's tokens. A mini-batch made only of skipped micro-batches
still takes its optimizer step, on zero gradients, as it would unskipped (AdamW's moments and weight decay
move the weights even then). One difference is left: a trainable parameter the loss never reaches (none in a
Hugging Face causal LM, where every parameter feeds the logits) gets a zero gradient in that step instead of
none, so AdamW steps it where unskipped it would not (TESTING.md, survivors of ``local/update.py``).
"""

import math
import time
from typing import Optional, Sequence, Union

import torch

from openrlhf_lopti.algo import LoptiRound, plan_round
from openrlhf_lopti.ops import LossOptions, StepChecks, fused_linear_policy_loss, fused_policy_loss

from .config import TrainConfig
from .experience import Experience
from openrlhf_lopti.models import lm_head_parts
from .rollout import Rollout, response_hidden, response_logits


def build_optimizers(params: list, cfg: TrainConfig) -> list:
    """The optimizers of a run over ``params``: ``cfg.optimizer`` (AdamW, or SGD with ``cfg.momentum``) at
    ``cfg.step_lr``; one, or one per Lopti phase (same parameters, separate state) with
    ``lopti_moments="per-phase"``."""
    count = 2 if cfg.lopti and cfg.lopti_moments == "per-phase" else 1
    if cfg.optimizer == "sgd":
        return [torch.optim.SGD(params, lr=cfg.step_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
                for _ in range(count)]  # fmt: skip
    return [torch.optim.AdamW(params, lr=cfg.step_lr, weight_decay=cfg.weight_decay) for _ in range(count)]


def plan_lopti_round(exp: Experience, cfg: TrainConfig) -> LoptiRound:
    """The batch's round (``algo.plan_round`` on one process): Lopti's two phases in order, or the whole response
    mask as one phase "all"; its metrics are ``ar/mean_weight``, ``lopti/threshold``, ``lopti/low_token_frac``..."""
    return plan_round(exp.old_log_probs, exp.rollout.action_mask, cfg.lopti_settings, cfg.alpha)


def phase_part(rollout: Rollout, rows: torch.Tensor, phase: torch.Tensor) -> Optional[tuple]:
    """What of micro-batch ``rows`` (``[b]`` indices) the loss of a phase (``phase [B, T]`` bool) depends on.

    Returns:
        None when the micro-batch holds no token of the phase; else ``(part, rows, tokens)``: the sub-rollout of
        the responses holding one, each cut after the micro-batch's last such token (``t`` response tokens),
        their indices ``[b']``, and ``tokens [b', t]``, the phase's tokens among them.
    """
    tokens = phase[rows]
    holding = tokens.any(-1)
    if not bool(holding.any()):
        return None
    rows, tokens = rows[holding], tokens[holding]
    columns = int(tokens.any(0).nonzero().max()) + 1
    return rollout.select(rows).first_tokens(columns), rows, tokens[:, :columns]


def update_policy(
    policy,
    optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
    exp: Experience,
    cfg: TrainConfig,
    generator: Optional[torch.Generator] = None,
) -> dict:
    """Train ``policy`` on ``exp``; returns the update's metrics.

    ``optimizer`` steps every phase, or, a list from :func:`build_optimizers`, holds one optimizer per phase.

    Each phase runs ``cfg.epochs`` passes over the batch in shuffled mini-batches of
    ``cfg.mini_batch_size`` responses, one optimizer step each, accumulating gradients over
    micro-batches of ``cfg.micro_batch_size`` responses. ``generator`` drives the shuffling.

    Returns:
        ``loss`` (token-mean over the batch's response tokens, summed over phases, averaged over epochs),
        ``clip_ratio`` and ``entropy`` (token means over trained tokens), ``grad_norm`` (mean over
        optimizer steps, before clipping), ``optimizer_steps``; the round's metrics (``ar/mean_weight`` with AR;
        ``lopti/threshold``, ``lopti/low_token_frac``, ``lopti/<phase>/tokens`` with Lopti: ``algo.plan_round``);
        with Lopti also, per phase (``low``, ``high``) that has tokens, ``lopti/<phase>/policy_loss`` (its share of
        the token-mean policy loss, averaged over epochs, without the KL term: OpenRLHF's and verl's
        ``policy_loss``), ``lopti/<phase>/clip_ratio``, ``lopti/<phase>/grad_norm`` and ``lopti/<phase>/train_s``
        (wall seconds); an empty phase logs its ``lopti/<phase>/tokens`` (0) only; ``loss_backend``, the kernel
        backend that ran (a string: the caller prints it).

    The loss head is the one-pass form (``loss_weights``: each token's share of the mini-batch's token mean, known
    up front; on the logits path the kernel writes the gradient over the trained rows' logits, a copy: Triton in its
    forward, C++ in its backward),
    and its value checks are read once per optimizer step, before it (``check="step"``): a NaN logit or
    a non-finite advantage raises there, naming the phase, the mini-batch and the row, before any weight moves.
    """
    rollout = exp.rollout
    batch = len(rollout)
    params = [p for p in policy.parameters() if p.requires_grad]
    total_tokens = int(rollout.action_mask.sum())
    micro = cfg.micro_batch_size or cfg.mini_batch_size
    kl_coef = cfg.kl_coef if cfg.estimator == "grpo" else 0.0  # REINFORCE++ has its KL in the reward
    ref = exp.ref_log_probs if kl_coef != 0 else None
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    loss_options = LossOptions(alpha=cfg.alpha, eps_low=cfg.eps_low, eps_high=cfg.eps_high, kl_coef=kl_coef,
                               kl_estimator=cfg.kl_estimator, temperature=cfg.temperature, backend=cfg.loss_backend,
                               check="step")  # fmt: skip
    checks = StepChecks()
    backend = None

    metrics = {"loss": 0.0, "optimizer_steps": 0}
    clipped_all = entropy_all = trained_all = 0.0
    norms_all = []
    policy.train()
    lopti_round = plan_lopti_round(exp, cfg)
    phases = lopti_round.phases
    metrics.update(lopti_round.metrics)
    optimizers = list(optimizer) if isinstance(optimizer, Sequence) else [optimizer]
    if len(optimizers) not in (1, len(phases)):
        raise ValueError(f"optimizer: one, or one per phase ({len(phases)}), got {len(optimizers)}")
    for k, (name, phase, phase_tokens) in enumerate(((p.name, p.mask, p.tokens) for p in phases), start=1):
        optimizer = optimizers[(k - 1) % len(optimizers)]
        start = time.perf_counter()
        loss_sum = policy_sum = clipped = entropy = 0.0
        norms = []
        if phase_tokens:  # an empty phase is skipped but keeps its number
            advantages = exp.advantages * phase
            for _ in range(cfg.epochs):
                order = torch.randperm(batch, generator=generator).to(rollout.sequences.device)
                for m, mini in enumerate(order.split(cfg.mini_batch_size), start=1):
                    optimizer.zero_grad(set_to_none=True)
                    denom = rollout.action_mask[mini].sum().clamp(min=1)
                    for micro_rows in mini.split(micro):
                        trimmed = phase_part(rollout, micro_rows, phase)
                        if trimmed is None:  # no token of this phase: loss and gradients are 0
                            continue
                        part, part_rows, rows = trimmed  # rows [b, t]: the phase's tokens, the loss head's rows
                        columns = rows.shape[1]
                        per_token = (
                            part.sequences[:, part.prompt_len :][rows],
                            exp.old_log_probs[part_rows, :columns][rows],
                            advantages[part_rows, :columns][rows],
                            rows[rows],  # all True
                        )
                        options = dict(
                            ref_log_probs=None if ref is None else ref[part_rows, :columns][rows],
                            return_entropy=True,
                            loss_weights=(1.0 / denom).expand(per_token[0].shape[0]),  # the token mean, up front
                            options=loss_options,
                        )
                        if cfg.fused_lm_head:  # [N, H] hidden states and the lm_head: no [N, V] logits
                            weight, bias = lm_head_parts(policy)
                            hidden = response_hidden(policy, part)[rows]
                            out = fused_linear_policy_loss(hidden, weight, *per_token, bias=bias, **options)
                        else:
                            logits = response_logits(policy, part)[rows]  # [N, V], a copy: it may take its gradient
                            out = fused_policy_loss(logits, *per_token, grad_in_logits=True, **options)
                        checks.add(out.status, f"phase '{name}', mini-batch {m}")
                        backend = backend or out.backend
                        out.reduced.backward()
                        loss_sum += float(out.loss.detach().sum())
                        policy_sum += float((out.loss.detach() - kl_coef * out.kl).sum())  # out.loss holds kl_coef * kl
                        clipped += float(out.clipped.sum())
                        entropy += float(out.entropy.detach().sum())
                    if all(p.grad is None for p in params):  # every micro-batch skipped: the step is on zeros
                        for p in params:
                            p.grad = torch.zeros_like(p)
                    checks.raise_if_bad()  # before the weights move
                    norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
                    optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trained = phase_tokens * cfg.epochs
        metrics["loss"] += loss_sum / max(total_tokens * cfg.epochs, 1)
        metrics["optimizer_steps"] += len(norms)
        clipped_all, entropy_all, trained_all = clipped_all + clipped, entropy_all + entropy, trained_all + trained
        norms_all += norms
        if cfg.lopti and phase_tokens:  # an empty phase has lopti/<phase>/tokens = 0: a 0 here would read as measured
            # without the KL term, as OpenRLHF and verl log a phase's policy loss
            metrics[f"lopti/{name}/policy_loss"] = policy_sum / max(total_tokens * cfg.epochs, 1)
            metrics[f"lopti/{name}/clip_ratio"] = clipped / max(trained, 1)
            metrics[f"lopti/{name}/grad_norm"] = sum(norms) / len(norms) if norms else 0.0
            metrics[f"lopti/{name}/train_s"] = time.perf_counter() - start
    metrics["clip_ratio"] = clipped_all / max(trained_all, 1)
    metrics["entropy"] = entropy_all / max(trained_all, 1)
    metrics["grad_norm"] = sum(norms_all) / len(norms_all) if norms_all else 0.0
    metrics["loss_backend"] = backend
    return metrics
