"""The audit's measurements on one batch of experience (paper Fig. 1(d) and Fig. 3).

Tokens are the response tokens of the batch, binned by their sampling probability ``p = exp(old_log_prob)``
(the probability at the sampling temperature, the one AR and Lopti use). The fixed bins are
:mod:`openrlhf_lopti.algo.direction`'s, by its function (:func:`~openrlhf_lopti.algo.direction.direction_bins`:
``p`` in float64, ``[e_k, e_{k+1})``, the last bin closed), and a bin's share follows its rule (no share for an
empty bin: NaN here, null in audit.json, never 0); the quantile bins follow the same rule at other edges:

- ``logit_grad_norms``: per token, ``||d loss_t / d z_t||`` with ``z_t`` the token's logits row and
  ``loss_t`` its GRPO loss, by autograd (one backward of the summed loss: row t only feeds loss_t);
  at the sampling weights it equals ``|A_t| / T * ||onehot - softmax(z_t / T)||`` (Prop. 4.2's quantity,
  checked in tests/test_audit.py);
- ``param_grad_norms``: per token, ``||d loss_t / d theta||`` over all parameters, one backward per token
  through its own response's forward (a random sample of tokens per bin keeps it affordable);
- ``correct_direction``: after one update of a copy of the model under a method (one optimizer step on
  the whole batch; Lopti: one per phase), which tokens' probability went up.
"""

import copy
import math
from typing import Optional

import torch

from openrlhf_lopti.algo.direction import COUNT_ROWS, DIRECTION_EDGES, NUM_BINS, direction_bins, direction_metrics
from openrlhf_lopti.local.config import TrainConfig, method_settings
from openrlhf_lopti.local.experience import Experience
from openrlhf_lopti.local.rollout import response_logits
from openrlhf_lopti.local.update import build_optimizers, update_policy
from openrlhf_lopti.ops import fused_policy_loss

BIN_MODES = ("fixed", "quantile")


