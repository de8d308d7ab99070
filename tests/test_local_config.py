"""TrainConfig validation, method presets and the GRPO / REINFORCE++ advantage estimators."""

import re
from pathlib import Path

import pytest
import torch

from openrlhf_lopti.local.advantages import grpo_advantages, reinforce_pp_advantages
from openrlhf_lopti.local.config import METHODS, ConfigError, TrainConfig, method_settings


def make(**kw):
    return TrainConfig(model="m", out="o", **kw)


@pytest.mark.parametrize(
    "field, value",
    [
        ("alpha", 1.5), ("eta", -0.1), ("lopti_order", "sideways"), ("lopti_quantile", 1.0), ("steps", 0),
        ("n_samples", 1), ("people", [1]), ("temperature", 0.0), ("lr", float("nan")), ("grad_clip", -1.0),
        ("eps_low", 1.0), ("kl_estimator", "k4"), ("dtype", "float16"), ("loss_backend", "cuda"),
        ("estimator", "ppo"), ("micro_batch_size", -1), ("prompt_style", "fancy"), ("optimizer", "adam"),
        ("momentum", 1.0), ("momentum", 0.9), ("lopti_moments", "split"),  # momentum 0.9 with the default adamw
        ("lopti_lr_scale", 0.0), ("lopti_lr_scale", 1.5), ("lopti_lr_scale", float("nan")),
        # each gave a traceback mid-run: a seed whose derived seeds overflow int64 (after the first rollout), a
        # device torch cannot parse (at model.to), a template whose literal braces str.format reads as fields
        ("seed", 10**14), ("seed", True), ("device", "foo"), ("device", "cuda:x"),
        ("input_template", r"Q: {} Put the answer in \boxed{}."), ("input_template", "Q: {question} A: {}"),
        # finite in float64, not in the loss's float32: a traceback in step 1 (inf/NaN logits), or garbage weights
        ("temperature", 1e-40), ("temperature", 1e39), ("kl_coef", 1e39), ("eps_high", 1e39), ("lr", 1e39),
        ("weight_decay", 1e39),
    ],
)  # fmt: skip
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"^{field} ") as err:
        make(**{field: value})
    assert err.value.field == field  # the CLI turns it into the field's flag


