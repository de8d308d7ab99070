"""Supervised warm-up of the demo model on generated solutions, so its token probabilities mean something.

A random model's tokens are all near 1/V, which would make AR and Lopti no-ops. Teacher forcing on
``compact_prompt -> compact_solution`` first teaches the format and the names (greedy accuracy stays 0
for about 100 steps), then, fairly suddenly, the logic. The warm-up stops as soon as greedy accuracy on
a validation set reaches ``target_accuracy``: early in that jump, so RL has room to raise the reward,
and at the same point of learning whatever the machine's speed or floating-point order.
"""

from dataclasses import dataclass, field
from typing import Sequence

import torch

from openrlhf_lopti.local.evaluation import kk_eval
from openrlhf_lopti.local.model import save_model
from openrlhf_lopti.local.task import VALID_SEED_BASE, WARMUP_SEED_BASE, compact_prompt, compact_solution, puzzles

from .tiny_model import build_tiny_llama, build_word_tokenizer


def check_warmup_flags(warmup_steps: int, warmup_target: float, seed: int) -> None:
    """The checks of the flags that build a warm-up (``--warmup-steps``, ``--warmup-target``, ``--seed``), shared
    by every command that warms the demo model up: a :class:`UserError` naming the flag, before the model is built."""
    from openrlhf_lopti.errors import UserError
    from openrlhf_lopti.local.config import SEED_LIMIT

    if warmup_steps < 1:
        raise UserError(f"--warmup-steps must be >= 1, got {warmup_steps}")
    if not 0.0 <= warmup_target <= 1.0:  # NaN too
        raise UserError(f"--warmup-target must be an accuracy in [0, 1], got {warmup_target}")
    if not abs(seed) < SEED_LIMIT:  # torch's generator takes 64 bits; the derived seeds need room
        raise UserError(f"--seed must be an integer with |seed| < 2**40, got {seed}")


def warmup_batch(tokenizer, records: list) -> tuple:
    """``(input_ids, attention_mask, labels)``, each ``[B, L]``, right-padded; labels are -100 on the
    prompt and padding so only the response (and its eos) is learned."""
    rows, labels = [], []
    for record in records:
        prompt = tokenizer(compact_prompt(record), add_special_tokens=False)["input_ids"]
        target = tokenizer(compact_solution(record), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return input_ids, attention, label_ids


@dataclass
class WarmupResult:
    """What the warm-up did: steps taken, per-step loss (nats/token), validation accuracy per check."""

    steps: int = 0
    losses: list = field(default_factory=list)
    checks: list = field(default_factory=list)  # (step, greedy validation accuracy)


def supervised_warmup(
    model,
    tokenizer,
    max_steps: int,
    target_accuracy: float = 0.0,
    check_every: int = 10,
    valid_size: int = 100,
    batch_size: int = 32,
    lr: float = 3e-3,
    people: Sequence[int] = (2,),
    seed: int = 0,
    progress: bool = True,
) -> WarmupResult:
    """Teacher-force ``model`` on fresh batches of compact K&K solutions (AdamW, constant lr).

    Args:
        max_steps: upper bound on optimizer steps.
        target_accuracy: stop once greedy accuracy on ``valid_size`` validation puzzles is at least this
            (checked every ``check_every`` steps); 0 runs all ``max_steps``.
        batch_size: puzzles per step. Puzzles come from the warm-up seed range (shifted by ``seed``),
            disjoint from the validation, RL and evaluation puzzles.
        people: puzzle sizes.
    """
    from tqdm.auto import tqdm

    if not 0.0 <= target_accuracy <= 1.0:
        raise ValueError(f"target_accuracy must be in [0, 1], got {target_accuracy!r}")
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    valid = puzzles(VALID_SEED_BASE, 0, valid_size, people) if target_accuracy > 0 else []
    valid_prompts = [compact_prompt(r) for r in valid]
    # The ideal response is 5 + 5 * people tokens with its eos (2 people: 15); room for a few more.
    budget = max(24, 5 * max(people) + 9)
    result = WarmupResult()
    bar = tqdm(total=max_steps, desc="warm-up", disable=not progress)
    model.train()
    for step in range(max_steps):
        records = puzzles(WARMUP_SEED_BASE + seed * max_steps * batch_size, step * batch_size, batch_size, people)
        input_ids, attention, labels = (t.to(device) for t in warmup_batch(tokenizer, records))
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        result.losses.append(float(loss.detach()))
        result.steps = step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}")
        if valid and result.steps % check_every == 0:
            accuracy = kk_eval(model, tokenizer, valid, valid_prompts, max_new_tokens=budget)["accuracy"]
            result.checks.append((result.steps, accuracy))
            model.train()
            if accuracy >= target_accuracy:
                break
    bar.close()
    return result


def build_warm_model(
    path,
    seed: int = 0,
    max_steps: int = 600,
    target_accuracy: float = 0.3,
    people: Sequence[int] = (2,),
    device: str = "cpu",
    progress: bool = True,
    hidden_size: int = 128,
    num_layers: int = 2,
) -> dict:
    """Build the demo's tiny model (``hidden_size``, ``num_layers``: see :func:`.tiny_model.build_tiny_llama`) and
    tokenizer, warm it up, and save both to ``path`` (a HF checkpoint whose prompt style is "compact").
    Returns facts for the record: ``warmup_steps``,
    ``warmup_final_loss`` (mean of the last 10 steps, nats/token), ``warmup_validation_checks``,
    ``warmup_seconds`` (wall), ``warmup_cpu_seconds`` (this process's CPU time), ``parameters``."""
    import time

    t0, cpu0 = time.perf_counter(), time.process_time()
    tokenizer = build_word_tokenizer()
    model = build_tiny_llama(tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed).to(device)
    torch.manual_seed(seed)
    result = supervised_warmup(
        model, tokenizer, max_steps, target_accuracy=target_accuracy, people=people, seed=seed, progress=progress
    )
    save_model(model, tokenizer, path, prompt_style="compact")
    last = result.losses[-10:]
    return {
        "warmup_steps": result.steps,
        "warmup_final_loss": sum(last) / max(len(last), 1),
        "warmup_validation_checks": result.checks,
        "warmup_seconds": time.perf_counter() - t0,
        "warmup_cpu_seconds": time.process_time() - cpu0,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