def bin_edges(log_probs: torch.Tensor, mode: str = "fixed") -> list:
    """Five edges of four probability bins: ``"fixed"`` = algo's ``DIRECTION_EDGES`` [0, .25, .5, .75, 1] (the
    paper's "p > 0.75" group), ``"quantile"`` = the quartiles of ``p = exp(log_probs)`` (equal token counts)."""
    if mode not in BIN_MODES:
        raise ValueError(f"bins must be 'fixed' or 'quantile', got {mode!r}")
    if mode == "fixed":
        return list(DIRECTION_EDGES)
    if log_probs.numel() == 0:
        raise ValueError("log_probs is empty: no response tokens to bin")
    p = log_probs.detach().double().cpu().exp()
    qs = torch.quantile(p, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return [0.0, *[float(q) for q in qs], 1.0]


def bin_index(log_probs: torch.Tensor, edges: list) -> torch.Tensor:
    """``[N]`` bin (0 = lowest probability .. 3) of each token by ``p = exp(log_probs)``.

    The fixed edges are :func:`~openrlhf_lopti.algo.direction.direction_bins` itself; other edges (quantile)
    follow its rule: ``p`` in float64, bins ``[e_k, e_{k+1})``, the last one closed (and taking p a hair above 1).
    """
    if len(edges) != NUM_BINS + 1:
        raise ValueError(f"edges must be {NUM_BINS + 1} numbers, got {len(edges)}")
    if tuple(edges) == DIRECTION_EDGES:
        return direction_bins(log_probs)
    p = log_probs.detach().double().exp()
    inner = torch.tensor(edges[1:-1], dtype=torch.float64, device=p.device)
    return torch.bucketize(p, inner, right=True)


def per_bin_mean(values: torch.Tensor, bins: torch.Tensor, keep: Optional[torch.Tensor] = None) -> list:
    """Mean of ``values [N]`` per bin over the entries where ``keep`` is true; NaN for an empty bin (no value,
    as algo.direction leaves out an empty bin's share: null in audit.json, "-" in the table, never 0)."""
    keep = torch.ones_like(bins, dtype=torch.bool) if keep is None else keep
    out = []
    for k in range(NUM_BINS):
        sel = (bins == k) & keep
        out.append(float(values[sel].float().mean()) if sel.any() else math.nan)
    return out


def direction_shares(bins: torch.Tensor, delta: torch.Tensor, advantages: torch.Tensor) -> list:
    """Per bin, the share of positive-advantage tokens whose log-prob rose (``delta > 0``), counted in
    algo.direction's rows (:data:`~openrlhf_lopti.algo.direction.COUNT_ROWS`) and turned into shares by
    :func:`~openrlhf_lopti.algo.direction.direction_metrics`: a bin without a positive token has no share (NaN
    here), an unchanged log-prob is not "rose"."""
    bins, delta, advantages = bins.cpu(), delta.cpu(), advantages.cpu()
    rise, fall = delta > 0, delta < 0
    pos, neg = advantages > 0, advantages < 0
    rows = {"tokens": torch.ones_like(pos), "pos": pos, "pos_up": pos & rise, "neg": neg, "neg_down": neg & fall}
    counts = torch.stack([torch.bincount(bins[rows[name]], minlength=NUM_BINS) for name in COUNT_ROWS]).double()
    metrics = direction_metrics(counts)
    return [metrics.get(f"direction/pos_up_q{k + 1}", math.nan) for k in range(NUM_BINS)]


def _flat(exp: Experience) -> tuple:
    """Response-token views ``[N]`` of the batch: labels, old log-probs, advantages."""
    rows = exp.rollout.action_mask
    labels = exp.rollout.sequences[:, exp.rollout.prompt_len :][rows]
    return labels, exp.old_log_probs[rows], exp.advantages[rows]


def logit_grad_norms(model, exp: Experience, cfg: TrainConfig) -> torch.Tensor:
    """``[N]`` norm of each response token's GRPO loss gradient w.r.t. its own logits row (autograd).

    ``loss_t`` is :func:`fused_policy_loss`'s per-token loss with alpha = 0 and no KL, not divided by the
    token count (so the numbers do not depend on the batch size).
    """
    labels, old, adv = _flat(exp)
    with torch.no_grad():
        logits = response_logits(model, exp.rollout)[exp.rollout.action_mask].float()
    logits.requires_grad_(True)
    out = fused_policy_loss(
        logits, labels, old, adv, torch.ones_like(labels, dtype=torch.bool),
        eps_low=cfg.eps_low, eps_high=cfg.eps_high, temperature=cfg.temperature, backend=cfg.loss_backend,
    )  # fmt: skip
    out.loss.sum().backward()
    return logits.grad.norm(dim=-1).detach()


def param_grad_norms(model, exp: Experience, cfg: TrainConfig, tokens: torch.Tensor) -> torch.Tensor:
    """``[len(tokens)]`` norm of ``d loss_t / d theta`` over all trainable parameters, for the response
    tokens at flat indices ``tokens`` (flat = row-major order of the action mask).

    One forward per response that holds a chosen token (that response alone: a backward through the
    whole batch's graph would cost the batch for every token), then one backward per token.
    """
    labels, old, adv = _flat(exp)
    params = [p for p in model.parameters() if p.requires_grad]
    mask = exp.rollout.action_mask
    row_of = mask.nonzero()[:, 0]  # [N] response index of each flat token
    row_start = torch.cumsum(mask.sum(-1), 0) - mask.sum(-1)  # [B] flat index of each response's first token
    by_row: dict = {}
    for i, t in enumerate(tokens.tolist()):
        by_row.setdefault(int(row_of[t]), []).append((i, t))
    norms = torch.zeros(len(tokens))
    for row, items in by_row.items():
        part = exp.rollout.select(torch.tensor([row], device=mask.device))
        logits = response_logits(model, part)[part.action_mask]
        start = int(row_start[row])
        span = slice(start, start + logits.shape[0])
        out = fused_policy_loss(
            logits, labels[span], old[span], adv[span], torch.ones_like(labels[span], dtype=torch.bool),
            eps_low=cfg.eps_low, eps_high=cfg.eps_high, temperature=cfg.temperature, backend=cfg.loss_backend,
        )  # fmt: skip
        for k, (i, t) in enumerate(items):
            grads = torch.autograd.grad(out.loss[t - start], params, retain_graph=k < len(items) - 1, allow_unused=True)
            norms[i] = math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads if g is not None))
    return norms


