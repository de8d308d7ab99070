"""`openrlhf-lopti study`: confidence intervals (t quantiles from a table), per-run summaries, the folder rules,
and the command end to end with tiny settings (subprocesses, resume)."""

import json
import math

import pytest

from openrlhf_lopti.__main__ import main as cli_main
from openrlhf_lopti.audit.stats import format_ci, mean_ci, paired_differences, t_quantile
from openrlhf_lopti.audit.study import FIG3_KEYS, FIRST_STEPS, RUN_DONE_FILE, SETTINGS_FILE, open_study, run_summary

# Two-sided 95% critical values of Student's t (any statistics table).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 19: 2.093, 29: 2.045, 100: 1.984}


def test_t_quantile_matches_the_table():
    for df, want in T_975.items():
        assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-3), df
    assert t_quantile(0.95, 10) == pytest.approx(1.812, abs=1e-3)
    assert t_quantile(0.995, 4) == pytest.approx(4.604, abs=1e-3)
    with pytest.raises(ValueError, match="prob"):
        t_quantile(0.4, 3)


def test_mean_ci_by_hand():
    ci = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)  # sd^2 = 10 / 4
    assert ci["mean"] == 3.0 and ci["n"] == 5
    assert ci["lo"] == pytest.approx(3.0 - half, abs=1e-3) and ci["hi"] == pytest.approx(3.0 + half, abs=1e-3)
    one = mean_ci([0.4, float("nan"), None])
    assert one["mean"] == 0.4 and one["n"] == 1 and one["lo"] is None  # no interval from one value
    assert mean_ci([])["mean"] is None and format_ci(mean_ci([])) == "-"
    assert format_ci(mean_ci([0.5, 0.7]), ".2f") == "0.60 [-0.67, 1.87]"  # t(1) = 12.706, sd/sqrt(2) = 0.1
    assert paired_differences({0: 0.5, 1: 0.7, 2: 0.9}, {0: 0.4, 1: 0.8, 3: 0.1}) == pytest.approx([0.1, -0.1])


def test_run_summary_pools_direction_counts_over_steps():
    rows = [
        {"step": 1, "reward": -1.0, "low_token_fraction": 0.2, "direction/pos_up_q4": 0.5,
         "direction/pos_tokens_q4": 10.0, "direction/tokens_q4": 30.0, "direction/tokens_q1": 10.0},
        {"step": 2, "reward": 1.0, "low_token_fraction": 0.1, "direction/pos_up_q4": 1.0,
         "direction/pos_tokens_q4": 30.0, "direction/tokens_q4": 40.0, "direction/tokens_q1": 20.0,
         "eval_accuracy": 0.25},
    ]  # fmt: skip
    s = run_summary(rows)
    assert s["pos_up_q4"] == pytest.approx((5 + 30) / 40)  # pooled, not the mean of 0.5 and 1.0
    assert s["pos_up_q1"] is None and s["neg_down_q4"] is None  # no positive / negative tokens there
    assert s["eval_accuracy"] == 0.25 and s["reward_last"] == 1.0 and s["reward_first"] == -1.0
    assert s["token_share_by_bin"] == pytest.approx([0.3, 0.0, 0.0, 0.7])
    assert s["low_token_fraction"] == pytest.approx(0.15)
    # Fig. 3 by quartile over the first FIRST_STEPS steps and over the rest, each pooled on its own
    later = [{**rows[1], "step": k, "direction/pos_up_q4": 0.25} for k in range(3, FIRST_STEPS + 3)]
    s = run_summary(rows + later)
    first = (5 + 30 + 0.25 * 30 * (FIRST_STEPS - 2)) / (40 + 30 * (FIRST_STEPS - 2))  # steps 1..FIRST_STEPS
    assert s["pos_up_q4_first"] == pytest.approx(first) and s["pos_up_q4_rest"] == pytest.approx(0.25)
    assert s["pos_up_q1_first"] is None and s["pos_up_q1_rest"] is None


