"""benchmarks/bench_train_step.py: the local trainer end to end at a tiny size, the OpenRLHF launch's flags against
the real parser, its step records from TensorBoard scalars, the process-tree memory poller, the output rules.

The OpenRLHF ``--cpu`` launch itself is not run here: one launch takes 70-100 s on the 2-core CI machine (Ray, 3
processes, DeepSpeed); tests/test_openrlhf_cpu_pipeline.py runs that pipeline end to end.
"""

import json
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from benchmarks import bench_train_step as bench
from openrlhf_lopti.errors import UserError

TINY = ["--trainers", "local", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--sharpen", "6",
        "--prompts", "2", "--n-samples", "2", "--max-new-tokens", "6", "--mini-batch-size", "2",
        "--micro-batch-size", "1", "--warmup", "1", "--repeats", "2", "--methods", "grpo,lopti",
        "--loss-paths", "eager,fused_lm_head"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    assert bench.main(TINY + ["--out", str(out)]) == 0
    return out, json.loads((out / "train_step.json").read_text())


def test_local_run_writes_every_method_and_loss_path_with_counted_steps_only(tiny_run):
    out, report = tiny_run
    assert {p.name for p in out.iterdir()} == set(bench.OUTPUTS)
    assert (out / "train_step.png").stat().st_size > 0
    results = report["results"]["local"]
    assert set(results) == {"grpo", "lopti"} and all(set(r) == {"eager", "fused_lm_head"} for r in results.values())
    records = report["records"]
    assert len(records) == 2 * 2 * 2  # 2 methods x 2 loss paths x 2 counted rounds: the warm-up round is left out
    assert sorted({r["pair"] for r in records}) == [1, 2]
    for r in records:
        # a step = generation + the rest of experience making + the update; Lopti's phases lie inside the update
        assert r["step_s"] == pytest.approx(r["generation_s"] + r["experience_s"] + r["train_s"])
        assert min(r["generation_s"], r["experience_s"], r["train_s"]) > 0
        if r["method"] == "lopti":
            assert 0 <= r["train_low_s"] + r["train_high_s"] <= r["train_s"]
        low = r["low_token_fraction"]
        passes = (int(low > 0) + int(low < 1)) if r["method"] == "lopti" else 1
        assert r["optimizer_steps"] == passes * (4 // 2)  # 4 responses, 2 per optimizer step, per pass
        assert r["train_tokens_per_s"] == pytest.approx(r["response_tokens"] / r["train_s"])
        assert r["peak_memory_mib"] > 0
    stats = results["lopti"]["eager"]["train_s"]
    values = [r["train_s"] for r in records if r["method"] == "lopti" and r["loss_path"] == "eager"]
    assert stats == {"median": statistics.median(values), "min": min(values), "max": max(values), "n": 2}


def test_the_report_records_the_lm_heads_rows(tiny_run):
    out, report = tiny_run
    # the tiny model's lm_head has one row per tokenizer id; the report says how many it had
    assert report["settings"]["lm_head_rows"] == report["settings"]["tokenizer_ids"] > 0
    assert f"lm_head rows {report['settings']['lm_head_rows']}" in (out / "train_step.md").read_text()


def test_a_vocab_size_the_tiny_tokenizer_cannot_give_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"--vocab-size 151936: .* at most \d+ .*--model"):
        bench.build_bench_model(tmp_path / "model", 16, 1, 2, 151936, 3.5)
    assert not (tmp_path / "model").exists()


def test_method_order_rotates_from_round_to_round(tiny_run):
    _, report = tiny_run
    orders = {}
    for r in report["records"]:
        if r["loss_path"] == "eager":
            orders.setdefault(r["pair"], []).append(r["method"])
    assert orders[1] != orders[2] and sorted(orders[1]) == sorted(orders[2])


def test_lopti_factor_is_the_median_of_step_by_step_ratios(tiny_run):
    out, report = tiny_run
    for path in ("eager", "fused_lm_head"):
        by = {(r["method"], r["pair"]): r for r in report["records"] if r["loss_path"] == path}
        ratios = [by[("lopti", k)]["train_s"] / by[("grpo", k)]["train_s"] for k in (1, 2)]
        factor = report["lopti_factor"]["local"][path]["lopti"]["train"]
        assert factor["median"] == pytest.approx(statistics.median(ratios)) and factor["n"] == 2
    table = (out / "train_step.md").read_text()
    assert table.count("| local |") == 4 and f"paper: {bench.PAPER_LOPTI_FACTOR}x" in table


def test_out_folder_is_refused_then_replaced_with_overwrite(tiny_run):
    out, report = tiny_run
    with pytest.raises(UserError, match="--overwrite"):
        bench.main(TINY + ["--out", str(out)])
    (out / "mine.txt").write_text("kept")
    assert bench.main(TINY + ["--out", str(out), "--overwrite", "--repeats", "1", "--warmup", "0",
                              "--methods", "grpo", "--loss-paths", "eager"]) == 0  # fmt: skip
    assert len(json.loads((out / "train_step.json").read_text())["records"]) == 1
    assert (out / "mine.txt").read_text() == "kept"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--methods", "grpo,dapo"], "argument --methods: 'grpo,dapo': give a comma-separated subset of"),
        (["--mini-batch-size", "3"], "--mini-batch-size 3 must divide"),
        (["--micro-batch-size", "3", "--mini-batch-size", "4"], "--micro-batch-size 3 must divide"),
        (["--eta", "0"], "--eta must be in (0, 1]"),
        (["--model", "/nonexistent"], "--model /nonexistent: no such folder"),
        (["--hidden-size", "6", "--heads", "2"], "--hidden-size 6: with --heads 2 the head size is 3, which Llama's "
         "rotary embedding cannot take"),
    ],
)
def test_bad_flags_are_one_line_errors_naming_the_flag(flags, message):
    with pytest.raises(UserError) as error:
        bench.resolve_args(flags)
    assert message in str(error.value)


