"""The trainer end to end in-process on a tiny model: metrics, checkpoints, exact resumption, run-dir rules."""

import json
import re

import pytest
import torch

from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
from openrlhf_lopti.demo.warmup import supervised_warmup
from openrlhf_lopti.local.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from openrlhf_lopti.local.cli import build_parser, config_from_args
from openrlhf_lopti.local.config import TrainConfig
from openrlhf_lopti.local.model import load_model, save_model
from openrlhf_lopti.errors import UserError
from openrlhf_lopti.local import trainer as trainer_module
from openrlhf_lopti.local.trainer import LocalTrainer
from openrlhf_lopti.runs import read_metrics

TIMING = ("rollout_s", "train_s", "lopti/low/train_s", "lopti/high/train_s")  # wall times: differ from run to run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 1-layer model warmed up just enough to write tags sometimes, so rewards (and advantages) vary."""
    tok = build_word_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    torch.manual_seed(0)
    supervised_warmup(model, tok, 30, batch_size=16, lr=1e-2, progress=False)
    path = tmp_path_factory.mktemp("models") / "tiny"
    save_model(model, tok, path, prompt_style="compact")
    return path


def config(model_dir, out, **kw):
    base = dict(model=str(model_dir), out=str(out), steps=4, prompts_per_step=2, n_samples=4, max_new_tokens=16,
                mini_batch_size=4, lr=1e-2, kl_coef=0.01, loss_backend="torch", progress=False)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_a_run_writes_metrics_checkpoint_plots_and_a_loadable_model(model_dir, tmp_path, capsys):
    cfg = config(model_dir, tmp_path / "run", lopti=True, alpha=0.3, eval_prompts=4)
    rows = LocalTrainer(cfg).run()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    printed = [line for line in capsys.readouterr().out.splitlines() if "loss head on the" in line]
    assert printed == ["[openrlhf-lopti] local trainer: loss head on the torch backend (torch asked)"]  # once per run
    for key in ("reward", "accuracy", "kl", "lopti/low_token_frac", "ar/mean_weight", "clip_ratio", "grad_norm",
                "lopti/low/policy_loss", "lopti/high/policy_loss", "entropy"):  # fmt: skip
        assert all(key in r for r in rows), key
    assert 0.7 <= rows[0]["ar/mean_weight"] <= 1.0
    assert "eval_accuracy" in rows[-1] and "eval_accuracy" not in rows[0]
    out = tmp_path / "run"
    assert (out / "plots.png").stat().st_size > 0
    assert json.loads((out / "config.json").read_text())["lopti"] is True
    assert load_checkpoint(out)["step"] == 4
    model, tok, style = load_model(out / "final_model")
    assert style == "compact" and len(tok) == model.config.vocab_size
    # it trained: some gradient was nonzero and the saved weights moved away from the starting model's
    assert any(r["grad_norm"] > 0 for r in rows)
    start, _, _ = load_model(model_dir)
    moved = [not torch.equal(a, b) for a, b in zip(start.state_dict().values(), model.state_dict().values())]
    assert len(moved) == len(start.state_dict()) and any(moved)