def test_a_different_study_is_refused_and_overwrite_removes_only_its_files(tmp_path):
    out = tmp_path / "s"
    (out / "runs" / "grpo").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="no study_settings.json"):
        open_study(out, {"steps": 3}, overwrite=False)
    open_study(out, {"steps": 3}, overwrite=True)
    assert not (out / "runs").exists() and (out / "notes.txt").read_text() == "mine"
    (out / "runs").mkdir()
    open_study(out, {"steps": 3}, overwrite=False)  # the same study: resumed, nothing removed
    assert (out / "runs").exists()
    with pytest.raises(ValueError, match="different study.*steps"):
        open_study(out, {"steps": 4}, overwrite=False)
    open_study(out, {"steps": 4}, overwrite=True)
    assert json.loads((out / SETTINGS_FILE).read_text()) == {"steps": 4} and not (out / "runs").exists()


TINY = ["--seeds", "2", "--methods", "grpo,ar", "--steps", "2", "--prompts-per-step", "2", "--n-samples", "2",
        "--eval-prompts", "4", "--warmup-steps", "3", "--warmup-target", "0", "--people", "2", "--hidden-size", "16",
        "--num-layers", "1", "--no-progress", "--loss-backend", "torch"]  # fmt: skip


def test_study_end_to_end_with_sgd_and_train_args_then_resume(tmp_path, capsys):
    """One tiny study (2 seeds x GRPO and Lopti, subprocesses; the suite's most expensive command, so it runs once
    and everything is read off it): the report, the runs' metrics and the paired analysis; --optimizer and
    --train-args reach every run's config (and the study's setting and report); the Fig. 3 quartile shares per
    method and paired; --compare; resume (nothing to do, then a run that lost its finish mark continues with
    `train --resume`); a different setting in the same folder, a train flag the study owns, a bad one, or a bad
    combination is refused before anything is written."""
    out = tmp_path / "study"
    argv = ["study", "--out", str(out), *TINY, "--methods", "grpo,lopti", "--optimizer", "sgd",
            "--train-args", "--lr 0.05 --momentum 0.9 --lopti-moments per-phase --lopti-lr-scale 0.5"]  # fmt: skip
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "6 of 6 jobs to run" in printed and "| grpo |" in printed and "| lopti |" in printed
    result = json.loads((out / "study.json").read_text())
    assert result["seeds"] == [0, 1] and result["methods"] == ["grpo", "lopti"]
    for method in ("grpo", "lopti"):
        assert result["per_method"][method]["eval_accuracy"]["n"] == 2
        for seed in (0, 1):
            rows = [json.loads(x) for x in (out / "runs" / method / f"seed{seed}" / "metrics.jsonl").open()]
            assert [r["step"] for r in rows] == [1, 2] and all("direction/tokens_q4" in r for r in rows)
            assert result["runs"][method][str(seed)]["reward_last"] == rows[-1]["reward"]
            config = json.loads((out / "runs" / method / f"seed{seed}" / "config.json").read_text())
            assert (config["optimizer"], config["lr"], config["momentum"]) == ("sgd", 0.05, 0.9)
            assert config["lopti_moments"] == "per-phase" and config["seed"] == seed
            assert config["lopti_lr_scale"] == 0.5
    grpo, lopti = (result["runs"][m] for m in ("grpo", "lopti"))
    diffs = [lopti[s]["reward_last"] - grpo[s]["reward_last"] for s in ("0", "1")]
    assert result["paired_vs_grpo"]["lopti"]["reward_last"]["mean"] == pytest.approx(sum(diffs) / 2)
    assert (out / "study.png").stat().st_size > 0 and "Paired differences" in (out / "study.md").read_text()
    settings = json.loads((out / SETTINGS_FILE).read_text())
    assert settings["optimizer"] == "sgd" and settings["train_args"].endswith("--lopti-moments per-phase --lopti-lr-scale 0.5")
    assert result["train_config"]["optimizer"] == "sgd" and result["train_config"]["lr"] == 0.05
    assert set(FIG3_KEYS) <= set(result["per_method"]["lopti"]) and set(FIG3_KEYS) <= set(result["paired_vs_grpo"]["lopti"])
    text = (out / "study.md").read_text()
    assert "SGD lr 0.05 (momentum 0.9), Lopti per-phase optimizer state, Lopti lr x 0.5" in text and "Q4, steps 1-5" in text
    # --compare prints studies side by side from their study.json
    assert cli_main(["study", "--compare", str(out), str(out)]) == 0
    table = capsys.readouterr().out
    assert table.count("| lopti - grpo |") == 2 and "SGD lr 0.05" in table
    assert cli_main(["study", "--compare", str(tmp_path)]) == 2 and "no study.json" in capsys.readouterr().err

    # Run again: nothing to do. Then a run that lost its finish mark (killed after its last checkpoint)
    # is continued with `train --resume`, not redone.
    assert cli_main(argv) == 0 and "0 of 6 jobs to run" in capsys.readouterr().out
    run = out / "runs" / "lopti" / "seed1"
    (run / RUN_DONE_FILE).unlink()
    before = (run / "metrics.jsonl").read_text()
    assert cli_main(argv) == 0
    assert "1 of 6 jobs to run" in capsys.readouterr().out
    assert (run / RUN_DONE_FILE).exists() and (run / "metrics.jsonl").read_text() == before
    assert (out / "logs" / "lopti-seed1.log").read_text().split("$ ")[-1].split("\n")[0].endswith("--resume")

    # A different setting in the same folder is refused: another study flag, or the train args left out.
    assert cli_main([*argv, "--steps", "3"]) == 2
    assert "different study" in capsys.readouterr().err
    assert cli_main(argv[:-2]) == 2 and "train_args" in capsys.readouterr().err
    for train_args, message in [
        ("--seed 3", "--seed is set by the study (--seeds)"),
        ("--method lopti", "--method is set by the study (--methods)"),
        ("--no-track-direction", "--track-direction is set by the study"),
        ("--bogus 1", "unrecognized arguments: --bogus"),
        ("--momentum 0.9", "--momentum is an sgd setting"),
        ("--lr 'x", "No closing quotation"),
    ]:
        bad = tmp_path / "bad"
        assert cli_main(["study", "--out", str(bad), *TINY, "--train-args", train_args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("openrlhf-lopti study: error: --train-args") and message in err, err
        assert not bad.exists()


@pytest.mark.parametrize("people", ["a", "2,x", ",", "3,,4"])
def test_bad_people_is_one_line_naming_the_flag(tmp_path, capsys, people):
    out = tmp_path / "study"
    assert cli_main(["study", "--out", str(out), "--people", people, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("openrlhf-lopti study: error: --people") and "\n" not in err
    assert "comma-separated" in err and not out.exists()


def test_a_study_written_before_optimizer_and_train_args_resumes(tmp_path):
    """A folder whose study_settings.json predates --optimizer / --train-args ran with AdamW and no extra
    flags: the same study with those defaults resumes; SGD there is a different study."""
    out = tmp_path / "s"
    out.mkdir()
    (out / SETTINGS_FILE).write_text(json.dumps({"steps": 3}))
    open_study(out, {"steps": 3, "optimizer": "adamw", "train_args": ""}, overwrite=False)
    assert json.loads((out / SETTINGS_FILE).read_text()) == {"steps": 3}  # untouched
    with pytest.raises(ValueError, match="settings differ: optimizer"):
        open_study(out, {"steps": 3, "optimizer": "sgd", "train_args": ""}, overwrite=False)


# ---------------------------------------------------------------- the paired analysis on hand-made runs
# Three seeds whose GRPO runs differ a lot from seed to seed (0, 10, 20) while each method's difference from GRPO on
# the same seed is known: the paired mean, its sign and its t interval are pinned, and an unpaired comparison (or the
# difference taken the other way round, GRPO - method) gives other numbers.
HAND_SEEDS = [0, 1, 2]
HAND_STEPS = 10  # FIRST_STEPS (5) steps for Fig. 3's "first" part, 5 for its "rest"
GRPO_REWARD = [0.0, 10.0, 20.0]
GRPO_ACCURACY = [0.2, 0.5, 0.8]
GRPO_UP_FIRST, GRPO_UP_REST = [0.5, 0.6, 0.7], [0.3, 0.4, 0.5]
# method - GRPO on each seed, per metric: AR gains, Lopti loses reward; AR's Fig. 3 share falls in the first steps
DIFFS = {
    "ar": {"reward": [1.0, 2.0, 3.0], "accuracy": [0.10, 0.11, 0.12], "up_first": [-0.01, -0.02, -0.03],
           "up_rest": [0.04, 0.05, 0.06]},
    "lopti": {"reward": [-1.0, -2.0, -3.0], "accuracy": [0.0, 0.0, 0.0], "up_first": [0.0, 0.0, 0.0],
              "up_rest": [0.0, 0.0, 0.0]},
}  # fmt: skip
T2 = t_quantile(0.975, 2)  # two-sided 95% Student's t, 2 degrees of freedom: 4.303 (T_975 above)


def hand_made_study(out) -> dict:
    """A finished study folder written by hand (warm-ups and runs' metrics.jsonl); returns its setting."""
    from openrlhf_lopti.audit.study import SETTING_DEFAULTS, WARMUP_DONE_FILE, run_dir, warmup_dir

    setting = {**SETTING_DEFAULTS, "people": [2], "steps": HAND_STEPS, "loss_backend": "torch",
               "optimizer": "adamw", "train_args": ""}  # fmt: skip
    for seed in HAND_SEEDS:
        warm = warmup_dir(out, seed)
        warm.mkdir(parents=True)
        (warm / WARMUP_DONE_FILE).write_text(json.dumps({"eval_accuracy": 0.3, "warmup_steps": 5, "parameters": 1000}))
        for method in ("grpo", *DIFFS):
            d = {k: v[seed] for k, v in DIFFS[method].items()} if method != "grpo" else dict.fromkeys(DIFFS["ar"], 0.0)
            rows = []
            for step in range(1, HAND_STEPS + 1):
                first = step <= FIRST_STEPS
                up = GRPO_UP_FIRST[seed] + d["up_first"] if first else GRPO_UP_REST[seed] + d["up_rest"]
                rows.append({"step": step, "reward": GRPO_REWARD[seed] + d["reward"], "low_token_fraction": 0.1,
                             "direction/pos_up_q4": up, "direction/pos_tokens_q4": 10.0})  # fmt: skip
            rows[-1]["eval_accuracy"] = GRPO_ACCURACY[seed] + d["accuracy"]
            path = run_dir(out, method, seed)
            path.mkdir(parents=True)
            (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return setting


def expected_ci(diffs: list) -> tuple:
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1))
    return mean, mean - T2 * sd / math.sqrt(n), mean + T2 * sd / math.sqrt(n)


def test_paired_vs_grpo_is_method_minus_grpo_seed_by_seed_with_its_t_interval(tmp_path):
    from openrlhf_lopti.audit.study import compare_markdown, format_markdown, summarize

    out = tmp_path / "study"
    result = summarize(out, hand_made_study(out), HAND_SEEDS, ["grpo", *DIFFS])
    paired = result["paired_vs_grpo"]
    assert set(paired) == {"ar", "lopti"}  # GRPO is the baseline, not paired with itself

    ar = paired["ar"]["reward_last"]
    assert (ar["mean"], ar["n"]) == (pytest.approx(2.0), 3)  # +1, +2, +3: the method's gain is positive
    assert ar["sd"] == pytest.approx(1.0)  # the per-seed differences' spread, not the runs' (10 between seeds)
    assert (ar["lo"], ar["hi"]) == (pytest.approx(2.0 - T2 / math.sqrt(3), abs=1e-5), pytest.approx(2.0 + T2 / math.sqrt(3), abs=1e-5))
    assert (ar["lo"], ar["hi"]) == pytest.approx((-0.48414, 4.48414), abs=1e-5)
    lopti = paired["lopti"]["reward_last"]
    assert (lopti["mean"], lopti["lo"], lopti["hi"]) == pytest.approx((-2.0, -4.48414, 0.48414), abs=1e-5)
    for key, part in (("eval_accuracy", "accuracy"), ("pos_up_q4_first", "up_first"), ("pos_up_q4_rest", "up_rest")):
        got = paired["ar"][key]
        assert (got["mean"], got["lo"], got["hi"]) == pytest.approx(expected_ci(DIFFS["ar"][part]), abs=1e-9), key
    # pooled over all steps: half the steps in each part, 10 A>0 tokens each
    whole = [(f + r) / 2 for f, r in zip(DIFFS["ar"]["up_first"], DIFFS["ar"]["up_rest"])]
    assert paired["ar"]["pos_up_q4"]["mean"] == pytest.approx(expected_ci(whole)[0])
    assert paired["ar"]["pos_up_q4_first"]["mean"] < 0 < paired["ar"]["pos_up_q4_rest"]["lo"]  # each part its own sign
    # per method: plain means over seeds (not differences), e.g. AR's accuracy 0.3, 0.61, 0.92
    assert result["per_method"]["ar"]["eval_accuracy"]["mean"] == pytest.approx(0.61)
    assert result["per_method"]["grpo"]["reward_last"]["mean"] == pytest.approx(10.0)

    # the report: signed cells, starred where the interval excludes 0
    text = format_markdown(result)
    ar_row = next(line for line in text.splitlines() if line.startswith("| ar | +"))
    # (the whole-run Fig. 3 share moved by +0.015 on every seed: a zero-width interval)
    assert ar_row == "| ar | +0.110 [+0.085, +0.135] * | +2.000 [-0.484, +4.484] | +0.015 [+0.015, +0.015] * |"
    assert "| lopti | +0.000 [+0.000, +0.000] | -2.000 [-4.484, +0.484] | +0.000 [+0.000, +0.000] |" in text
    assert "-0.020 [-0.045, +0.005]" in text and "+0.050 [+0.025, +0.075] *" in text  # Fig. 3, AR - GRPO
    compared = compare_markdown([("s", result)])
    assert "| s | AdamW lr 0.0005 | 3 | ar - grpo | +0.110 [+0.085, +0.135] * | +2.000 [-0.484, +4.484] |" in compared


def test_overwrite_removes_the_studys_runs_and_logs_but_not_the_users_files_beside_them(tmp_path):
    """study --help: --overwrite "removes only the study's own files"; runs/ and logs/ may hold the user's too."""
    out = tmp_path / "s"
    for name in ("runs/grpo/seed0/metrics.jsonl", "warmup/seed0/warmup.json", "logs/grpo-seed0.log",
                 "logs/warmup-seed0.log", "logs/ar_lopti-seed1.log", "study.json"):  # fmt: skip
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("old study")
    (out / SETTINGS_FILE).write_text(json.dumps({"steps": 3}))
    (out / "runs" / "mine.txt").write_text("mine")
    (out / "logs" / "mylog.txt").write_text("mine")
    (out / "runs" / "grpo" / "notes.md").write_text("mine")
    open_study(out, {"steps": 4}, overwrite=True)
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert left == ["logs/mylog.txt", "runs/grpo/notes.md", "runs/mine.txt", SETTINGS_FILE]


@pytest.mark.parametrize("text, message", [
    ("not json", "its study.json is not valid JSON"),
    ('{"train_config": {}}', "its study.json is not a study's result"),
    ("[1, 2]", "its study.json is not a study's result"),
])  # fmt: skip
def test_compare_of_a_broken_study_json_is_one_line(tmp_path, capsys, text, message):
    (tmp_path / "sc1").mkdir()
    (tmp_path / "sc1" / "study.json").write_text(text)
    assert cli_main(["study", "--compare", str(tmp_path / "sc1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"openrlhf-lopti study: error: --compare {tmp_path / 'sc1'}: "), err
    assert message in err[0]


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "1e-320"], "--temperature "),
    (["--lr", "1e39"], "--lr "),
    (["--hidden-size", "12"], "--hidden-size 12: must be a multiple of 8 (4 attention heads of an even size"),
])  # fmt: skip
def test_bad_setting_names_its_own_flag_not_train_args(tmp_path, capsys, flags, message):
    out = tmp_path / "s3"
    assert cli_main(["study", "--out", str(out), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"openrlhf-lopti study: error: {message}"), err
    assert "--train-args" not in err[0] and not out.exists()