def test_openrlhf_launch_flags_parse_with_the_real_parser(tmp_path):
    from openrlhf_lopti.cli.train_ppo_ray import parse_args

    args = bench.resolve_args([])
    for method, (alpha, lopti) in bench.METHODS.items():
        for path in bench.LOSS_PATHS:
            argv = bench.openrlhf_argv(args, tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r.py", tmp_path / "s",
                                       method, path)  # fmt: skip
            parsed = parse_args(argv)  # upstream's parser, post-processing and checks, and ours
            assert parsed.cpu and parsed.algo.ar.alpha == alpha
            assert parsed.algo.lopti.eta == (0.5 if lopti else 0.0)
            assert parsed.actor.fused_loss == ("off" if path == "eager" else "auto")
            assert parsed.actor.fused_lm_head == (path == "fused_lm_head")
            assert (parsed.rollout.batch_size, parsed.rollout.n_samples_per_prompt, parsed.train.batch_size) == (8, 8, 32)
            assert (parsed.train.micro_batch_size, parsed.rollout.max_new_tokens) == (8, 128)
            assert parsed.data.max_samples == 3 * 8  # 1 warm-up + 2 counted steps of 8 prompts


def fake_scalars(steps: int, low: float, lopti_phases: bool) -> dict:
    scalars = {}
    for step in range(1, steps + 1):
        values = {"timing/generation": 1.0 * step, "timing/make_experience": 0.5, "timing/ppo_train": 2.0 * step,
                  "timing/broadcast": 0.1, "timing/step_total": 99.0, "lopti/low_token_frac": low,
                  "rollout/response_length_mean": 10.0, "rollout/num_samples": 32.0}  # fmt: skip
        if lopti_phases:
            values |= {"lopti/low/train_s": 0.5 * step, "lopti/high/train_s": 1.5 * step}
        for tag, value in values.items():
            scalars.setdefault(f"train/{tag}", {})[step] = value
    return scalars