@pytest.mark.parametrize(
    "optimizer",
    [{}, {"optimizer": "sgd", "momentum": 0.9, "lr": 0.3}, {"lopti_moments": "per-phase"}, {"lopti_lr_scale": 0.5}],
    ids=["adamw", "sgd-momentum", "per-phase-adamw", "lopti-lr-scale"],
)
def test_resume_after_a_crash_continues_exactly(model_dir, tmp_path, optimizer):
    """Kill simulated after step 2's checkpoint and half of step 3's log line: the resumed run drops the
    torn line, redoes step 3 and ends with the same metrics as a run that never stopped (the optimizer's
    state, SGD's momentum buffers or each phase's AdamW moments, restored with it)."""
    full_trainer = LocalTrainer(config(model_dir, tmp_path / "full", lopti=True, **optimizer))
    full = full_trainer.run()
    crashed = tmp_path / "crashed"
    LocalTrainer(config(model_dir, crashed, lopti=True, steps=2, **optimizer)).run()
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # the line being written when the process died
    resumed = LocalTrainer(config(model_dir, crashed, lopti=True, **optimizer), resume=True)
    assert resumed.step == 2
    rows = resumed.run()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert strip(rows) == strip(full)
    kind = torch.optim.SGD if optimizer.get("optimizer") == "sgd" else torch.optim.AdamW
    expected = 2 if optimizer.get("lopti_moments") == "per-phase" else 1
    assert [type(o) for o in resumed.optimizers] == [kind] * expected
    for a, b in zip(full_trainer.optimizers, resumed.optimizers, strict=True):
        for p, q in zip(a.state.values(), b.state.values(), strict=True):
            assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)
    if kind is torch.optim.SGD:
        assert resumed.optimizers[0].param_groups[0]["momentum"] == 0.9
    lr = 0.5e-2 if "lopti_lr_scale" in optimizer else resumed.cfg.lr  # config()'s lr 1e-2, scaled for Lopti
    assert all(o.param_groups[0]["lr"] == lr for o in resumed.optimizers)


def test_resume_refuses_changed_settings_and_out_dir_rules(model_dir, tmp_path):
    out = tmp_path / "run"
    LocalTrainer(config(model_dir, out, steps=1)).run()
    (out / "notes.txt").write_text("mine")  # a file of the user's, not of the run
    with pytest.raises(UserError, match="holds outputs of an earlier run .*--resume.*--overwrite"):
        LocalTrainer(config(model_dir, out, steps=1))
    with pytest.raises(UserError, match=r"--alpha \(run: 0.0, now: 0.5\)"):
        LocalTrainer(config(model_dir, out, steps=2, alpha=0.5), resume=True)
    with pytest.raises(UserError, match="exclude"):
        LocalTrainer(config(model_dir, out), resume=True, overwrite=True)
    LocalTrainer(config(model_dir, out, steps=1), overwrite=True).run()  # allowed: replaces the run's files only
    assert (out / "notes.txt").read_text() == "mine" and load_checkpoint(out)["config"]["steps"] == 1


def test_a_plain_resume_continues_to_the_steps_an_earlier_resume_extended_the_run_to(model_dir, tmp_path):
    """A 1-step run, resumed with --steps 3 and killed before its next step, then resumed with no flag: it goes on to
    step 3. config.json held the first run's --steps and a plain --resume read it: it stopped at step 1, wrote
    final_model/ and said nothing."""
    out = tmp_path / "run"
    LocalTrainer(config(model_dir, out, steps=1)).run()
    LocalTrainer(config(model_dir, out, steps=3), resume=True)  # extended; killed before its first step
    cfg = config_from_args(build_parser().parse_args(["--resume", "--out", str(out)]))
    assert cfg.steps == 3 and json.loads((out / "config.json").read_text())["steps"] == 3
    assert [r["step"] for r in LocalTrainer(cfg, resume=True).run()][-1] == 3
    assert sorted(p.name for p in out.glob(".config.json.tmp-*")) == []


def test_a_run_that_fails_before_its_first_step_leaves_its_folder_reusable(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"

    def fail(*args, **kwargs):
        raise RuntimeError("killed in the first step")

    monkeypatch.setattr(trainer_module, "update_policy", fail)
    with pytest.raises(RuntimeError, match="first step"):
        LocalTrainer(config(model_dir, out, steps=1)).run()
    assert list(out.iterdir()) == []  # no config.json: the retry is not refused
    monkeypatch.undo()
    assert [r["step"] for r in LocalTrainer(config(model_dir, out, steps=1)).run()] == [1]


def test_checkpoint_write_is_atomic(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, model=model, optimizer=opt, step=1, metrics_offset=10, config={"a": 1})
    (tmp_path / f".{CHECKPOINT_FILE}.tmp-999").write_bytes(b"half a checkpo")  # a writer that died
    ckpt = load_checkpoint(tmp_path)
    assert ckpt["step"] == 1 and ckpt["metrics_offset"] == 10 and ckpt["config"] == {"a": 1}
    assert torch.equal(ckpt["model"]["weight"], model.weight.detach())
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_FILE]
    (tmp_path / "empty").mkdir()
    assert load_checkpoint(tmp_path / "empty") is None


