"""`openrlhf-lopti demo` end to end with tiny settings: warm-up, four methods, table, plots, resume rules."""

import json

import pytest
import torch

from openrlhf_lopti.__main__ import main as cli_main
from openrlhf_lopti.local.config import METHODS

TINY = ["--steps", "2", "--warmup-steps", "5", "--warmup-target", "0", "--prompts-per-step", "2", "--n-samples", "2",
        "--eval-prompts", "4", "--no-progress"]  # fmt: skip


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli_main(["demo", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    for method in METHODS:
        assert f"| {method} |" in printed
        rows = [json.loads(line) for line in (out / "runs" / method / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert [m["method"] for m in summary["methods"]] == list(METHODS)
    # wall and CPU seconds side by side, in the table and the json (CPU: this process's threads, so at most
    # threads x wall, plus rounding of the clocks)
    assert "| wall s | CPU s |" in printed
    for m in summary["methods"]:
        assert 0 < m["cpu_seconds"] <= torch.get_num_threads() * m["seconds"] + 0.05, m
    assert summary["warmup"]["warmup_cpu_seconds"] > 0
    assert summary["warmup"]["warmup_steps"] == 5
    assert (out / "demo.png").stat().st_size > 0 and (out / "summary.md").exists()
    assert (out / "warmup_model" / "lopti_local.json").exists()
    # same seed, same warm-up model, same puzzles: every method's first batch is sampled identically
    first = {m: json.loads((out / "runs" / m / "metrics.jsonl").read_text().splitlines()[0]) for m in METHODS}
    assert len({(r["reward"], r["response_tokens"]) for r in first.values()}) == 1

    # a second run into the same directory is refused; --resume finds everything done
    assert cli_main(["demo", "--out", str(out), *TINY]) == 2
    assert "holds outputs of an earlier run" in capsys.readouterr().err
    assert cli_main(["demo", "--out", str(out), "--resume", *TINY]) == 0
    assert "reusing the warm-up model" in capsys.readouterr().out
    for method in METHODS:
        assert len((out / "runs" / method / "metrics.jsonl").read_text().splitlines()) == 2

    # warmup.json records what built the warm-up; a --resume asking for another one is refused, naming the flag
    # (before: the methods still to run trained from the warm-up of the other seed, and the summary gave the new one)
    facts = json.loads((out / "warmup.json").read_text())
    assert facts["settings"] == {"seed": 0, "warmup_steps": 5, "warmup_target": 0.0, "eval_prompts": 4}
    summary = (out / "summary.json").read_bytes()
    for flags, shown in ((["--seed", "1"], "--seed 1 differs from the warm-up in"),
                         (["--warmup-steps", "50"], "--warmup-steps 50 differs")):  # fmt: skip
        assert cli_main(["demo", "--out", str(out), "--resume", *TINY, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and shown in err[0], err
    assert (out / "summary.json").read_bytes() == summary
    del facts["settings"]  # a warmup.json written before it recorded them: reused, and said so
    (out / "warmup.json").write_text(json.dumps(facts))
    assert cli_main(["demo", "--out", str(out), "--resume", *TINY, "--methods", "grpo"]) == 0
    assert "does not say which --seed, --warmup-steps, --warmup-target, --eval-prompts built it" in capsys.readouterr().out


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    assert cli_main(["demo", "--out", str(tmp_path / "a"), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert cli_main(["demo", "--out", str(tmp_path / "b"), "--methods", "grpo,ppo"]) == 2
    assert "--methods" in capsys.readouterr().err
    # (before: the second grpo resumed the first one's run and failed naming an --out the user never gave)
    assert cli_main(["demo", "--out", str(tmp_path / "d"), *TINY, "--methods", "grpo,ar,grpo"]) == 2
    assert capsys.readouterr().err == ("openrlhf-lopti demo: error: --methods names grpo twice: give each method once, "
                                       "got 'grpo,ar,grpo'\n")  # fmt: skip
    assert not (tmp_path / "d").exists()
    assert cli_main(["demo", "--out", str(tmp_path / "c"), "--threads", "-1"]) == 2
    assert "--threads must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [(["--n-samples", "1"], "--n-samples must be >= 2 for GRPO's group normalisation, got 1"),
     (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
     (["--eval-prompts", "-3"], "--eval-prompts must be an integer >= 0, got -3"),
     (["--seed", str(2**50)], f"--seed must be an integer with |seed| < 2**40, got {2**50}"),
     (["--device", "foo"], "--device must be auto, cpu, cuda or cuda:N, got 'foo'"),
     (["--warmup-target", "1.5"], "--warmup-target must be an accuracy in [0, 1], got 1.5")],
    ids=["n-samples", "lr", "eval-prompts", "seed", "device", "warmup-target"],
)  # fmt: skip
def test_every_run_setting_is_checked_before_the_warm_up(tmp_path, capsys, flags, message):
    """The methods' trainer settings were checked only when each run started, after the minutes of warm-up: a
    traceback there, and the warm-up model left in --out. Now one line before anything runs or is written."""
    out = tmp_path / "demo"
    assert cli_main(["demo", "--out", str(out), *flags]) == 2
    assert capsys.readouterr().err == f"openrlhf-lopti demo: error: {message}\n"
    assert not out.exists()