def test_openrlhf_records_skip_the_warm_up_steps_and_read_upstreams_timings():
    args = SimpleNamespace(openrlhf_warmup=1, openrlhf_steps=2, prompts=8, n_samples=4, mini_batch_size=16)
    records = bench.openrlhf_records(args, fake_scalars(3, 0.25, True), "lopti", "eager", 0, 512.0)
    assert [r["pair"] for r in records] == [(0, 2), (0, 3)]
    first = records[0]
    # the step is the sum of upstream's four stages (its step_total also sums any other timing/* key)
    assert (first["generation_s"], first["train_s"], first["broadcast_s"]) == (2.0, 4.0, 0.1)
    assert first["step_s"] == pytest.approx(2.0 + 0.5 + 4.0 + 0.1)
    assert (first["train_low_s"], first["train_high_s"]) == (1.0, 3.0)
    assert first["optimizer_steps"] == 2 * 2  # two Lopti passes of 32 responses / 16 per optimizer step
    assert first["train_tokens_per_s"] == 320 / 4.0 and first["peak_memory_mib"] == 512.0
    grpo = bench.openrlhf_records(args, fake_scalars(3, 0.25, False), "grpo", "eager", 0, None)
    assert grpo[0]["optimizer_steps"] == 2 and "train_low_s" not in grpo[0]
    no_phase_times = bench.openrlhf_records(args, fake_scalars(3, 0.0, False), "lopti", "eager", 0, None)
    assert no_phase_times[0]["train_low_s"] is None and no_phase_times[0]["optimizer_steps"] == 2  # low phase empty
    with pytest.raises(RuntimeError, match="logged 2 steps, expected 3"):
        bench.openrlhf_records(args, fake_scalars(2, 0.25, False), "grpo", "eager", 0, None)


def test_process_tree_peaks_see_a_grandchilds_peak_rss(tmp_path):
    # The grandchild holds its 150 MiB until the sampler has seen them (or 120 s, a hang guard), not for a fixed
    # 1.5 s that a busy machine may not give the sampler's thread.
    release = tmp_path / "release"
    grandchild = (f"import os, time; x = bytearray(150 * 2**20)\nwhile not os.path.exists({str(release)!r}): "
                  "time.sleep(0.05)  # grandchild")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"])
    peaks = bench.ProcessTreePeaks(proc.pid, every=0.1)
    peaks.start()
    deadline = time.monotonic() + 120
    while (peaks.peak_mib("grandchild") or 0) < 150 and time.monotonic() < deadline:
        time.sleep(0.1)
    release.touch()
    proc.wait(timeout=120)
    peaks.done.set()
    peaks.join()
    assert peaks.peak_mib("grandchild") >= 150
    assert peaks.peak_mib("no such process") is None


def test_rotation_and_spread():
    assert [bench.rotated("abc", k) for k in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert bench.spread([3, 1, 2]) == {"median": 2, "min": 1, "max": 3, "n": 3}
    assert bench.spread([None]) == {"median": None, "min": None, "max": None, "n": 0}


def test_registered_as_openrlhf_lopti_bench_step(capsys):
    from openrlhf_lopti.__main__ import main

    assert main(["bench-step", "--loss-paths", "fused"]) == 2
    assert "argument --loss-paths: 'fused': give a comma-separated subset of" in capsys.readouterr().err


def test_table_shows_every_stage_the_step_sums():
    """The markdown table's stage columns add up to its step column: OpenRLHF's weight broadcast is a stage of the
    step (``step_s`` counts it), so the table shows it too (it was left out)."""
    args = SimpleNamespace(openrlhf_warmup=1, openrlhf_steps=2, prompts=8, n_samples=4, mini_batch_size=16)
    records = bench.openrlhf_records(args, fake_scalars(3, 0.25, True), "lopti", "eager", 0, None)
    records += bench.openrlhf_records(args, fake_scalars(3, 0.25, False), "grpo", "eager", 0, None)
    table = bench.markdown_table({"results": bench.summarize(records), "lopti_factor": bench.lopti_factors(records)})
    header, _, *rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table.splitlines()]
    assert len(rows) == 2 and all(len(row) == len(header) for row in rows)
    for row in rows:
        cell = dict(zip(header, row))
        stages = [float(cell[f"{stage} s"].split()[0]) for stage in ("generation", "experience", "train", "broadcast")]
        assert sum(stages) == pytest.approx(float(cell["step s"].split()[0]))


