"""``--fused-lm-head`` in the local trainer: the update and the log-prob passes take the last hidden states and
the lm_head weight (tied to the embedding in the tiny Llama), never the model's logits, and give the same
parameters and log-probs as the unfused path."""

import contextlib
import copy

import pytest
import torch

import openrlhf_lopti.local.experience as experience_module
from openrlhf_lopti.algo import token_logprobs
from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
from openrlhf_lopti.local.cli import build_parser, config_from_args
from openrlhf_lopti.local.config import TrainConfig
from openrlhf_lopti.local.experience import Experience, make_experience
from openrlhf_lopti.local.rollout import generate_rollouts, response_logprobs
from openrlhf_lopti.local.task import compact_prompt, puzzles
from openrlhf_lopti.local.update import update_policy
from openrlhf_lopti.models import lm_head_parts
from openrlhf_lopti.ops.cpp_policy_loss import cpp_available

from .kernel_cases import allow_float64_logits
from .numerics import Float64Shadow, assert_same_computation, scalars_same_computation


@pytest.fixture
def float64(monkeypatch):
    """``with float64(): ...`` runs under tests.numerics.Float64Shadow, with the fused loss's input dtypes widened
    to float64 (a test-only widening: the torch backend then takes float64 hidden states / logits)."""
    allow_float64_logits(monkeypatch)
    return Float64Shadow


@pytest.fixture(scope="module")
def tiny():
    tok = build_word_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: token probabilities on both sides of Lopti's eta
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied
    return model, tok


def cfg_for(**kw) -> TrainConfig:
    base = dict(model="m", out="o", n_samples=4, prompts_per_step=2, max_new_tokens=8, temperature=0.8,
                mini_batch_size=4, micro_batch_size=3, progress=False)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def rollout_of(model, tok, seed=0):
    torch.manual_seed(seed)
    records = puzzles(0, 0, 2, [2])
    return records, generate_rollouts(model, tok, [compact_prompt(r) for r in records], 4, 8, 0.8)