def test_cli_precedence_defaults_saved_preset_flags(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    saved = TrainConfig(model="m0", out=str(out), lr=0.5, alpha=0.1, steps=3).to_dict()
    (out / "config.json").write_text(json.dumps(saved))
    parse = build_parser().parse_args
    cfg = config_from_args(parse(["--resume", "--out", str(out), "--steps", "9"]))
    assert (cfg.model, cfg.lr, cfg.alpha, cfg.steps) == ("m0", 0.5, 0.1, 9)
    cfg = config_from_args(parse(["--model", "m", "--out", "x", "--method", "ar+lopti", "--alpha", "0.2"]))
    assert (cfg.alpha, cfg.lopti, cfg.people) == (0.2, True, [2])
    cfg = config_from_args(parse(["--model", "m", "--out", "o", "--people", "3,4", "--no-lopti", "--method", "lopti"]))
    assert cfg.people == [3, 4] and cfg.lopti is False
    with pytest.raises(UserError, match=r"^--model is required \(a local Hugging Face checkpoint folder\)$"):
        config_from_args(parse(["--out", "o"]))
    empty = tmp_path / "empty"
    with pytest.raises(UserError, match=re.escape(f"; --resume found no run in {empty} (no config.json)") + "$"):
        config_from_args(parse(["--resume", "--out", str(empty)]))
    with pytest.raises(UserError, match="--resume needs --out"):
        config_from_args(parse(["--resume"]))
    cfg = config_from_args(parse(["--model", "m", "--out", "o", "--optimizer", "sgd", "--momentum", "0.5"]))
    assert (cfg.optimizer, cfg.momentum, cfg.lopti_moments) == ("sgd", 0.5, "shared")
    with pytest.raises(UserError, match="^--momentum is an sgd setting"):
        config_from_args(parse(["--model", "m", "--out", "o", "--momentum", "0.5"]))
    with pytest.raises(UserError, match="^--optimizer must be one of"):
        config_from_args(parse(["--model", "m", "--out", "o", "--optimizer", "adam"]))
    assert read_metrics(tmp_path / "r" / "config.json") == [saved]


def test_any_hf_model_with_a_chat_template_trains(tmp_path):
    """A checkpoint without the demo marker gets kk.make_prompt through its chat template (prompt style auto)."""
    tok = build_word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    save_model(model, tok, tmp_path / "plain")  # no prompt style recorded
    trainer = LocalTrainer(config(tmp_path / "plain", tmp_path / "run", steps=1, max_new_tokens=4))
    assert trainer.prompt_style == "chat"
    rows = trainer.run()
    assert rows[0]["step"] == 1 and rows[0]["reward"] == -3.0


def snapshot(folder):
    """Every file under ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_removes_the_earlier_run_only_once_the_first_step_is_done(model_dir, tmp_path, monkeypatch):
    """(Before: --overwrite removed the earlier run first, so a typo in --reward-file or --data, or a failure in the
    first step, lost it, and the command failed anyway.)"""
    out = tmp_path / "run"
    LocalTrainer(config(model_dir, out, steps=1)).run()
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    bad_reward = tmp_path / "bad_reward.py"
    bad_reward.write_text("def reward_func(queries, prompts, labels):\n    raise RuntimeError('boom')\n")
    with pytest.raises(UserError, match="reward_func raised RuntimeError: boom"):
        LocalTrainer(config(model_dir, out, steps=1, reward_file=str(bad_reward)), overwrite=True)
    with pytest.raises(UserError, match="--data .*no such file"):
        LocalTrainer(config(model_dir, out, steps=1, data=str(tmp_path / "typo.jsonl"),
                            reward_file=str(bad_reward)), overwrite=True)  # fmt: skip

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory in the first step")

    monkeypatch.setattr(trainer_module, "update_policy", fail)
    with pytest.raises(RuntimeError, match="first step"):
        LocalTrainer(config(model_dir, out, steps=1, alpha=0.3), overwrite=True).run()
    assert snapshot(out) == before
    monkeypatch.undo()
    LocalTrainer(config(model_dir, out, steps=1, alpha=0.3), overwrite=True).run()
    assert load_checkpoint(out)["config"]["alpha"] == 0.3 and (out / "notes.txt").read_text() == "mine"


def test_overwrite_never_removes_an_input_that_has_an_outputs_name(model_dir, tmp_path):
    """--data, --eval-data (each of a comma-separated list) and --reward-file are inputs, as --model is: one named as
    an output is refused, not removed. (Before: only --model was checked; --data out/metrics.jsonl was deleted by
    --overwrite, then reported missing.)"""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"prompt": "a", "label": "b"}\n')
    (out / "final_model").mkdir()
    reward = "def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n"
    (out / "final_model" / "reward.py").write_text(reward)
    (tmp_path / "reward.py").write_text(reward)
    rows, reward = tmp_path / "rows.jsonl", str(tmp_path / "reward.py")
    rows.write_text('{"prompt": "a", "label": "b"}\n')
    before = snapshot(out)
    cases = [("--data", dict(data=str(out / "metrics.jsonl"), reward_file=reward)),
             ("--eval-data", dict(eval_data=f"{rows},{out / 'metrics.jsonl'}", reward_file=reward)),
             ("--reward-file", dict(data=str(rows), reward_file=str(out / "final_model" / "reward.py")))]  # fmt: skip
    for flag, kw in cases:
        with pytest.raises(UserError, match=f"^--out {out} would write over {flag} "):
            LocalTrainer(config(model_dir, out, steps=1, **kw), overwrite=True)
    assert snapshot(out) == before


def test_a_lopti_run_resumes_with_the_eta_it_ran_with_however_saved(model_dir, tmp_path):
    """A quantile run saved by an older version (eta 0.5 written in config.json and the checkpoint, the quantile won)
    resumes; so does a GRPO run of that version (eta 0.5 written, no Lopti); and --eta 0.5 is the eta a Lopti run left
    unset. (Before: "--resume: --eta (run: 0.5, now: None) differ": config.json's stale eta was dropped, not the
    checkpoint's; and "(run: None, now: 0.5)".)"""
    for name, kw in (("quantile", dict(lopti_quantile=0.2)), ("grpo", {})):
        out = tmp_path / name
        LocalTrainer(config(model_dir, out, steps=1, **kw)).run()
        saved = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**saved, "eta": 0.5}))  # as the older version wrote them
        ckpt = load_checkpoint(out)
        ckpt["config"]["eta"] = 0.5
        torch.save(ckpt, out / CHECKPOINT_FILE)
        cfg = config_from_args(build_parser().parse_args(["--out", str(out), "--resume", "--steps", "2"]))
        assert cfg.eta is None
        assert [r["step"] for r in LocalTrainer(cfg, resume=True).run()] == [1, 2]
        assert load_checkpoint(out)["config"]["eta"] is None
    out = tmp_path / "lopti"
    LocalTrainer(config(model_dir, out, steps=1, lopti=True)).run()
    assert [r["step"] for r in LocalTrainer(config(model_dir, out, steps=2, lopti=True, eta=0.5), resume=True).run()] \
        == [1, 2]  # fmt: skip
    with pytest.raises(UserError, match=r"--eta \(run: 0.5, now: 0.3\)"):
        LocalTrainer(config(model_dir, out, steps=3, lopti=True, eta=0.3), resume=True)


