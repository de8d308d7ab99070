"""`--track-direction` in the local trainer: the logged direction/* metrics against a count written here."""

import copy

import pytest
import torch

from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
from openrlhf_lopti.demo.warmup import supervised_warmup
from openrlhf_lopti.local.cli import build_parser, config_from_args
from openrlhf_lopti.local.config import TrainConfig
from openrlhf_lopti.local import experience as experience_module
from openrlhf_lopti.local.experience import make_experience
from openrlhf_lopti.local.model import save_model
from openrlhf_lopti.local.rollout import response_logits
from openrlhf_lopti.local.task import train_puzzles
from openrlhf_lopti.local.trainer import LocalTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = build_word_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    torch.manual_seed(0)
    supervised_warmup(model, tok, 30, batch_size=16, lr=1e-2, progress=False)
    path = tmp_path_factory.mktemp("models") / "tiny"
    save_model(model, tok, path, prompt_style="compact")
    return path


@torch.no_grad()
def logprobs_fp64(model, rollout, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probs of the response tokens from a float64 copy of ``model``."""
    logits = response_logits(copy.deepcopy(model).double(), rollout)
    labels = rollout.sequences[:, rollout.prompt_len :]
    return torch.log_softmax(logits / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)


def reference_shares(old, new, adv, mask) -> dict:
    """Token by token, in float64: the bin of p = exp(old) and whether the token moved with its advantage."""
    pos, pos_up, neg, neg_down = [0] * 4, [0] * 4, [0] * 4, [0] * 4
    for o, n, a in zip(old[mask].double().tolist(), new[mask].double().tolist(), adv[mask].tolist()):
        p = torch.tensor(o, dtype=torch.float64).exp().item()
        k = 0 if p < 0.25 else 1 if p < 0.5 else 2 if p < 0.75 else 3
        if a > 0:
            pos[k] += 1
            pos_up[k] += n > o
        elif a < 0:
            neg[k] += 1
            neg_down[k] += n < o
    out = {f"direction/pos_up_q{k + 1}": pos_up[k] / pos[k] for k in range(4) if pos[k]}
    out |= {f"direction/neg_down_q{k + 1}": neg_down[k] / neg[k] for k in range(4) if neg[k]}
    return out


@pytest.mark.parametrize("lopti", [False, True])
def test_logged_direction_equals_a_recount_of_the_step(model_dir, tmp_path, monkeypatch, lopti):
    # A barely trained model fails every puzzle alike; a reward from the response's length and words gives
    # groups with both signs of advantage, which is all this test needs.
    monkeypatch.setattr(experience_module, "score", lambda text, record: (float(len(text) % 7), False, True))
    cfg = TrainConfig(model=str(model_dir), out=str(tmp_path / "run"), steps=2, prompts_per_step=4, n_samples=4,
                      max_new_tokens=16, mini_batch_size=8, lr=1e-2, kl_coef=0.0, loss_backend="torch",
                      progress=False, lopti=lopti, eta=0.9 if lopti else None, track_direction=True)  # fmt: skip
    trainer = LocalTrainer(cfg)
    trainer.train_step()  # step 1: the optimizer now has state, as in the middle of training
    before = copy.deepcopy(trainer.policy)
    rng = torch.get_rng_state()
    logged = trainer.train_step()
    # The same step's experience again, sampled from the same weights with the same RNG state.
    torch.set_rng_state(rng)
    records = train_puzzles(cfg.seed, 1, cfg.prompts_per_step, cfg.people)
    exp = make_experience(before, None, trainer.tokenizer, records, trainer.prompts(records), cfg)
    mask = exp.rollout.action_mask
    new, old = (logprobs_fp64(m, exp.rollout, cfg.temperature) for m in (trainer.policy, before))
    assert torch.allclose(old[mask], exp.old_log_probs[mask].double(), atol=1e-5)  # the very same tokens
    want = reference_shares(old, new, exp.advantages, mask)
    got = {k: v for k, v in logged.items() if k.startswith(("direction/pos_up", "direction/neg_down"))}
    assert got == pytest.approx(want) and len(want) >= 2
    assert sum(logged[f"direction/tokens_q{k}"] for k in (1, 2, 3, 4)) == int(mask.sum())
    assert sum(logged[f"direction/pos_tokens_q{k}"] for k in (1, 2, 3, 4)) == int((exp.advantages[mask] > 0).sum())


def test_flag_reaches_metrics_and_plot(model_dir, tmp_path):
    args = build_parser().parse_args(["--model", str(model_dir), "--out", str(tmp_path / "r"), "--steps", "1",
                                      "--prompts-per-step", "2", "--n-samples", "4", "--max-new-tokens", "12",
                                      "--no-progress", "--track-direction"])  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.track_direction
    rows = LocalTrainer(cfg).run()
    assert "direction/tokens_q4" in rows[0] and rows[0]["direction_s"] >= 0
    assert (tmp_path / "r" / "plots.png").stat().st_size > 0
    plain = LocalTrainer(TrainConfig.from_dict({**cfg.to_dict(), "out": str(tmp_path / "p"), "track_direction": False}))
    assert not any(k.startswith("direction") for k in plain.run()[0])