class LmHeadCalls:
    """Counts forward calls of the model's lm_head (the module that makes the [B, T, V] logits)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.get_output_embeddings().register_forward_hook(self.hook)

    def hook(self, *_):
        self.count += 1


def test_response_logprobs_fused_matches_token_logprobs(tiny, float64):
    """The fused pass (micro-batches of 3) gives token_logprobs of the whole model's logits: the rule of
    tests/numerics.py (both paths run again in float64 on a float64 copy of the model and must agree to float64
    rounding; each fp32 run's error against its float64 run is judged against the other's)."""
    model, tok = tiny
    _, rollout = rollout_of(model, tok)

    def unfused(model):
        with torch.no_grad():
            logits = model(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
                           position_ids=(rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits  # fmt: skip
        logits = logits[:, rollout.prompt_len - 1 : -1]
        labels = rollout.sequences[:, rollout.prompt_len :]
        want, _ = token_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), 0.8)
        return want.view(labels.shape) * rollout.action_mask

    def fused(model):
        return response_logprobs(model, rollout, 0.8, micro_batch_size=3, fused_lm_head=True, backend="torch")

    got, want = fused(model), unfused(model)
    model64 = copy.deepcopy(model).double()
    with float64():
        got64, want64 = fused(model64), unfused(model64)
    assert_same_computation("log-probs", got, want, got64, want64, "fused lm_head", "token_logprobs")
    assert torch.all(got[~rollout.action_mask] == 0)


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if cpp_available() else []))
def test_update_with_fused_lm_head_equals_unfused(tiny, backend, float64):
    """Same batch, same seeds: the same update (Lopti's two phases, AR, k3 KL through logp, micro-batches of 3
    responses), by the rule of tests/numerics.py: each path runs again in float64 (a float64 copy of the model;
    the C++ kernel is fp32 only, so its float64 run is the torch backend's), the float64 runs agree to float64
    rounding, and each fp32 run's error is judged against the other's (SGD: no AdamW step in between)."""
    model, tok = tiny
    records, rollout = rollout_of(model, tok)
    old = response_logprobs(model, rollout, 0.8)
    ref = old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * rollout.action_mask
    sign = torch.tensor([1.0, -1.0] * 4).view(-1, 1)
    exp = Experience(rollout, old, ref, sign * rollout.action_mask, torch.zeros(8), torch.zeros(8, dtype=torch.bool),
                     torch.ones(8, dtype=torch.bool))  # fmt: skip
    exp64 = Experience(rollout, *(t.double() for t in (old, ref, sign * rollout.action_mask, torch.zeros(8))),
                       torch.zeros(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool))  # fmt: skip
    runs = {}
    for fused, precision in ((False, torch.float32), (True, torch.float32), (False, torch.float64),
                             (True, torch.float64)):  # fmt: skip
        cfg = cfg_for(fused_lm_head=fused, loss_backend=backend if precision == torch.float32 else "torch",
                      lopti=True, alpha=0.3, kl_coef=0.05, lr=0.5)  # fmt: skip
        policy = copy.deepcopy(model).to(precision)
        optimizer = torch.optim.SGD(policy.parameters(), lr=cfg.lr)  # AdamW's first step is sign(g): too lenient
        with float64() if precision == torch.float64 else contextlib.nullcontext():
            metrics = update_policy(policy, optimizer, exp if precision == torch.float32 else exp64, cfg,
                                    torch.Generator().manual_seed(0))  # fmt: skip
        steps = {name: (p.detach() - start.detach().to(precision)) for (name, p), start
                 in zip(policy.named_parameters(), model.parameters())}  # fmt: skip
        runs[fused, precision] = metrics, steps
    order = [runs[key] for key in ((True, torch.float32), (False, torch.float32), (True, torch.float64),
                                   (False, torch.float64))]  # fmt: skip
    metrics = [m for m, _ in order]
    assert metrics[1]["lopti/low/tokens"] > 0 and metrics[1]["lopti/high/tokens"] > 0
    for key in ("loss", "entropy", "grad_norm", "lopti/low/policy_loss", "lopti/high/policy_loss"):
        scalars_same_computation(key, *(m[key] for m in metrics), a_name="fused", b_name="unfused")
    for key in ("clip_ratio", "lopti/low/tokens", "lopti/high/tokens"):  # counts: the same tokens in every run
        assert len({m[key] for m in metrics}) == 1, (key, [m[key] for m in metrics])
    moved = 0.0
    for name, _ in model.named_parameters():
        assert_same_computation(f"step of {name}", *(steps[name] for _, steps in order), "fused", "unfused")
        moved = max(moved, float(order[1][1][name].abs().max()))
    assert moved > 1e-3  # the step did something to compare


def test_no_logits_in_experience_or_update_with_fused_lm_head(tiny, monkeypatch):
    model, tok = tiny
    records, rollout = rollout_of(model, tok)  # sampling itself needs the logits: done before counting
    monkeypatch.setattr(experience_module, "generate_rollouts", lambda *a, **k: rollout)
    prompts = [compact_prompt(r) for r in records]
    for fused in (True, False):
        policy, reference = copy.deepcopy(model), copy.deepcopy(model)
        calls = [LmHeadCalls(policy), LmHeadCalls(reference)]
        cfg = cfg_for(fused_lm_head=fused, kl_coef=0.01, loss_backend="torch")
        exp = make_experience(policy, reference, tok, records, prompts, cfg)
        update_policy(policy, torch.optim.SGD(policy.parameters(), lr=0.1), exp, cfg)
        counts = [c.count for c in calls]
        assert counts == [0, 0] if fused else min(counts) > 0, (fused, counts)


def test_cli_flag_sets_the_config_field():
    args = build_parser().parse_args(["--model", "m", "--out", "o", "--fused-lm-head"])
    assert config_from_args(args).fused_lm_head is True
    args = build_parser().parse_args(["--model", "m", "--out", "o"])
    assert config_from_args(args).fused_lm_head is False


@pytest.mark.parametrize(
    "name, value",
    [("final_logit_softcapping", 30.0),  # Gemma 2's soft cap: lm_head(hidden) would not be the logits
     ("logit_scale", 0.0625), ("logits_scaling", 8.0), ("lm_head_multiplier", 0.5), ("output_multiplier", 2.0),
     ("logits_mup_width_multiplier", 4.0)],
)  # fmt: skip
def test_models_that_transform_their_logits_are_refused(tiny, name, value):
    model, _ = tiny
    model = copy.deepcopy(model)
    assert lm_head_parts(model)[0] is model.get_input_embeddings().weight
    setattr(model.config, name, value)
    with pytest.raises(ValueError, match=f"^--fused-lm-head does not support .*{name}={value!r}"):
        lm_head_parts(model)


def test_real_models_whose_forward_caps_their_logits_are_refused():
    """RecurrentGemma and xLSTM soft-cap their logits in their own forward, under names of their own (found by reading
    transformers' modeling files for ``self.config.*cap*``): built from their real configs, each is refused, and
    RecurrentGemma's cap is shown to change the log-probs, so a head run without it would train on other ones."""
    import transformers

    tiny_recurrent_gemma = transformers.RecurrentGemmaConfig(
        num_hidden_layers=2, vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, lru_width=32, attention_window_size=16, conv1d_width=4,
        block_types=["recurrent", "attention"], head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(tiny_recurrent_gemma).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # logits past its default cap of 30
        ids = torch.randint(0, 64, (1, 6))
        uncapped = model.lm_head(model.model(ids).last_hidden_state).log_softmax(-1)
        assert (uncapped - model(ids).logits.log_softmax(-1)).abs().max() > 1.0
    with pytest.raises(ValueError, match=r"^--fused-lm-head does not support .*logits_soft_cap=30\.0"):
        lm_head_parts(model)

    xlstm = transformers.xLSTMConfig()  # its default caps too; the check reads the config, not the layers
    assert xlstm.output_logit_soft_cap is not None
    only_its_config = type("Model", (), {"config": xlstm, "get_output_embeddings": lambda self: torch.nn.Linear(2, 3)})
    with pytest.raises(ValueError, match=r"output_logit_soft_cap="):
        lm_head_parts(only_its_config())