def test_a_template_with_escaped_braces_and_the_accepted_devices_and_seeds():
    assert make(input_template=r"Q: {} Put the answer in \boxed{{}}.").input_template.format("x").endswith(
        r"\boxed{}.")
    assert [make(device=d).device for d in ("auto", "cpu", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]
    assert make(seed=-(2**40) + 1).seed < 0


def test_a_cuda_device_this_machine_lacks_is_one_line_before_anything_loads(monkeypatch):
    from openrlhf_lopti.errors import UserError
    from openrlhf_lopti.local.trainer import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"^--device cuda:1: torch .* sees 0 CUDA device\(s\) here; use --device cpu"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == torch.device("cpu")


def test_eta_zero_means_lopti_off_as_in_the_openrlhf_cli():
    assert make(eta=0.0).lopti is False  # accepted: Lopti is off anyway
    with pytest.raises(ConfigError, match="eta 0 means Lopti off") as err:
        make(eta=0.0, lopti=True)
    assert err.value.field == "eta"


@pytest.mark.parametrize("lopti", [False, True])
def test_eta_zero_with_a_quantile_is_eta_unset(lopti):
    """algo.lopti_settings' eta 0 = unset, as OpenRLHF's --algo.lopti.eta 0 with --algo.lopti.quantile. (Before: refused,
    "eta 0 means Lopti off ... but lopti is on (--lopti or a lopti --method)", though only the quantile turned it on.)"""
    from openrlhf_lopti.algo import LoptiSettings
    from openrlhf_lopti.local.cli import build_parser, config_from_args

    assert make(eta=0, lopti=lopti, lopti_quantile=0.3).lopti_settings == LoptiSettings(0.5, "low_first", 0.3)
    argv = ["--model", "m", "--out", "o", "--eta", "0", "--lopti-quantile", "0.3"] + ["--lopti"] * lopti
    assert config_from_args(build_parser().parse_args(argv)).lopti_settings == LoptiSettings(0.5, "low_first", 0.3)


def test_eta_and_a_quantile_together_are_refused_naming_both():
    """algo's one rule (docs/LOPTI_ROUND.md); a quantile alone, or eta alone, is accepted. (Before: the quantile won
    and --eta was ignored without a word.)"""
    from openrlhf_lopti.errors import UserError
    from openrlhf_lopti.local.cli import build_parser, config_from_args

    with pytest.raises(ConfigError, match="^eta=0.3 and lopti_quantile=0.2 are two Lopti thresholds") as err:
        make(lopti=True, eta=0.3, lopti_quantile=0.2)
    assert err.value.field == "eta"
    argv = ["--model", "m", "--out", "o", "--lopti", "--eta", "0.3", "--lopti-quantile", "0.2"]
    with pytest.raises(UserError) as refusal:  # both by their flags (docs/LOPTI_ROUND.md; before: lopti_quantile=0.2)
        config_from_args(build_parser().parse_args(argv))
    assert str(refusal.value) == ("--eta=0.3 and --lopti-quantile=0.2 are two Lopti thresholds: give one "
                                  "(--lopti-quantile alone turns Lopti on)")  # fmt: skip
    assert str(err.value.as_flag_error()) == str(refusal.value)
    assert make(lopti_quantile=0.2).lopti_settings.quantile == 0.2 and make(lopti=True, eta=0.3).lopti_settings.eta == 0.3
    assert make(lopti=True).lopti_settings.eta == 0.5  # eta unset: the paper's


def test_presets_and_method_names():
    assert METHODS["ar"][0] == 0.3  # the paper's K&K alpha
    names = {m: make(**method_settings(m)).method for m in METHODS}
    assert names == {m: m for m in METHODS}
    assert make(estimator="reinforce++", alpha=0.3).method == "reinforce++:ar"
    with pytest.raises(ValueError, match="method"):
        method_settings("ppo")


def test_dict_round_trip_and_unknown_keys():
    cfg = make(alpha=0.1, people=[3, 4])
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown config fields"):
        TrainConfig.from_dict({**cfg.to_dict(), "beta": 1})


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([3.0, -3.0, 3.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.bool)
    adv = grpo_advantages(rewards, 3, mask)
    first = (torch.tensor([3.0, -3.0, 3.0]) - 1.0) / torch.tensor([3.0, -3.0, 3.0]).std()
    assert torch.allclose(adv[:3, 0], first, atol=1e-6)
    assert torch.equal(adv[3:], torch.zeros(3, 3))  # a group of equal rewards has nothing to learn
    assert torch.equal(adv[:, 2], torch.zeros(6))
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(rewards, 4, mask)


def test_reinforce_pp_advantages_by_hand():
    rewards = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    old = torch.tensor([[-0.1, -0.2, -0.3], [-0.5, -0.4, 0.0]])
    ref = torch.tensor([[-0.2, -0.2, -0.1], [-0.5, -0.6, 0.0]])
    kl = 0.5
    token = -kl * (old - ref) * mask
    token[0, 2] += 1.0
    token[1, 1] += -1.0
    returns = torch.stack([token[0].flip(0).cumsum(0).flip(0), token[1].flip(0).cumsum(0).flip(0)]) * mask
    values = returns[mask]
    expected = (returns - values.mean()) / values.var(unbiased=False).sqrt() * mask
    got = reinforce_pp_advantages(rewards, mask, old, ref, kl)
    assert torch.allclose(got, expected, atol=1e-5)
    assert got[1, 2] == 0


def test_train_defaults_are_the_demo_settings():
    # `openrlhf-lopti train` with no flags trains as the demo does (issue 40: with lr 1e-3, 32 new tokens and torch's
    # thread count, the README's 50 AR+Lopti steps on the demo's model lowered its reward, and ran ~9x slower).
    from openrlhf_lopti.demo.run import MAX_NEW_TOKENS, build_parser as demo_parser, method_config
    from openrlhf_lopti.local.cli import build_parser as train_parser

    demo_args = demo_parser().parse_args([])
    demo = method_config(Path("demo"), "grpo", demo_args)
    train = TrainConfig(model="m", out="o")
    shared = ("lr", "max_new_tokens", "temperature", "people", "prompts_per_step", "n_samples", "mini_batch_size",
              "seed", "kl_coef", "eps_low", "eps_high", "optimizer", "estimator", "epochs", "grad_clip")
    assert {k: getattr(train, k) for k in shared} == {k: getattr(demo, k) for k in shared}
    assert (train.lr, train.max_new_tokens) == (5e-4, MAX_NEW_TOKENS) == (5e-4, 20)
    assert train_parser().parse_args(["--model", "m"]).threads is None and demo_args.threads == 1  # None: 1, told


def test_train_tells_a_many_core_user_of_its_one_thread_default(monkeypatch, capsys, tmp_path):
    """(Before: --threads defaulted to 1 outside the demo too, and a many-core CPU user ran several times slower
    without a word.)"""
    import torch

    import openrlhf_lopti.local.trainer as trainer_module
    from openrlhf_lopti.local.cli import main

    class NoTraining:
        def __init__(self, cfg, **kwargs):
            self.out = cfg.out

        def run(self):
            return []

    monkeypatch.setattr(trainer_module, "LocalTrainer", NoTraining)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert main(["--model", "m", "--out", str(tmp_path)]) == 0
        assert torch.get_num_threads() == 1
        told = capsys.readouterr().out
        assert "train: 1 torch thread (the default, as the demo's); --threads 0 gives torch's choice, 4 here" in told
        torch.set_num_threads(4)
        assert main(["--model", "m", "--out", str(tmp_path), "--threads", "0"]) == 0
        assert torch.get_num_threads() == 4 and "torch thread" not in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)


def test_train_refuses_negative_threads():
    from openrlhf_lopti.errors import UserError
    from openrlhf_lopti.local.cli import main

    with pytest.raises(UserError, match=r"^--threads must be >= 0 \(0: torch's choice\), got -1$"):
        main(["--model", "m", "--out", "o", "--threads", "-1"])


def test_a_config_saved_before_the_eta_and_quantile_rule_resumes_with_its_quantile(tmp_path):
    """A config.json written when eta was always saved (0.5 by default) and a quantile won over it. (Before: --resume
    refused it, "eta=0.5 and lopti_quantile=0.3 are two Lopti thresholds", though the user gave one.)"""
    import json

    from openrlhf_lopti.local.cli import build_parser, config_from_args

    saved = TrainConfig(model="m", out=str(tmp_path), lopti_quantile=0.3).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**saved, "eta": 0.5}))
    cfg = config_from_args(build_parser().parse_args(["--out", str(tmp_path), "--resume"]))
    assert (cfg.eta, cfg.lopti_quantile, cfg.lopti) == (None, 0.3, True)


