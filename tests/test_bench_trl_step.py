"""benchmarks/bench_trl_step.py's plumbing at a tiny shape (not a measurement): TRL's own GRPOTrainer and
LoptiGRPOTrainer (AR+Lopti, fused lm_head) each train the same fixed batch through ``rollout_func``; a batch is one
optimizer step, two with Lopti, whose phases split the batch's tokens; the outputs and the one-line refusals."""

import json

import pytest

pytest.importorskip("trl")

from benchmarks import bench_trl_step as bench  # noqa: E402
from openrlhf_lopti.errors import UserError  # noqa: E402

RESPONSES, RESPONSE_TOKENS = 4, 8
TINY = ["--shape", "tiny", "--variants", "trl,ar+lopti_fused", "--responses", str(RESPONSES), "--prompt-tokens", "4",
        "--response-tokens", str(RESPONSE_TOKENS), "--micro-batch-size", "2",
        "--warmup", "1", "--repeats", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    assert bench.main(TINY + ["--out", str(out)], log=lambda message: None) == 0
    return out, json.loads((out / "trl_step.json").read_text())


def test_each_variant_trains_the_batch_with_its_trainer(tiny_run):
    out, report = tiny_run
    assert sorted(p.name for p in out.iterdir()) == sorted(bench.OUTPUTS)  # the trainers' output_dir is not kept
    assert report["complete"] and set(report["results"]) == {"trl", "ar+lopti_fused"}
    records = {(r["variant"], r["batch"]): r for r in report["records"]}
    assert set(records) == {("trl", 0), ("trl", 1), ("ar+lopti_fused", 0), ("ar+lopti_fused", 1)}
    assert [r["counted"] for r in report["records"]] == [False, True, False, True]  # the warm-up batch is left out
    for (variant, _), r in records.items():
        assert r["optimizer_steps"] == (2 if variant == "ar+lopti_fused" else 1)
        assert 0 < r["cpu_s"] and 0 < r["wall_s"] and r["peak_growth_mib"] >= 0 and r["rss_before_mib"] > 0
    lopti = records[("ar+lopti_fused", 1)]
    # lopti_quantile=0.2 of the batch's tokens in the low phase, the rest in the high one: both phases train
    assert lopti["low_tokens"] > 0 and lopti["high_tokens"] > 0
    assert lopti["low_tokens"] + lopti["high_tokens"] == RESPONSES * RESPONSE_TOKENS
    assert report["results"]["trl"]["cpu_ratio"] == 1.0
    table = (out / "trl_step.md").read_text()
    assert "| TRL GRPOTrainer | TRL's loss (logits) | grpo | 1 |" in table
    assert "| LoptiGRPOTrainer | fused lm_head | ar+lopti | 2 |" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--responses", "6", "--micro-batch-size", "4"], "--responses must be >= 2 and a multiple of --micro-batch"),
        (["--low-share", "1"], "--low-share must be in (0, 1)"),
        (["--variants", "trl,nope"], "nope"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(tmp_path, argv, message, capsys):
    with pytest.raises((UserError, SystemExit)) as error:
        bench.main(argv + ["--out", str(tmp_path / "out")])
    text = str(error.value) if error.type is UserError else capsys.readouterr().err
    assert message in text and len(text.strip().splitlines()) <= 2
