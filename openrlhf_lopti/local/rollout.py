"""Rollouts with transformers ``generate`` and the log-prob / logit views of a rollout the update needs.

Layout of a rollout of B sequences: ``sequences [B, P + T]`` = left-padded prompt (P tokens) followed by
the response (T tokens, right-padded after the first eos). ``action_mask [B, T]`` marks response tokens up
to and including the eos. Position ids skip the left padding, as ``generate`` does, so that a training
forward sees exactly the positions sampling saw.
"""

import inspect
from dataclasses import dataclass

import torch

from openrlhf_lopti.algo import token_logprobs
from openrlhf_lopti.models import lm_head_parts
from openrlhf_lopti.ops import linear_log_probs


@dataclass
class Rollout:
    """One batch of sampled responses (tensors on the model's device).

    Fields:
        sequences: ``[B, P + T]`` token ids, prompt then response.
        attention_mask: ``[B, P + T]`` 1 on real tokens.
        action_mask: ``[B, T]`` bool, the response tokens that are trained on (eos included).
        prompt_len: P, the padded prompt length.
        responses: B decoded responses (special tokens removed).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_len: int
    responses: list

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def select(self, index: torch.Tensor) -> "Rollout":
        """The sub-batch of rows ``index`` (a 1-D long tensor)."""
        rows = index.tolist()
        return Rollout(
            self.sequences[index],
            self.attention_mask[index],
            self.action_mask[index],
            self.prompt_len,
            [self.responses[i] for i in rows],
        )

    def first_tokens(self, n: int) -> "Rollout":
        """Every row cut after its first ``n`` response tokens (``sequences [B, P + n]``); a causal LM's outputs
        at those positions do not depend on the tokens cut. ``responses`` stay the whole decoded texts."""
        end = self.prompt_len + n
        return Rollout(self.sequences[:, :end], self.attention_mask[:, :end], self.action_mask[:, :n],
                       self.prompt_len, self.responses)  # fmt: skip


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions counted from each row's first real token (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def generate_rollouts(
    model,
    tokenizer,
    prompts: list,
    n_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    greedy: bool = False,
) -> Rollout:
    """Sample ``n_samples`` responses per prompt (rows ``i * n_samples .. (i + 1) * n_samples - 1`` share prompt i).

    Sampling is from ``softmax(logits / temperature)`` with no top-k / top-p, so that the probability the
    loss computes is the one tokens were drawn from. ``greedy=True`` takes the argmax instead.
    Uses the global torch RNG (seeded by the caller).
    """
    if n_samples < 1 or max_new_tokens < 1:
        raise ValueError(f"n_samples and max_new_tokens must be >= 1, got {n_samples} and {max_new_tokens}")
    device = next(model.parameters()).device
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    input_ids = enc["input_ids"].repeat_interleave(n_samples, dim=0)
    attention = enc["attention_mask"].repeat_interleave(n_samples, dim=0)
    eos = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    try:
        # top_k=0 and top_p=1 switch off filters a checkpoint's generation_config may set (e.g. top_k=20).
        sample_args = (
            {"do_sample": False}
            if greedy
            else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        )
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
            **sample_args,
        )
    finally:
        model.train(was_training)
    prompt_len = input_ids.shape[1]
    response = out[:, prompt_len:]
    # Response tokens up to and including the first eos; generate pads after it.
    is_eos = response == eos
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    action_mask = ~after_eos
    response = torch.where(action_mask, response, torch.full_like(response, tokenizer.pad_token_id))
    sequences = torch.cat([input_ids, response], dim=1)
    attention_mask = torch.cat([attention, action_mask.long()], dim=1)
    texts = tokenizer.batch_decode(response, skip_special_tokens=True)
    return Rollout(sequences, attention_mask, action_mask, prompt_len, [t.strip() for t in texts])


def response_logits(model, rollout: Rollout) -> torch.Tensor:
    """``[B, T, V]`` logits predicting each response token (the forward's outputs shifted by one).

    The lm_head runs on those T positions only, not on the prompt's, when the model takes transformers'
    ``logits_to_keep`` (its causal LMs do; the model still applies its own logit transforms, e.g. soft caps).
    """
    first, width = rollout.prompt_len - 1, rollout.sequences.shape[1] - rollout.prompt_len
    keep = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        keep["logits_to_keep"] = torch.arange(first, first + width, device=rollout.sequences.device)
    out = model(
        input_ids=rollout.sequences,
        attention_mask=rollout.attention_mask,
        position_ids=position_ids(rollout.attention_mask),
        use_cache=False,
        **keep,
    )
    return out.logits if keep else out.logits[:, first:-1, :]


def response_hidden(model, rollout: Rollout) -> torch.Tensor:
    """``[B, T, H]`` last hidden states predicting each response token: the base model's output, before the
    lm_head (``--fused-lm-head``: the model's logits are never computed)."""
    out = model.get_decoder()(
        input_ids=rollout.sequences,
        attention_mask=rollout.attention_mask,
        position_ids=position_ids(rollout.attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state[:, rollout.prompt_len - 1 : -1, :]


@torch.no_grad()
def response_logprobs(
    model, rollout: Rollout, temperature: float, micro_batch_size: int = 0, fused_lm_head: bool = False,
    backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """``[B, T]`` fp32 log-probs (nats) of the response tokens under ``softmax(logits / temperature)``;
    0 outside the action mask. Computed in micro-batches of ``micro_batch_size`` rows (0 = all at once).

    ``fused_lm_head``: from the last hidden states with :func:`openrlhf_lopti.ops.linear_log_probs` (its
    ``backend``), chunk by chunk on the response tokens only, instead of the model's ``[B, T, V]`` logits.
    """
    rows = len(rollout)
    step = micro_batch_size or rows
    parts = []
    for start in range(0, rows, step):
        part = rollout.select(torch.arange(start, min(start + step, rows), device=rollout.sequences.device))
        labels = part.sequences[:, part.prompt_len :]
        if fused_lm_head:
            weight, bias = lm_head_parts(model)
            hidden = response_hidden(model, part)
            logp, _ = linear_log_probs(
                hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), bias=bias,
                mask=part.action_mask.reshape(-1), temperature=temperature, backend=backend,
            )  # fmt: skip
        else:
            logits = response_logits(model, part)
            logp, _ = token_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), temperature)
        parts.append(logp.view(len(part), -1) * part.action_mask)
    return torch.cat(parts, dim=0)
