"""``LoptiGRPOTrainer`` takes every option TRL 1.16's ``GRPOTrainer`` takes (CPU, tiny in-process models).

- With AR and Lopti off, an option the fused kernel does not compute (cispo, sapo, vespo, luspo with sequence-level
  importance sampling, GSPO, ``delta``, ``off_policy_mask_threshold``, ``use_adaptive_entropy``) runs TRL's own loss:
  the same parameters, bit for bit, and the same logged metrics as TRL's ``GRPOTrainer`` on the same seed.
- With AR + Lopti on, each of them trains a round on TRL's loss, and its gradient is the definition
  (docs/LOPTI_ROUND.md): at the phase's tokens, the gradient of TRL's loss with AR-weighted advantages; at the other
  tokens, none. Checked per token at the final norm's output, against TRL's own ``_compute_loss``.
- TRL's loss path with AR + Lopti trains the round the fused path trains (both against the hand-written round).
- MoE models (a Qwen3-MoE and a GPT-OSS shape, random weights): the router aux loss is in every micro-step of both
  phases, on the fused path, the fused lm_head and TRL's loss; with AR and Lopti off the update is TRL's.
- ``args=None`` builds TRL's default configuration.
"""

from dataclasses import fields

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from openrlhf_lopti.demo.tiny_model import build_word_tokenizer  # noqa: E402
from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer  # noqa: E402

from .test_trl_trainer import (  # noqa: E402
    distinct_words,
    hand_round,
    initial_params,
    kk_dataset,
    metric_names,
    settings,
    tiny_model,
    train,
    trained_params,
    update_errors,
)

ALPHA = 0.3
AR_LOPTI = dict(ar_alpha=ALPHA, lopti_eta=0.5, max_steps=2)  # one round: 2 phases x 2 micro-batches, 1 step each
# the options the fused kernel does not compute: TRL's loss runs them (config.trl_loss_reason)
TRL_LOSS_OPTIONS = {
    "cispo": dict(loss_type="cispo"),
    "sapo": dict(loss_type="sapo"),
    "vespo": dict(loss_type="vespo"),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "gspo": dict(importance_sampling_level="sequence"),
    "delta": dict(delta=1.05),
    "off-policy-mask": dict(off_policy_mask_threshold=1e-4),
    "adaptive-entropy": dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0),
}
TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(scope="module")
def tok():
    return build_word_tokenizer()


def comparable(history: list) -> list:
    """A run's log history without its wall-clock figures."""
    return [{k: v for k, v in entry.items() if k not in TIMING_KEYS} for entry in history]


def completion_grads(trainer, inputs: dict, loss_fn) -> torch.Tensor:
    """``[B, T, H]``: the gradient of ``loss_fn(model, inputs)`` at the final norm's output, at the positions that
    score the completion's tokens (the output at position p only feeds the logits of token p + 1), in eval mode (no
    adaptive-entropy update between two calls)."""
    model = trainer.model
    kept = {}

    def keep(module, args, output):
        output.retain_grad()
        kept["hidden"] = output

    handle = model.model.norm.register_forward_hook(keep)
    model.eval()
    try:
        model.zero_grad()
        loss_fn(model, inputs).backward()
    finally:
        handle.remove()
        model.train()
    t = inputs["completion_ids"].size(1)
    return kept["hidden"].grad[:, -t - 1 : -1]


@pytest.mark.parametrize("options", TRL_LOSS_OPTIONS.values(), ids=TRL_LOSS_OPTIONS.keys())
def test_features_off_is_trls_trainer(tmp_path, tok, options, capsys):
    ours_cfg = LoptiGRPOConfig(**settings(tmp_path / "a", **options))  # fused_loss at its default
    ours_initial, ours, ours_inputs = train(LoptiGRPOTrainer, ours_cfg, tok)
    base = settings(tmp_path / "b", **options)
    base.pop("loss_backend")
    trl_initial, theirs, trl_inputs = train(GRPOTrainer, GRPOConfig(**base), tok)
    assert ours.loss_path == "trl" and "untouched (AR and Lopti off)" in capsys.readouterr().out
    assert all(torch.equal(ours_initial[k], trl_initial[k]) for k in ours_initial)
    for a, b in zip(ours_inputs, trl_inputs):
        assert a.keys() == b.keys() and torch.equal(a["completion_ids"], b["completion_ids"])
    p0 = initial_params(tok, ours_initial)
    assert any(not torch.equal(a, b) for a, b in zip(trained_params(ours), p0)), "the step moved nothing"
    for a, b in zip(trained_params(ours), trained_params(theirs)):
        assert torch.equal(a, b)
    assert comparable(ours.state.log_history) == comparable(theirs.state.log_history)
    if options.get("use_adaptive_entropy"):  # TRL's controller ran, the same way
        assert ours.entropy_coef == theirs.entropy_coef != options["entropy_coef"]