def test_a_bad_people_list_names_the_expected_form():
    from openrlhf_lopti.errors import UserError
    from openrlhf_lopti.local.cli import build_parser

    with pytest.raises(UserError, match=r"^argument --people: expected comma-separated K&K sizes, e\.g\. 3,4,5, "
                                        r"got '3,x' \(see"):  # fmt: skip
        build_parser().parse_args(["--people", "3,x"])
    assert build_parser().parse_args(["--people", "3, 4,"]).people == [3, 4]
    # an empty entry inside is a size lost in typing, not a separator to skip (was read as 3,4)
    with pytest.raises(UserError, match=r"^argument --people: expected comma-separated K&K sizes, e\.g\. 3,4,5, "
                                        r"got '3,,4' \(see"):  # fmt: skip
        build_parser().parse_args(["--people", "3,,4"])


def test_out_of_range_numbers_are_one_line_naming_the_flag():
    """(Before: --temperature 1e-40, --kl-coef 1e39 passed the float64 check and crashed in step 1 with a traceback.)"""
    from openrlhf_lopti.errors import UserError
    from openrlhf_lopti.local.cli import build_parser, config_from_args

    cases = (("--temperature", "1e-40", "must be a finite number > 0"), ("--kl-coef", "1e39", "must be a finite number"),
             ("--lr", "1e39", "must be a finite number > 0"), ("--weight-decay", "1e39", "must be a finite number >= 0"))
    for flag, value, form in cases:
        with pytest.raises(UserError, match="^" + re.escape(f"{flag} {form}, got {float(value)!r}") + "$"):
            config_from_args(build_parser().parse_args(["--model", "m", "--out", "o", flag, value]))