def test_a_refused_resume_is_one_line_and_rewrites_nothing(model_dir, tmp_path):
    """--steps below the checkpoint's step, a missing or cut metrics.jsonl, a damaged checkpoint.pt: one line each,
    and config.json and metrics.jsonl stay as they were. (Before: --steps 1 on a 2-step run was taken and config.json
    said steps 1; a missing metrics.jsonl or a damaged checkpoint was a traceback, after config.json was rewritten.)"""
    out = tmp_path / "run"
    LocalTrainer(config(model_dir, out, steps=2)).run()
    before = snapshot(out)
    with pytest.raises(UserError, match=f"^--resume: the run in {out} has done 2 steps, more than --steps 1: give "
                                        "--steps 2 or more$"):  # fmt: skip
        LocalTrainer(config(model_dir, out, steps=1), resume=True)
    assert snapshot(out) == before
    metrics = (out / "metrics.jsonl").read_bytes()
    for cut in (b"", None):
        if cut is None:
            (out / "metrics.jsonl").unlink()
        else:
            (out / "metrics.jsonl").write_bytes(metrics[:-10])
        with pytest.raises(UserError, match=r"^--resume: .*metrics.jsonl is missing or shorter than when step 2 was "
                                            r"checkpointed \(\d+ bytes\): put it back"):  # fmt: skip
            LocalTrainer(config(model_dir, out, steps=3), resume=True)
        assert (out / "config.json").read_bytes() == before["config.json"]
    (out / "metrics.jsonl").write_bytes(metrics)
    (out / CHECKPOINT_FILE).write_bytes(before[CHECKPOINT_FILE][:1000])  # damaged after it was written
    with pytest.raises(UserError, match=r"^--resume: .*checkpoint.pt cannot be read as a checkpoint \(PytorchStreamReader "
                                        r"failed reading zip archive: failed finding central directory\): start the "
                                        r"run again with --overwrite"):  # fmt: skip
        LocalTrainer(config(model_dir, out, steps=3), resume=True)
    assert (out / "config.json").read_bytes() == before["config.json"]