# ---------------------------------------------------------------------------------------------- bench_real_shape
# The sibling that measures Lopti's factor at a real decoder : lm_head ratio (issue 34), on its "tiny" shape here.
from benchmarks import bench_real_shape as real  # noqa: E402

REAL_TINY = ["--shape", "tiny", "--prompt-tokens", "4", "--response-tokens", "12", "--responses", "4",
             "--mini-batch-size", "4", "--micro-batch-size", "2", "--warmup", "1", "--repeats", "2",
             "--methods", "grpo,lopti", "--low-share", "0.3"]  # fmt: skip


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "out"
    assert real.main(REAL_TINY + ["--out", str(out)]) == 0
    return out, json.loads((out / "real_shape.json").read_text())


@pytest.mark.parametrize("shape, published", [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304),
                                              ("qwen2.5-3b", 3_085_938_688), ("qwen2.5-7b", 7_615_616_512)])  # fmt: skip
def test_real_shapes_build_the_published_parameter_counts(shape, published):
    """The shapes are Qwen2.5's: the transformers model built on the meta device has the parameter count the
    Hugging Face hub reports for the released checkpoints, and ``parameter_counts`` (the projection's arithmetic)
    counts the same."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(real.qwen2_config(shape))
    built = sum(p.numel() for p in model.parameters())  # a tied lm_head is the embedding: counted once
    counts = real.parameter_counts(shape)
    assert counts["total"] == built
    assert counts["body"] == sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.")
                                 or n == "model.norm.weight")  # fmt: skip
    assert built == published


def test_real_shape_run_records_every_update_with_its_stage_split(real_run):
    out, report = real_run
    assert {p.name for p in out.iterdir()} == set(real.OUTPUTS) and report["complete"]
    records = report["records"]
    assert len(records) == 2 * 2 * 2  # 2 loss paths x 2 methods x 2 counted rounds; the warm-up is left out
    assert sorted({r["round"] for r in records}) == [1, 2]
    tokens = 4 * 12
    for r in records:
        stages = [r[f"{k}_s"] for k in ("body_fwd", "head", "body_bwd", "optimizer")]
        assert all(s > 0 for s in stages) and sum(stages) <= r["train_s"]
        assert r["other_s"] == pytest.approx(r["train_s"] - sum(stages))
        assert r["compute_s"] == pytest.approx(sum(stages[:3]))
        assert r["optimizer_steps"] == (2 if r["method"] == "lopti" else 1)  # one mini-batch, one step per phase
        # the CPU split apportions the update's CPU seconds to the stages by their share of its wall time
        assert sum(real.stage_seconds(r, "cpu").values()) == pytest.approx(r["train_cpu_s"])
        assert real.stage_seconds(r, "wall")["head"] == r["head_s"]
        assert r["peak_growth_mib"] > 0 and r["rss_before_mib"] > 0
        if r["method"] == "lopti":
            assert r["low_tokens"] + r["high_tokens"] == tokens and 0 < r["low_tokens"] < tokens
            assert 0 < r["train_low_s"] + r["train_high_s"] <= r["train_s"]


def test_real_shape_factor_is_the_median_of_round_by_round_ratios(real_run):
    out, report = real_run
    for path in ("logits_kernel", "fused_lm_head"):
        by = {(r["method"], r["round"]): r for r in report["records"] if r["loss_path"] == path}
        for field, key in (("train_s", "train"), ("compute_s", "compute"), ("body_bwd_s", "body_bwd")):
            ratios = [by[("lopti", k)][field] / by[("grpo", k)][field] for k in (1, 2)]
            assert report["factors"][path]["lopti"][key]["median"] == pytest.approx(statistics.median(ratios))
    table = (out / "real_shape.md").read_text()
    # a row per method, two split rows (without / with Lopti) and a projection row for the one pair measured
    assert table.count("| logits_kernel |") == 2 + 2 + 1 and table.count("| fused_lm_head |") == 2 + 2 + 1
    assert set(real.splits(report)["fused_lm_head"]) == {"lopti/grpo"}  # no AR run: nothing to pool


def test_projection_scales_body_and_head_by_their_flops():
    """At the measured shape the projection is the measured ratio; a larger body : head ratio moves it toward the
    body's own factor (Lopti runs the body twice, the head about once)."""
    split = {"grpo": {"body_fwd": 1.0, "head": 2.0, "body_bwd": 2.0, "optimizer": 0.5, "other": 0.5},
             "lopti": {"body_fwd": 2.0, "head": 2.0, "body_bwd": 4.0, "optimizer": 1.0, "other": 1.0}}  # fmt: skip
    at = real.project(split, "qwen2.5-0.5b", 80)
    assert at["qwen2.5-0.5b"]["factor"] == pytest.approx(10.0 / 6.0)
    assert at["qwen2.5-0.5b"]["factor_compute"] == pytest.approx(8.0 / 5.0)
    factors = [at[t]["factor_compute"] for t in real.PROJECT_TO]
    assert factors == sorted(factors) and factors[-1] < 2.0  # 0.5B < 1.5B < 3B < 7B, all below the body's 2x
    f05, f7 = real.token_flops("qwen2.5-0.5b", 80), real.token_flops("qwen2.5-7b", 80)
    assert at["qwen2.5-7b"]["scale"]["head"] == pytest.approx(f7["head"] / f05["head"])
    assert at["qwen2.5-7b"]["scale"]["body_fwd"] == pytest.approx(f7["body"] / f05["body"])


