"""Every command's user errors: one exact line on stderr, exit code 2, and the user's files untouched.

The cases are issue 16's list (a new user's common mistakes). In-process through
``openrlhf_lopti.__main__.main``, the entry point of ``openrlhf-lopti``; two subprocess runs check the
real stderr and ``--debug``.
"""

import json
import subprocess
import sys

import pytest

from openrlhf_lopti.__main__ import main as cli_main
from openrlhf_lopti.demo.run import DEMO_OUTPUTS
from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
from openrlhf_lopti.local.model import save_model
from openrlhf_lopti.runs import prepare_out_dir
from openrlhf_lopti.tasks import kk

MODEL_HINT = "pass a folder written by save_pretrained (model and tokenizer), e.g. runs/demo-<timestamp>/warmup_model"


def snapshot(root):
    """{relative path: bytes} of every file below ``root`` (folders as None)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def fails(capsys, argv):
    """Run the CLI; assert exit code 2 and exactly one line on stderr; return that line."""
    assert cli_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = build_word_tokenizer()
    path = tmp_path_factory.mktemp("models") / "tiny"
    save_model(build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2), tok, path, prompt_style="compact")
    return path


# ---------------------------------------------------------------------------------------------- data, eval


def test_data_math_missing_malformed_and_keyless_inputs(tmp_path, capsys):
    out = tmp_path / "m.jsonl"
    base = ["data", "math", "--benchmark", "t", "--out", str(out), "--input"]
    assert fails(capsys, base + [str(tmp_path / "nope.jsonl")]) == (
        f"openrlhf-lopti data: error: --input {tmp_path / 'nope.jsonl'}: no such file or folder"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2", "answer": 4,}\n')
    assert fails(capsys, base + [str(bad)]) == (
        f"openrlhf-lopti data: error: --input {bad} line 3: not valid JSON (Expecting property name enclosed in "
        "double quotes, column 32); each line must be one JSON object"
    )
    keyless = write_jsonl(tmp_path / "q.jsonl", [{"problem": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4"}])
    assert fails(capsys, base + [str(keyless)]) == (
        f"openrlhf-lopti data: error: {keyless} line 2: no 'problem' key (the row has answer, question); pass "
        "--problem-key with the name of the problem field"
    )
    noanswer = write_jsonl(tmp_path / "a.jsonl", [{"problem": "1+1", "final": "2"}])
    assert fails(capsys, base + [str(noanswer)]) == (
        f"openrlhf-lopti data: error: {noanswer} line 1: no 'answer' key and no 'solution' with a \\boxed{{}} "
        "answer (the row has final, problem); pass --answer-key with the name of the answer field"
    )
    assert not out.exists()
    assert cli_main(base + [str(noanswer), "--answer-key", "final"]) == 0  # the hint works
    assert json.loads(out.read_text())["label"] == "2"


def test_data_math_never_writes_over_its_input_or_an_existing_file(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"problem": "1+1", "answer": "2"}])
    before = snapshot(tmp_path)
    argv = ["data", "math", "--input", str(src), "--benchmark", "t", "--out", str(src)]
    assert fails(capsys, argv) == (
        f"openrlhf-lopti data: error: --out {src} is also --input: it would overwrite that input; pick another --out"
    )
    assert fails(capsys, argv + ["--overwrite"]).endswith("it would overwrite that input; pick another --out")
    out = tmp_path / "out.jsonl"
    out.write_text("keep me\n")
    before = snapshot(tmp_path)
    argv[-1] = str(out)
    assert fails(capsys, argv) == (
        f"openrlhf-lopti data: error: --out {out} exists: pass --overwrite to replace it, or choose another --out"
    )
    assert snapshot(tmp_path) == before
    assert cli_main(argv + ["--overwrite"]) == 0 and "keep me" not in out.read_text()


def test_data_kk_refuses_an_earlier_run_and_overwrite_removes_only_its_own_files(tmp_path, capsys):
    out = tmp_path / "kk"
    small = ["--train-per-n", "3", "--test-per-n", "2"]
    assert cli_main(["data", "kk", "--out", str(out), "--people", "3", "4", *small]) == 0
    (out / "notes.md").write_text("mine")
    (out / "train" / "people3_num1000.jsonl").write_text("a public file kept here\n")
    before = snapshot(out)
    assert fails(capsys, ["data", "kk", "--out", str(out), "--people", "3", *small]) == (
        f"openrlhf-lopti data: error: --out {out} holds outputs of an earlier run (train.jsonl, test.jsonl, "
        "train/people3.jsonl, train/people4.jsonl, ...): pass --overwrite to replace them (only these are "
        "removed), or choose another --out"
    )
    assert snapshot(out) == before
    assert cli_main(["data", "kk", "--out", str(out), "--people", "3", *small, "--overwrite"]) == 0
    # no stale people4.jsonl next to a train.jsonl without 4-person puzzles; the user's files stay
    assert sorted(snapshot(out)) == ["notes.md", "test", "test.jsonl", "test/people3.jsonl", "train",
                                     "train.jsonl", "train/people3.jsonl", "train/people3_num1000.jsonl"]  # fmt: skip
    assert {json.loads(line)["num_people"] for line in (out / "train.jsonl").read_text().splitlines()} == {3}


def test_data_kk_source_takes_everything_and_names_a_missing_size(tmp_path, capsys):
    src = tmp_path / "public"
    src.mkdir()
    rows = [dict(kk.generate(3, s), index=s) for s in range(5)]
    write_jsonl(src / "people3_num5.jsonl", [{k: r[k] for k in ("quiz", "names", "solution", "statements")}
                                             for r in rows])  # fmt: skip
    out = tmp_path / "kk"
    assert fails(capsys, ["data", "kk", "--out", str(out), "--source", str(src), "--people", "3", "4"]) == (
        "openrlhf-lopti data: error: --people 4: the --source files have no 4-person puzzles (they have sizes 3)"
    )
    assert not out.exists()
    # no --people / counts: every size and puzzle of the source (no silent 900 / 100 cap, no empty files)
    assert cli_main(["data", "kk", "--out", str(out), "--source", str(src), "--test-per-n", "1"]) == 0
    assert len((out / "train.jsonl").read_text().splitlines()) == 4
    assert sorted(p.name for p in (out / "train").iterdir()) == ["people3.jsonl"]
    assert fails(capsys, ["data", "kk", "--out", str(tmp_path / "x"), "--source", str(src), "--people", "3",
                          "--out", str(src)]) == (  # fmt: skip
        f"openrlhf-lopti data: error: --out {src} lies inside --source {src}: choose an --out outside that folder"
    )


def test_eval_bad_generations_and_data_name_file_line_and_key(tmp_path, capsys, model_dir):
    out = str(tmp_path / "ev")
    gens = tmp_path / "gens.jsonl"
    gens.write_text('{"label": "(1) Alice is a knight", "response": "x"}\n{"label": 1, "respons": "y"}\n')
    assert fails(capsys, ["eval", "--task", "kk", "--generations", str(gens), "--out", out]) == (
        f"openrlhf-lopti eval: error: {gens} line 2: no 'responses' (a list of strings) or 'response' (a string) "
        "key; --generations takes a file like the generations.jsonl that `eval --model` writes"
    )
    gens.write_text('{"label": "(1) Alice is a knight", "response": "x"}\n{"label": 1, "response": "y"\n')
    assert fails(capsys, ["eval", "--task", "kk", "--generations", str(gens), "--out", out]) == (
        f"openrlhf-lopti eval: error: --generations {gens} line 2: not valid JSON (Expecting ',' delimiter, "
        "column 29); each line must be one JSON object"
    )
    assert fails(capsys, ["eval", "--task", "kk", "--generations", str(tmp_path / "none.jsonl"), "--out", out]) == (
        f"openrlhf-lopti eval: error: --generations {tmp_path / 'none.jsonl'}: no such file or folder"
    )
    data = write_jsonl(tmp_path / "test.jsonl", [{"question": "q", "label": "(1) Alice is a knight"}])
    argv = ["eval", "--task", "kk", "--model", str(model_dir), "--data", str(data), "--out", out]
    assert fails(capsys, argv) == (
        f"openrlhf-lopti eval: error: {data} line 1: no 'prompt' key (the row has label, question); pass "
        "--input-key with the right field name"
    )
    assert not (tmp_path / "ev").exists()


def test_eval_writes_under_out_never_over_or_beside_its_inputs(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    p = kk.generate(3, 0)
    gens = write_jsonl(data / "gens.jsonl", [{"label": p["solution_text_format"], "response": "x"}])
    before = snapshot(data)
    assert fails(capsys, ["eval", "--task", "kk", "--generations", str(gens), "--out", str(gens)]) == (
        f"openrlhf-lopti eval: error: --out {gens}: is a file; --out takes a folder"
    )
    results = write_jsonl(data / "results.json", [{"label": p["solution_text_format"], "response": "x"}])
    assert fails(capsys, ["eval", "--task", "kk", "--generations", str(results), "--out", str(data),
                          "--overwrite"]) == (  # fmt: skip
        f"openrlhf-lopti eval: error: --out {data} would write over --generations {results} (the output "
        "'results.json' is that input): choose another --out"
    )
    results.unlink()
    monkeypatch.chdir(tmp_path)
    assert cli_main(["eval", "--task", "kk", "--generations", str(gens)]) == 0  # default --out: runs/eval-<time>
    assert snapshot(data) == before
    (written,) = (tmp_path / "runs").glob("eval-*/results.json")
    assert json.loads(written.read_text())["source"]["generations"] == str(gens)


@pytest.mark.parametrize("command", ["train", "eval", "audit"])
def test_model_folder_without_a_model(tmp_path, capsys, command):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    argv = {
        "train": ["train", "--model", str(empty), "--out", str(tmp_path / "run")],
        "eval": ["eval", "--task", "kk", "--model", str(empty), "--data", "d.jsonl", "--out", str(tmp_path / "e")],
        "audit": ["audit", "--model", str(empty), "--out", str(tmp_path / "a")],
    }[command]
    assert fails(capsys, argv) == (
        f"openrlhf-lopti {command}: error: --model {empty}: not a Hugging Face checkpoint, it has no config.json, "
        f"weights (*.safetensors or *.bin), tokenizer (tokenizer.json or tokenizer_config.json); {MODEL_HINT}"
    )
    assert not (tmp_path / "run").exists() and not (tmp_path / "e").exists()


# ----------------------------------------------------------------------------------------- train, demo, audit


def test_train_errors_name_flags_and_eta_zero_means_lopti_off(tmp_path, capsys, model_dir):
    base = ["train", "--model", str(model_dir), "--out", str(tmp_path / "r")]
    assert fails(capsys, base + ["--lopti-order", "sideways"]) == (
        "openrlhf-lopti train: error: --lopti-order must be one of ('low_first', 'high_first'), got 'sideways'"
    )
    assert fails(capsys, base + ["--prompts-per-step", "0"]) == (
        "openrlhf-lopti train: error: --prompts-per-step must be an integer >= 1, got 0"
    )
    assert fails(capsys, base + ["--method", "lopti", "--eta", "0"]) == (
        "openrlhf-lopti train: error: --eta 0 means Lopti off (as --algo.lopti.eta 0 in the OpenRLHF CLI), but "
        "lopti is on (--lopti or a lopti --method): give eta in (0, 1], or turn Lopti off"
    )
    assert fails(capsys, base + ["--steps"]) == (
        "openrlhf-lopti train: error: argument --steps: expected one argument (see `openrlhf-lopti train --help`)"
    )
    assert not (tmp_path / "r").exists()
    tiny = ["--steps", "1", "--prompts-per-step", "1", "--n-samples", "2", "--max-new-tokens", "2", "--no-progress"]
    assert cli_main(base + ["--eta", "0", *tiny]) == 0  # accepted, as --algo.lopti.eta 0: Lopti off
    assert json.loads((tmp_path / "r" / "config.json").read_text())["lopti"] is False


def test_train_that_fails_at_start_up_leaves_its_folder_reusable(tmp_path, capsys, model_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "r"
    argv = ["train", "--model", str(model_dir), "--out", str(out), "--steps", "1", "--prompts-per-step", "1",
            "--n-samples", "2", "--max-new-tokens", "2", "--no-progress", "--device", "cpu"]  # fmt: skip
    assert fails(capsys, argv + ["--loss-backend", "triton"]) == (
        "openrlhf-lopti train: error: --loss-backend triton needs a CUDA device, or TRITON_INTERPRET=1 in the "
        "environment to run on cpu (slow); use --loss-backend auto"
    )
    assert not out.exists() or not any(out.iterdir())
    assert cli_main(argv + ["--loss-backend", "torch"]) == 0  # the retry is not refused


def test_train_overwrite_removes_only_the_runs_files(tmp_path, capsys, model_dir):
    out = tmp_path / "r"
    argv = ["train", "--model", str(model_dir), "--out", str(out), "--steps", "1", "--prompts-per-step", "1",
            "--n-samples", "2", "--max-new-tokens", "2", "--no-progress"]  # fmt: skip
    assert cli_main(argv) == 0
    (out / "notes.md").write_text("mine")
    assert fails(capsys, argv) == (
        f"openrlhf-lopti train: error: --out {out} holds outputs of an earlier run (config.json, metrics.jsonl, "
        "checkpoint.pt, plots.png, ...): pass --resume to continue that run, --overwrite to replace them (only "
        "these are removed), or choose another --out"
    )
    assert fails(capsys, argv + ["--resume", "--alpha", "0.5"]) == (
        f"openrlhf-lopti train: error: --resume: --alpha (run: 0.0, now: 0.5) differ from the run in {out}: drop "
        "those flags to continue it, or start a new run in another --out"
    )
    nested = ["train", "--model", str(out / "final_model"), "--out", str(out), "--overwrite"]
    assert fails(capsys, nested) == (
        f"openrlhf-lopti train: error: --out {out} would write over --model {out / 'final_model'} (the output "
        "'final_model' is that input): choose another --out"
    )
    assert cli_main(argv + ["--overwrite"]) == 0
    assert (out / "notes.md").read_text() == "mine"


def test_demo_overwrite_removes_only_the_demos_files(tmp_path, capsys):
    out = tmp_path / "demo"
    for name in ("warmup_model/config.json", "runs/grpo/metrics.jsonl", "summary.md", "notes.md", "runs/mine.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    assert fails(capsys, ["demo", "--out", str(out), "--methods", "grpo"]) == (
        f"openrlhf-lopti demo: error: --out {out} holds outputs of an earlier run (warmup_model, runs/grpo, "
        "summary.md): pass --resume to continue that run, --overwrite to replace them (only these are removed), "
        "or choose another --out"
    )
    prepare_out_dir(out, DEMO_OUTPUTS, overwrite=True)  # what `demo --overwrite` does first
    assert sorted(snapshot(out)) == ["notes.md", "runs", "runs/mine.txt"]


def test_unknown_command_and_bad_demo_flags(capsys):
    assert fails(capsys, ["chess"]).startswith("openrlhf-lopti: error: unknown command 'chess': use one of demo, ")
    assert fails(capsys, ["demo", "--methods", "grpo,ppo"]) == (
        "openrlhf-lopti demo: error: --methods must be a comma-separated subset of grpo,ar,lopti,ar+lopti, got "
        "'grpo,ppo'"
    )


@pytest.mark.parametrize("command", ["demo", "audit", "study"])
def test_a_method_named_twice_is_refused_by_every_command_that_compares_methods(command, tmp_path, capsys):
    """audit --methods grpo,grpo measured grpo twice and listed it twice (demo and study refused it, each in its own
    words); one check now (``local.config.method_list``), before any model is built."""
    out = tmp_path / command
    assert fails(capsys, [command, "--out", str(out), "--methods", "grpo,ar,grpo"]) == (
        f"openrlhf-lopti {command}: error: --methods names grpo twice: give each method once, got 'grpo,ar,grpo'"
    )
    assert not out.exists()


def test_ctrl_c_is_one_line_and_exit_130_and_debug_keeps_the_traceback(capsys):
    """Ctrl-C printed an 82-line KeyboardInterrupt traceback (a user's own stop, not a bug): now one line, the shell's
    exit code for SIGINT; --debug lets the exception through."""
    from openrlhf_lopti.errors import run_command

    def interrupted(argv):
        raise KeyboardInterrupt

    assert run_command("openrlhf-lopti train", interrupted, ["--out", "r"]) == 130
    assert capsys.readouterr().err == "openrlhf-lopti train: interrupted\n"
    with pytest.raises(KeyboardInterrupt):
        run_command("openrlhf-lopti train", interrupted, ["--debug"])


# ------------------------------------------------------------------------------------- the real process


def test_one_line_on_stderr_and_the_traceback_only_with_debug(tmp_path):
    argv = [sys.executable, "-m", "openrlhf_lopti", "data", "math", "--input", str(tmp_path / "nope.jsonl"),
            "--benchmark", "t", "--out", str(tmp_path / "o.jsonl")]  # fmt: skip
    # timeout: a hang guard (seconds when idle), wide enough for a machine busy with other work
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr == f"openrlhf-lopti data: error: --input {tmp_path / 'nope.jsonl'}: no such file or folder\n"
    debug = subprocess.run(argv + ["--debug"], capture_output=True, text=True, timeout=600)
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("openrlhf_lopti.errors.UserError: --input ")
    # the module's own entry point reports the same way
    module = [sys.executable, "-m", "openrlhf_lopti.tasks.data", *argv[4:]]
    assert subprocess.run(module, capture_output=True, text=True, timeout=600).stderr == plain.stderr


def test_audit_refuses_its_own_earlier_outputs_without_suggesting_resume(tmp_path, capsys, model_dir):
    out = tmp_path / "audit"
    out.mkdir()
    (out / "audit.json").write_text("{}")
    (out / "notes.md").write_text("mine")
    before = snapshot(out)
    assert fails(capsys, ["audit", "--model", str(model_dir), "--out", str(out)]) == (
        f"openrlhf-lopti audit: error: --out {out} holds outputs of an earlier run (audit.json): pass --overwrite "
        "to replace them (only these are removed), or choose another --out"
    )
    assert snapshot(out) == before


# ------------------------------------------------------------------------ output folders that cannot be made


def out_commands(tmp_path, model_dir):
    """``(command, argv before --out, the --out under a file)`` of every command that writes a folder or a file."""
    gens = write_jsonl(tmp_path / "gens.jsonl", [{"label": "(1) Alice is a knight", "response": "x"}])
    math_in = write_jsonl(tmp_path / "q.jsonl", [{"problem": "1+1", "answer": "2"}])
    return [
        ("train", ["train", "--model", str(model_dir), "--device", "cpu", "--loss-backend", "torch"], "sub"),
        ("eval", ["eval", "--task", "kk", "--generations", str(gens)], "sub"),
        ("data", ["data", "kk", "--people", "3", "--train-per-n", "1", "--test-per-n", "1"], "sub"),
        ("data", ["data", "math", "--input", str(math_in), "--benchmark", "t"], "x.jsonl"),
        ("audit", ["audit", "--prompts", "1", "--n-samples", "2", "--warmup-steps", "1"], "sub"),
        ("demo", ["demo", "--methods", "grpo", "--device", "cpu"], "sub"),
        ("study", ["study", "--no-progress"], "sub"),
        ("tiny-model", ["tiny-model"], "sub"),
    ]


def test_an_out_below_a_file_is_one_line_in_every_command(tmp_path, capsys, model_dir):
    """`--out afile/sub` was a NotADirectoryError (FileExistsError for `data math`) traceback in every command."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for command, argv, name in out_commands(tmp_path, model_dir):
        out = afile / name
        assert fails(capsys, [*argv, "--out", str(out)]) == (
            f"openrlhf-lopti {command}: error: --out {out}: cannot write there ({afile} is a file, not a folder)"
        ), argv
    assert afile.read_text() == "mine"


def test_an_out_where_nothing_can_be_made_is_one_line(tmp_path, capsys):
    """`tiny-model --out /proc/x` trained the tokenizer, then failed in save_pretrained with a FileNotFoundError."""
    import os

    try:
        os.mkdir("/proc/openrlhf-lopti-test")
    except OSError:
        pass
    else:  # pragma: no cover - /proc takes new folders here: nothing to test
        os.rmdir("/proc/openrlhf-lopti-test")
        pytest.skip("/proc takes a new folder on this machine")
    assert fails(capsys, ["tiny-model", "--out", "/proc/x"]).startswith(
        "openrlhf-lopti tiny-model: error: --out /proc/x: cannot write there ("
    )


# ------------------------------------------------------------------------------- tiny-model, resume, audit, eval


@pytest.mark.parametrize("flags, message", [
    (["--hidden-size", "6", "--heads", "2"], "--hidden-size 6: with --heads 2 the head size is 3, which Llama's "
     "rotary embedding cannot take: give a head size that is even (e.g. --hidden-size 8)"),
    (["--seed", "99999999999999999999999"], "--seed 99999999999999999999999: must be an integer with |seed| < 2**40"),
    (["--vocab-size", "1"], "--vocab-size 1: must be at least 259 (the byte-level BPE's 256 byte tokens and 3 special "
     "tokens), or leave it out for every id"),
])  # fmt: skip
def test_tiny_model_refuses_what_it_would_build_wrong(tmp_path, capsys, flags, message):
    """An odd head size made a model whose training crashed in apply_rotary_pos_emb; a huge seed was reported as a
    --vocab-size error; --vocab-size 1 silently gave 259 ids."""
    out = tmp_path / "t"
    assert fails(capsys, ["tiny-model", "--out", str(out), *flags]) == f"openrlhf-lopti tiny-model: error: {message}"
    assert not out.exists()


@pytest.mark.parametrize("saved", ["[1, 2]", "null", '"text"'])
def test_train_resume_of_a_config_that_is_not_an_object_is_one_line(tmp_path, capsys, saved):
    out = tmp_path / "rj"
    out.mkdir()
    (out / "config.json").write_text(saved)
    kind = {"[1, 2]": "list", "null": "NoneType", '"text"': "str"}[saved]
    assert fails(capsys, ["train", "--resume", "--out", str(out)]) == (
        f"openrlhf-lopti train: error: --resume: {out / 'config.json'} holds a JSON {kind}, not the run's settings "
        "(an object of flag names and values, as train writes it); --overwrite to start again"
    )
    assert (out / "config.json").read_text() == saved


@pytest.mark.parametrize("record", ["[1]", '{"parameters": 1}', '{"parameters": 1, "warmup_steps": 1, '
                                    '"warmup_final_loss": 1, "baseline": {"accuracy": 0}, "settings": [1]}'])
def test_demo_resume_of_a_broken_warmup_record_is_one_line(tmp_path, capsys, record):
    out = tmp_path / "dres"
    (out / "warmup_model").mkdir(parents=True)
    (out / "warmup.json").write_text(record)
    line = fails(capsys, ["demo", "--resume", "--out", str(out), "--methods", "grpo", "--device", "cpu"])
    assert line.startswith(f"openrlhf-lopti demo: error: --resume: {out / 'warmup.json'}") and "--overwrite" in line
    assert (out / "warmup.json").read_text() == record


@pytest.mark.parametrize("flags, message", [
    (["--warmup-target", "nan"], "--warmup-target must be an accuracy in [0, 1], got nan"),
    (["--warmup-target", "5"], "--warmup-target must be an accuracy in [0, 1], got 5.0"),
    (["--warmup-steps", "-3"], "--warmup-steps must be >= 1, got -3"),
    (["--warmup-steps", "0"], "--warmup-steps must be >= 1, got 0"),
    (["--seed", "99999999999999999999"], "--seed must be an integer with |seed| < 2**40, got 99999999999999999999"),
])  # fmt: skip
def test_audit_checks_the_warm_up_flags_before_building_the_model(tmp_path, capsys, flags, message):
    """Without --model, audit warms the demo model up first: the demo's checks, before the model is built."""
    out = tmp_path / "au"
    cheap = ["--prompts", "1", "--n-samples", "2", "--max-new-tokens", "1", "--param-grad-tokens", "0",
             "--methods", "grpo", "--device", "cpu", "--threads", "1"]  # fmt: skip
    assert fails(capsys, ["audit", "--out", str(out), *cheap, *flags]) == f"openrlhf-lopti audit: error: {message}"
    assert not out.exists()


def test_audit_with_a_model_checks_the_seed_before_loading_it(tmp_path, capsys, model_dir):
    out = tmp_path / "au"
    assert fails(capsys, ["audit", "--model", str(model_dir), "--out", str(out), "--seed", "-99999999999999999999"]) == (
        "openrlhf-lopti audit: error: --seed must be an integer with |seed| < 2**40, got -99999999999999999999"
    )


@pytest.mark.parametrize("prompt", [[], ["hello"], [{"role": "user"}], [{"role": "user", "content": 3}], 7])
def test_eval_refuses_a_prompt_that_is_not_text_or_chat_messages(tmp_path, capsys, model_dir, prompt):
    """`"prompt": []` was a transformers traceback; ["hello"] or [{"role": "user"}] rendered as garbage."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "fine", "label": "(1) Alice is a knight"},
                                              {"prompt": prompt, "label": "(1) Alice is a knight"}])  # fmt: skip
    out = tmp_path / "ev"
    argv = ["eval", "--task", "kk", "--model", str(model_dir), "--data", str(data), "--out", str(out),
            "--max-new-tokens", "2"]  # fmt: skip
    assert fails(capsys, argv) == (
        f"openrlhf-lopti eval: error: {data} line 2: 'prompt' must be a string or a list of {{'role', 'content'}} "
        f"chat messages, got {json.dumps(prompt)}"
    )
    assert not out.exists()


def test_eval_seed_out_of_range_and_a_missing_label_key(tmp_path, capsys, model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "label": "(1) Alice is a knight"}])
    out = tmp_path / "ev"
    argv = ["eval", "--task", "kk", "--model", str(model_dir), "--data", str(data), "--out", str(out),
            "--max-new-tokens", "2"]  # fmt: skip
    assert fails(capsys, argv + ["--seed", "99999999999999999999"]) == (
        "openrlhf-lopti eval: error: --seed must be an integer with |seed| < 2**63, got 99999999999999999999"
    )
    assert not out.exists()  # (was left behind, empty)
    gens = write_jsonl(tmp_path / "g.jsonl", [{"label": "(1) Alice is a knight", "response": "x"}])
    assert fails(capsys, ["eval", "--task", "kk", "--generations", str(gens), "--label-key", "nope",
                          "--out", str(out)]) == (  # fmt: skip
        f"openrlhf-lopti eval: error: {gens} line 1: no 'nope' key (the row has label, response); pass --label-key "
        "with the right field name"
    )


def test_verl_cpu_overrides_usage_error_is_one_line():
    """``cpu_overrides.py --ngpus x`` printed argparse's usage and the error (3 lines); run by path, as the launch
    script runs it."""
    from pathlib import Path

    import openrlhf_lopti

    script = Path(openrlhf_lopti.__file__).parent / "verl" / "cpu_overrides.py"
    result = subprocess.run([sys.executable, str(script), "--ngpus", "x"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "cpu_overrides.py: error: argument --ngpus: invalid int value: 'x' (see `cpu_overrides.py --help`)"
    ]


def test_data_refuses_an_empty_kk_set_and_an_empty_benchmark_name(tmp_path, capsys):
    out = tmp_path / "kk"
    assert fails(capsys, ["data", "kk", "--out", str(out), "--people", "3", "--train-per-n", "0",
                          "--test-per-n", "0"]) == (  # fmt: skip
        "openrlhf-lopti data: error: --train-per-n 0 --test-per-n 0: nothing to write; give at least one of them > 0"
    )
    math_in = write_jsonl(tmp_path / "q.jsonl", [{"problem": "1+1", "answer": "2"}])
    assert fails(capsys, ["data", "math", "--input", str(math_in), "--benchmark", " ", "--out",
                          str(tmp_path / "m.jsonl")]) == (  # fmt: skip
        "openrlhf-lopti data: error: --benchmark ' ': expected a benchmark name, e.g. math500"
    )
    assert not out.exists() and not (tmp_path / "m.jsonl").exists()