def test_a_resume_whose_model_folder_changed_is_one_line(tmp_path):
    """The checkpoint's weights do not fit the --model folder any more (replaced by another architecture): one line,
    config.json untouched. (Before: load_state_dict's size-mismatch traceback, after config.json was rewritten.)"""
    tok = build_word_tokenizer()
    save_model(build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0), tok, tmp_path / "m")
    out = tmp_path / "run"
    LocalTrainer(config(tmp_path / "m", out, steps=1, max_new_tokens=4)).run()
    save_model(build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2, seed=0), tok, tmp_path / "m")
    saved = (out / "config.json").read_bytes()
    with pytest.raises(UserError, match=f"^--resume: the checkpoint in {out} does not fit --model {tmp_path / 'm'} "
                                        r"\(changed since the run started\?\): Error\(s\) in loading state_dict"):
        LocalTrainer(config(tmp_path / "m", out, steps=2, max_new_tokens=4), resume=True)
    assert (out / "config.json").read_bytes() == saved


def test_eval_n_samples_samples_the_kk_held_out_set_too(model_dir, tmp_path, monkeypatch):
    """--eval-n-samples k without --eval-data: k responses per held-out puzzle, sampled at --temperature, scored by the
    paper's rule (accuracy avg@k). (Before: ignored, always one greedy response.)"""
    from openrlhf_lopti.local import evaluation

    calls = []

    def spy(model, tokenizer, prompts, n_samples, max_new_tokens, temperature=1.0, greedy=False):
        calls.append((len(prompts), n_samples, temperature, greedy))
        return generate(model, tokenizer, prompts, n_samples, max_new_tokens, temperature, greedy)

    generate = evaluation.generate_rollouts
    monkeypatch.setattr(evaluation, "generate_rollouts", spy)
    for k, expected in ((4, (3, 4, 0.9, False)), (1, (3, 1, 0.9, True))):
        calls.clear()
        trainer = LocalTrainer(config(model_dir, tmp_path / f"k{k}", steps=1, eval_prompts=3, eval_n_samples=k,
                                      temperature=0.9))  # fmt: skip
        metrics = trainer.evaluate()
        assert calls == [expected] and 0 <= metrics["accuracy"] <= 1 and -3 <= metrics["reward"] <= 3