def sample_per_bin(bins: torch.Tensor, keep: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """Up to ``count`` random flat indices per bin among ``keep`` tokens (all of them if fewer)."""
    generator = torch.Generator().manual_seed(seed)
    picked = []
    for k in range(NUM_BINS):
        idx = torch.nonzero(((bins == k) & keep).cpu()).flatten()
        picked.append(idx[torch.randperm(len(idx), generator=generator)[:count]])
    return torch.cat(picked)


@torch.no_grad()
def logprobs_fp64(model, exp: Experience, temperature: float) -> torch.Tensor:
    """``[N]`` response-token log-probs from a float64 copy of ``model``.

    A one-step change of a p ~ 1 token's log-prob is often below float32's resolution of a log-softmax
    (~1e-7 absolute), which would count as "did not go up"; float64 resolves it.
    """
    wide = copy.deepcopy(model).to(torch.float64)
    logits = response_logits(wide, exp.rollout)[exp.rollout.action_mask]
    labels = exp.rollout.sequences[:, exp.rollout.prompt_len :][exp.rollout.action_mask]
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    del wide
    return logp


OPTIMIZERS = ("checkpoint", "fresh-adamw", "sgd")


def make_optimizer(params, kind: str, cfg: TrainConfig, states: Optional[list] = None) -> list:
    """The optimizers of one audited update, as :func:`update_policy` takes them (one, or one per Lopti phase),
    at ``cfg.step_lr``: ``"checkpoint"`` = the run's own (``cfg.optimizer`` with its momentum; one per phase with
    ``lopti_moments="per-phase"``) restored from ``states`` (a checkpoint's ``optimizer_states``: moments, step
    counts, hyper-parameters; lr replaced by ``cfg.step_lr``), ``"fresh-adamw"`` = a new AdamW, ``"sgd"`` = plain
    SGD."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")
    params = list(params)
    if kind == "sgd":
        return [torch.optim.SGD(params, lr=cfg.step_lr)]
    if kind == "fresh-adamw":
        return [torch.optim.AdamW(params, lr=cfg.step_lr, weight_decay=cfg.weight_decay)]
    if states is None:
        raise ValueError("optimizer 'checkpoint' needs the checkpoint's optimizer states")
    optimizers = build_optimizers(params, cfg)
    if len(states) != len(optimizers):
        raise ValueError(f"optimizer 'checkpoint': {len(states)} saved optimizer state(s) for {len(optimizers)} "
                         f"optimizer(s) of method {cfg.method!r} (lopti_moments {cfg.lopti_moments!r})")  # fmt: skip
    for opt, state in zip(optimizers, states):
        opt.load_state_dict(copy.deepcopy(state))  # a copy: every method starts from the same state
        for group in opt.param_groups:
            group["lr"] = cfg.step_lr
    return optimizers


def correct_direction(
    model,
    exp: Experience,
    cfg: TrainConfig,
    bins: torch.Tensor,
    methods: list,
    optimizer: str = "fresh-adamw",
    optimizer_states: Optional[list] = None,
) -> tuple:
    """Per method, the fraction of positive-advantage tokens in each bin whose probability rose after one
    update from ``model``'s weights (``model`` itself is not changed).

    Each method gets a fresh copy of the weights and its own optimizer (:func:`make_optimizer`, lr
    ``cfg.step_lr``): ``"checkpoint"`` restores training's optimizer state (``optimizer_states``), ``"fresh-adamw"``
    starts a new one, ``"sgd"`` follows the raw gradient. It runs
    :func:`openrlhf_lopti.local.update.update_policy` with the whole batch as one mini-batch: GRPO and AR
    take one optimizer step, Lopti two (low phase, then high phase). A fresh AdamW's first step is about
    ``lr * sign(grad)`` per parameter, which erases the per-parameter gradient-size imbalance the paper
    is about; SGD keeps it (then, to first order in lr, Lopti's two steps add up to GRPO's one); training's
    own optimizer state is what a training step sees. Probabilities before and after are compared in float64
    (:func:`logprobs_fp64`).

    Returns:
        ``({method: [4 fractions, NaN for a bin without positive tokens]}, {method: [N] log-prob change})``.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    advantages = exp.advantages[exp.rollout.action_mask]
    before = logprobs_fp64(model, exp, cfg.temperature)
    fractions, deltas = {}, {}
    for method in methods:
        settings = {**cfg.to_dict(), **method_settings(method), "mini_batch_size": len(exp.rollout), "epochs": 1}
        method_cfg = TrainConfig.from_dict(settings)
        policy = copy.deepcopy(model)
        opt = make_optimizer(policy.parameters(), optimizer, method_cfg, optimizer_states)
        update_policy(policy, opt, exp, method_cfg, torch.Generator().manual_seed(cfg.seed))
        delta = logprobs_fp64(policy, exp, cfg.temperature) - before
        fractions[method] = direction_shares(bins, delta, advantages)
        deltas[method] = delta
        del policy, opt
    return fractions, deltas
