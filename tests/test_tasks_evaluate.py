"""Evaluation: K&K accuracy per number of people, math per benchmark, the CLI, local generation."""

import json
import subprocess
import sys

import pytest

from openrlhf_lopti.tasks import evaluate, kk

P3 = [kk.generate(3, s) for s in range(2)]
P5 = kk.generate(5, 0)


def right(p):
    return f"<think>ok</think><answer>{p['solution_text_format']}</answer>"


def wrong(p):
    flipped = p["solution_text_format"].replace("knight", "\0").replace("knave", "knight").replace("\0", "knave")
    return f"<think>ok</think><answer>{flipped}</answer>"


def test_kk_accuracy_per_number_of_people_avg_at_k():
    records = [
        {"label": P3[0]["solution_text_format"], "num_people": 3, "responses": [right(P3[0]), wrong(P3[0])]},
        {"label": P3[1]["solution_text_format"], "num_people": 3, "responses": [right(P3[1]), "garbage"]},
        # num_people read from the label when absent; one line per sample, merged by id
        {"id": "q5", "label": P5["solution_text_format"], "response": wrong(P5)},
        {"id": "q5", "label": P5["solution_text_format"], "response": wrong(P5)},
    ]
    res = evaluate.evaluate(records, "kk")
    g3, g5 = res["groups"]["3"], res["groups"]["5"]
    assert list(res["groups"]) == ["3", "5"]
    assert (g3["prompts"], g3["samples"], g3["metric"]) == (2, 4, "avg@2")
    assert g3["accuracy"] == 0.5 and g3["pass@2"] == 1.0
    assert g3["format_rate"] == 0.75 and g3["mean_reward"] == (3.0 - 0.5 + 3.0 - 3.0) / 4
    assert (g5["prompts"], g5["accuracy"], g5["pass@2"], g5["mean_reward"]) == (1, 0.0, 0.0, -0.5)
    assert res["average"] == 0.25  # mean over sizes, as in the paper's table
    table = evaluate.format_table(res)
    assert table.splitlines()[0].split()[:4] == ["num_people", "prompts", "metric", "accuracy"]
    assert "average" in table.splitlines()[-1] and "0.2500" in table


def test_math_greedy_and_avg_at_k_per_benchmark():
    records = [
        {"benchmark": "math500", "label": "2", "response": "\\boxed{2}"},
        {"benchmark": "math500", "label": "\\frac12", "response": "0.5"},  # no box
        {"benchmark": "aime24", "label": "7", "responses": ["\\boxed{7}", "\\boxed{8}", "\\boxed{7}", "?"]},
        {"datasource": "amc", "prompt": "p2", "label": "1", "responses": ["\\boxed{1}"] * 4},
    ]
    res = evaluate.evaluate(records, "math")
    assert list(res["groups"]) == ["aime24", "amc", "math500"]
    m500, aime = res["groups"]["math500"], res["groups"]["aime24"]
    assert (m500["metric"], m500["accuracy"], m500["boxed_rate"]) == ("greedy", 0.5, 0.5)
    assert (aime["metric"], aime["accuracy"], aime["pass@4"], aime["boxed_rate"]) == ("avg@4", 0.5, 1.0, 0.75)
    assert res["groups"]["amc"]["accuracy"] == 1.0
    assert res["average"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)


def test_evaluate_rejects_bad_input():
    with pytest.raises(ValueError):
        evaluate.evaluate([{"label": "x"}], "kk")
    with pytest.raises(ValueError):
        evaluate.evaluate([{"response": "x"}], "math")
    with pytest.raises(ValueError):
        evaluate.evaluate([], "chess")