@pytest.mark.parametrize("options", TRL_LOSS_OPTIONS.values(), ids=TRL_LOSS_OPTIONS.keys())
def test_ar_lopti_on_trls_loss(tmp_path, tok, options, capsys, monkeypatch):
    cfg = LoptiGRPOConfig(**settings(tmp_path, **options, **AR_LOPTI))
    initial, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok)
    line = capsys.readouterr().out
    assert trainer.loss_path == "trl" and "TRL's GRPOTrainer loss, with AR + Lopti applied" in line
    assert [r["lopti_phase"] for r in recorded] == [0, 0, 1, 1] and trainer.state.global_step == 2
    p0 = initial_params(tok, initial)
    assert any(not torch.equal(a, b) for a, b in zip(trained_params(trainer), p0))
    logged = {**trainer.state.log_history[1], **trainer.state.log_history[0]}
    for key in ("ar/mean_weight", "lopti/threshold", "lopti/low/tokens", "lopti/high/tokens", "entropy"):
        assert key in logged, key

    # the low phase's first micro-batch: its gradient is TRL's loss's (AR-weighted advantages) at its tokens only
    inputs = recorded[0]
    phase, mask = inputs["lopti_phase_mask"], inputs["completion_mask"].bool()
    assert bool(phase.any()) and bool((mask & ~phase).any())
    plain = {k: v for k, v in inputs.items() if not k.startswith("lopti_")}
    old = plain["old_per_token_logps"]
    plain["advantages"] = plain["advantages"][:, None] * (ALPHA * old.exp() + 1 - ALPHA)  # paper Eq. 4
    trl_loss = lambda model, batch: GRPOTrainer._compute_loss(trainer, model, batch)  # noqa: E731
    ours = completion_grads(trainer, inputs, trainer._compute_loss)
    theirs = completion_grads(trainer, plain, trl_loss)
    no_ar = completion_grads(trainer, {**plain, "advantages": inputs["advantages"]}, trl_loss)
    scale = theirs[phase].abs().max()
    assert scale > 0 and theirs[mask & ~phase].abs().max() > 0  # the other tokens have a gradient in TRL's loss
    torch.testing.assert_close(ours[phase], theirs[phase], rtol=1e-5, atol=1e-6 * float(scale))
    assert torch.equal(ours[~phase], torch.zeros_like(ours[~phase]))
    assert (no_ar[phase] - theirs[phase]).abs().max() > 1e-3 * scale  # AR's weights changed the gradient
    # delta and the off-policy mask act on this batch: without them TRL's gradient is another (TRL reads delta from
    # its args, the mask's threshold from the trainer)
    for option, owner in (("delta", trainer.args), ("off_policy_mask_threshold", trainer)):
        if option in options:
            monkeypatch.setattr(owner, option, None)
            without = completion_grads(trainer, plain, trl_loss)
            assert (without[phase] - theirs[phase]).abs().max() > 1e-3 * scale


def test_trl_loss_trains_the_fused_round(tmp_path, tok):
    """A clipped token-level loss with AR + Lopti, KL and the entropy bonus: TRL's loss path (``fused_loss=False``)
    and the fused path train the round written out by hand (every term restricted to the phase's tokens,
    normalised over every response token)."""
    start = tmp_path / "tiny"  # a path: TRL loads the KL reference model from it
    tiny_model(tok).save_pretrained(start)
    options = dict(loss_type="bnpo", beta=0.1, entropy_coef=0.05, **AR_LOPTI)
    runs = {}
    for fused in (True, False):
        cfg = LoptiGRPOConfig(**settings(tmp_path / str(fused), fused_loss=fused, **options))
        runs[fused] = train(LoptiGRPOTrainer, cfg, tok, model=str(start))
    assert runs[True][1].loss_path == "fused" and runs[False][1].loss_path == "trl"
    for (initial, trainer, recorded), other in ((runs[True], runs[False]), (runs[False], runs[True])):
        assert [r["lopti_phase"] for r in recorded] == [0, 0, 1, 1]
        assert all(torch.equal(a["completion_ids"], b["completion_ids"]) for a, b in zip(recorded, other[2]))
        p0 = initial_params(tok, initial)
        ref32 = hand_round(tok, initial, recorded, trainer.args, torch.float32)
        ref64 = hand_round(tok, initial, recorded, trainer.args, torch.float64)
        for i, (err, err_ref, allowed) in enumerate(update_errors(p0, trained_params(trainer), ref32, ref64)):
            assert err <= allowed, f"{trainer.loss_path} param {i}: update off by {err:.3g} (hand fp32 {err_ref:.3g})"


# ---- MoE: the router aux loss ----

AUX_COEF = 0.5  # large enough that the aux loss moves the router visibly within one round


def tiny_qwen3_moe(tok):
    """A Qwen3-MoE of the tiny Llama's size: 4 experts, 2 per token, random weights (no download)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=AUX_COEF, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    return _seeded(Qwen3MoeForCausalLM, config, tok)


def tiny_gpt_oss(tok):
    """A GPT-OSS of the same size: 4 experts, 2 per token, one full-attention layer, random weights."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"],
        router_aux_loss_coef=AUX_COEF, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    return _seeded(GptOssForCausalLM, config, tok)