def test_synthetic_experience_puts_the_asked_share_below_eta():
    exp = real.synthetic_experience(1000, 8, 4, 500, 0.2, 0.5, seed=0)
    p = exp.old_log_probs.exp()
    assert abs(float((p < 0.5).float().mean()) - 0.2) < 0.02 and float(p.max()) < 1
    assert exp.rollout.sequences.shape == (8, 504) and bool(exp.rollout.action_mask.all())
    assert torch_equal(exp.ref_log_probs, exp.old_log_probs)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--low-share", "0"], "--low-share must be in (0, 1)"),
        (["--responses", "8", "--mini-batch-size", "3"], "--mini-batch-size 3 must divide --responses 8"),
        (["--device", "tpu"], "--device must be cpu or cuda"),
        (["--shape", "llama"], "argument --shape: invalid choice"),
    ],
)
def test_real_shape_bad_flags_are_one_line_errors(flags, message):
    with pytest.raises(UserError) as error:
        real.resolve_args(flags)
    assert message in str(error.value)


def test_real_shape_on_cuda_without_a_gpu_is_refused(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(UserError, match="--device cuda: no CUDA device visible"):
        real.main(["--shape", "tiny", "--device", "cuda", "--out", str(tmp_path / "o")])


def test_real_shape_render_reprints_the_tables(real_run, capsys):
    out, report = real_run
    capsys.readouterr()
    assert real.main(["--render", str(out / "real_shape.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == (out / "real_shape.md").read_text().strip()
    assert "| fused_lm_head | lopti/grpo | tiny |" in printed and "| logits_kernel | lopti/grpo | tiny |" in printed
    with pytest.raises(UserError, match="--render /nonexistent.json: cannot read a report"):
        real.main(["--render", "/nonexistent.json"])


def test_bench_cpu_policy_loss_keeps_an_existing_json_and_refuses_a_folder(tmp_path):
    """`bench_cpu_policy_loss.py --json mine.json` wrote over the file silently; a folder was a traceback after the
    run. Both are refused before the run (as bench_memory's --json)."""
    from benchmarks.bench_cpu_policy_loss import main as cpu_bench

    mine = tmp_path / "mine.json"
    mine.write_text("mine")
    small = ["--n", "1", "--v", "2", "--repeats", "1"]
    with pytest.raises(UserError, match=r"^--json .*mine.json exists: pass --overwrite to replace it, or choose "):
        cpu_bench([*small, "--json", str(mine)])
    assert mine.read_text() == "mine"
    with pytest.raises(UserError, match=r"^--json .*: is a folder; --json takes a file name$"):
        cpu_bench([*small, "--json", str(tmp_path)])