def test_main_on_a_generations_file(tmp_path, capsys):
    gens = tmp_path / "gens.jsonl"
    rows = [{"label": p["solution_text_format"], "num_people": 3, "response": right(p)} for p in P3]
    rows.append({"label": P5["solution_text_format"], "num_people": 5, "response": wrong(P5)})
    gens.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval"
    assert evaluate.main(["--task", "kk", "--generations", str(gens), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["groups"]["3"]["accuracy"] == 1.0
    assert results["source"] == {"generations": str(gens), "limit_per_group": None}
    assert "1.0000" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "gens.jsonl"]  # nothing beside the input
    # --limit keeps the first N prompts of EACH group: the 5-person puzzle after the 3-person ones stays
    evaluate.main(["--task", "kk", "--generations", str(gens), "--out", str(out), "--limit", "1", "--overwrite"])
    groups = json.loads((out / "results.json").read_text())["groups"]
    assert (groups["3"]["prompts"], groups["5"]["prompts"]) == (1, 1)


@pytest.mark.parametrize("module", ["openrlhf_lopti.tasks.evaluate", "openrlhf_lopti.tasks.data"])
def test_runnable_as_module(module):
    # timeout: a hang guard (seconds when idle), wide enough for a machine busy with other work
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "usage:" in proc.stdout


def _tiny_model(path):
    """A 1-layer Llama with a character tokenizer, built offline."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)
    cfg = LlamaConfig(
        vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=1, bos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def test_main_with_a_local_model(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    _tiny_model(tmp_path / "model")
    prompts = tmp_path / "test.jsonl"
    recs = [{"prompt": kk.make_prompt(p), "label": p["solution_text_format"], "num_people": 3} for p in P3]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "eval"
    argv = ["--task", "kk", "--model", str(tmp_path / "model"), "--data", str(prompts), "--n-samples", "2"]
    argv += ["--max-new-tokens", "4", "--out", str(out)]
    assert evaluate.main(argv) == 0
    saved = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert [len(r["responses"]) for r in saved] == [2, 2]
    assert all(isinstance(s, str) and len(s) <= 4 for r in saved for s in r["responses"])
    res = json.loads((out / "results.json").read_text())
    assert res["groups"]["3"]["samples"] == 4 and res["groups"]["3"]["accuracy"] == 0.0  # a random model
    assert res["source"]["model"] == str(tmp_path / "model") and res["source"]["data"] == str(prompts)
    # the generations file it wrote is a valid --generations input, with the same result
    again = tmp_path / "again"
    assert evaluate.main(["--task", "kk", "--generations", str(out / "generations.jsonl"), "--out", str(again)]) == 0
    assert json.loads((again / "results.json").read_text())["groups"] == res["groups"]


def _cli_fails(capsys, argv):
    """``openrlhf-lopti ARGV``: exit code 2 and one line on stderr, returned."""
    from openrlhf_lopti.__main__ import main as cli_main

    assert cli_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_greedy_decoding_with_several_samples_is_refused_before_loading_anything(tmp_path, capsys, monkeypatch):
    """--temperature 0 is greedy: one answer per prompt, so --n-samples 2 was a transformers traceback after the
    model loaded (num_return_sequences > 1 without sampling). Now one line, before the model folder is even read."""

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was looked at before the flags were checked")

    generate_local = evaluate.generate_local
    monkeypatch.setattr(evaluate, "check_model_dir", no_loading)
    monkeypatch.setattr(evaluate, "generate_local", no_loading)
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"prompt": "q", "label": P3[0]["solution_text_format"]}) + "\n")
    out = tmp_path / "ev"
    argv = ["eval", "--task", "kk", "--model", str(tmp_path / "model"), "--data", str(data), "--n-samples", "2",
            "--temperature", "0", "--out", str(out)]  # fmt: skip
    assert _cli_fails(capsys, argv) == (
        "openrlhf-lopti eval: error: --temperature 0 is greedy decoding, one answer per prompt: with --n-samples 2 "
        "pass a --temperature > 0 (the default for --n-samples > 1 is 1.0), or --n-samples 1"
    )
    assert _cli_fails(capsys, [*argv[:-4], "--temperature", "inf", "--out", str(out)]) == (
        "openrlhf-lopti eval: error: --temperature must be a finite number >= 0, got inf"
    )
    assert not out.exists()
    # the library function says the same instead of handing transformers the contradiction
    with pytest.raises(ValueError, match="n_samples must be 1, got 2"):
        generate_local(str(tmp_path / "model"), ["q"], n_samples=2, temperature=0.0)


@pytest.mark.parametrize("label", [5, None, ["(1) Alice is a knight"]])
@pytest.mark.parametrize("extra", [[], ["--limit", "1"]])
@pytest.mark.parametrize("num_people", [None, 1])
def test_a_kk_label_that_is_not_a_string_names_the_file_and_line(tmp_path, capsys, label, extra, num_people):
    """A K&K label must be the solution_text_format string; an int or null one was `TypeError: label must be str`
    (a traceback) from kk.parse_solution_text, with or without num_people and --limit."""
    gens = tmp_path / "gens.jsonl"
    rows = [{"label": P3[0]["solution_text_format"], "response": right(P3[0])},
            {"label": label, "response": "<think>x</think><answer>Alice is a knight</answer>"}]  # fmt: skip
    if num_people is not None:
        rows[1]["num_people"] = num_people
    gens.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["eval", "--task", "kk", "--generations", str(gens), "--out", str(tmp_path / "ev"), *extra]
    assert _cli_fails(capsys, argv) == (
        f"openrlhf-lopti eval: error: {gens} line 2: 'label' must be a string (the K&K "
        f"solution_text_format, e.g. \"(1) Alice is a knight\"), got {type(label).__name__} {str(label)[:60]!r}"
    )
    assert not (tmp_path / "ev").exists()


def test_a_math_label_must_be_a_string_or_a_number(tmp_path, capsys, monkeypatch):
    """A math answer may be a JSON number (5 reads as "5"); null or a list was scored against "None" / "[...]"."""
    gens = tmp_path / "gens.jsonl"
    gens.write_text(json.dumps({"label": 5, "response": "\\boxed{5}"}) + "\n")
    assert evaluate.main(["--task", "math", "--generations", str(gens), "--out", str(tmp_path / "ok")]) == 0
    assert json.loads((tmp_path / "ok" / "results.json").read_text())["average"] == 1.0
    capsys.readouterr()
    gens.write_text(json.dumps({"label": 5, "response": "\\boxed{5}"}) + "\n"
                    + json.dumps({"label": None, "response": "\\boxed{None}"}) + "\n")  # fmt: skip
    assert _cli_fails(capsys, ["eval", "--task", "math", "--generations", str(gens), "--out", str(tmp_path / "ev")]) == (
        f"openrlhf-lopti eval: error: {gens} line 2: 'label' must be a string or a number (the math "
        "answer), got NoneType 'None'"
    )
    # with --model the --data labels are checked before generating
    def no_generating(*args, **kwargs):
        raise AssertionError("generated before the labels were checked")

    monkeypatch.setattr(evaluate, "check_model_dir", lambda path: None)
    monkeypatch.setattr(evaluate, "generate_local", no_generating)
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"prompt": "q", "answer": [1]}) + "\n")
    argv = ["eval", "--task", "math", "--model", str(tmp_path / "m"), "--data", str(data), "--label-key", "answer",
            "--out", str(tmp_path / "ev")]  # fmt: skip
    assert _cli_fails(capsys, argv) == (
        f"openrlhf-lopti eval: error: {data} line 1: 'answer' must be a string or a number (the math answer), "
        "got list '[1]'"
    )
    assert not (tmp_path / "ev").exists()


def test_a_prompt_without_responses_is_refused_not_dropped(tmp_path, capsys):
    """`"responses": []` was skipped: 1 of 3 prompts scored, and the table said accuracy 1.0 over "1 prompt"."""
    gens = tmp_path / "gens.jsonl"
    rows = [{"label": "5", "responses": ["\\boxed{5}"]}, {"label": "6", "responses": []}]
    gens.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _cli_fails(capsys, ["eval", "--task", "math", "--generations", str(gens), "--out", str(tmp_path / "ev")]) == (
        f"openrlhf-lopti eval: error: {gens} line 2: 'responses' is empty; each prompt needs at least one response "
        "to score"
    )


def test_an_empty_math_label_and_negative_threads_are_refused(tmp_path, capsys):
    gens = tmp_path / "gens.jsonl"
    gens.write_text(json.dumps({"label": " ", "response": "\\boxed{}"}) + "\n")
    argv = ["eval", "--task", "math", "--generations", str(gens), "--out", str(tmp_path / "ev")]
    assert _cli_fails(capsys, argv) == (
        f"openrlhf-lopti eval: error: {gens} line 1: 'label' is empty; a math label is the answer"
    )
    assert _cli_fails(capsys, [*argv, "--threads", "-1"]) == (
        "openrlhf-lopti eval: error: --threads must be >= 0 (0: torch's choice), got -1"
    )  # was torch's RuntimeError, a traceback


def test_a_row_holding_a_unicode_line_separator_reads_back(tmp_path):
    """str.splitlines cut a JSON line at U+2028 / U+2029 / U+0085, which write_jsonl writes unescaped: a model's
    generations.jsonl could not be read back by `eval --generations`."""
    from openrlhf_lopti.tasks import load_rows, write_jsonl

    rows = [{"label": "5", "response": f"a{sep}b \\boxed{{5}}"} for sep in ("\u2028", "\u2029", "\u0085")]
    write_jsonl(tmp_path / "g.jsonl", rows)
    assert load_rows(tmp_path / "g.jsonl")[0] == rows
    assert evaluate.main(["--task", "math", "--generations", str(tmp_path / "g.jsonl"), "--out", str(tmp_path / "e")]) == 0