def _seeded(cls, config, tok):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
    model.set_experts_implementation("eager")  # torch's grouped_mm, the default, has no float64 (the hand round's)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: token probabilities on both sides of eta = 0.5
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


MOE_CASES = {
    "qwen3_moe-off": (tiny_qwen3_moe, {}),  # AR and Lopti off: also against TRL's GRPOTrainer
    "gpt_oss-off": (tiny_gpt_oss, {}),
    "qwen3_moe-fused": (tiny_qwen3_moe, AR_LOPTI),
    "qwen3_moe-fused_lm_head": (tiny_qwen3_moe, dict(fused_lm_head=True, **AR_LOPTI)),
    "qwen3_moe-trl_loss": (tiny_qwen3_moe, dict(fused_loss=False, **AR_LOPTI)),
}


@pytest.mark.parametrize("build, options", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_moe_router_aux_loss(tmp_path, tok, build, options):
    cfg = LoptiGRPOConfig(**settings(tmp_path / "a", loss_type="bnpo", **options))
    initial, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok, model=build(tok))
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == AUX_COEF
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == cfg.max_steps and all("aux_loss" in h for h in steps)  # logged in each phase's step
    if cfg.lopti:
        assert [r["lopti_phase"] for r in recorded] == [0, 0, 1, 1]
        assert steps[0]["lopti/low/tokens"] > 0 and steps[0]["lopti/high/tokens"] > 0
    runs = [("ours", trainer)]
    if not options:
        base = settings(tmp_path / "b", loss_type="bnpo")
        base.pop("loss_backend")
        trl_initial, theirs, trl_inputs = train(GRPOTrainer, GRPOConfig(**base), tok, model=build(tok))
        assert all(torch.equal(a["completion_ids"], b["completion_ids"]) for a, b in zip(recorded, trl_inputs))
        assert metric_names(trainer) == metric_names(theirs)
        runs.append(("TRL", theirs))
    p0 = initial_params(tok, initial, build)
    ref32 = hand_round(tok, initial, recorded, cfg, torch.float32, build=build, aux_coef=AUX_COEF)
    ref64 = hand_round(tok, initial, recorded, cfg, torch.float64, build=build, aux_coef=AUX_COEF)
    for name, run in runs:
        for i, (err, err_ref, allowed) in enumerate(update_errors(p0, trained_params(run), ref32, ref64)):
            assert err <= allowed, f"{name} param {i}: update off by {err:.3g} (hand fp32 {err_ref:.3g})"
    # the comparison sees the aux loss: the same round without it is another update
    no_aux64 = hand_round(tok, initial, recorded, cfg, torch.float64, build=build)
    errors = update_errors(p0, trained_params(trainer), ref32, ref64)
    bad_errors = update_errors(p0, trained_params(trainer), ref32, no_aux64)
    assert any(bad[0] > right[2] for bad, right in zip(bad_errors, errors))


def test_args_none_is_trls_default(tmp_path, tok, monkeypatch):
    import transformers.training_args

    start = tmp_path / "tiny"
    tiny_model(tok).save_pretrained(start)
    monkeypatch.chdir(tmp_path)  # TRL's default output_dir is relative: "<model name>-GRPO"
    # TRL's default config is bf16, which transformers refuses on a machine without a bf16 GPU (this one); the
    # trainers are only built here, as on a GPU machine
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    kwargs = dict(model=str(start), reward_funcs=[distinct_words], train_dataset=kk_dataset(), processing_class=tok)
    ours, theirs = LoptiGRPOTrainer(**kwargs), GRPOTrainer(**kwargs)
    assert type(ours.args) is LoptiGRPOConfig and ours.args.output_dir == theirs.args.output_dir == "tiny-GRPO"
    assert ours.args.ar_alpha == 0 and not ours.args.lopti and ours.loss_path == "fused"
    for f in fields(GRPOConfig):
        assert getattr(ours.args, f.name) == getattr(theirs.args, f.name), f.name


@pytest.mark.parametrize("eta", [0, 0.0])
def test_lopti_eta_zero_with_a_quantile_is_eta_unset(tmp_path, eta):
    """algo.lopti_settings' eta 0 = unset, as OpenRLHF's --algo.lopti.eta 0 with --algo.lopti.quantile. (Before: refused,
    "lopti_eta: eta must be a probability threshold in (0, 1], got 0".) Alone, 0 is no threshold: still refused."""
    from openrlhf_lopti.algo import LoptiSettings

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False)
    cfg = LoptiGRPOConfig(**base, lopti_eta=eta, lopti_quantile=0.3)
    assert cfg.lopti and cfg.lopti_settings == LoptiSettings(0.5, "low_first", 0.3)
    for refused in (dict(lopti_eta=eta), dict(lopti_eta=False, lopti_quantile=0.3)):
        with pytest.raises(ValueError, match="^lopti_eta: eta must be a probability threshold in"):
            LoptiGRPOConfig(**base, **refused)
