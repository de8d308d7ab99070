"""`train --data ... --reward-file ...` end to end on a tiny model: math with tasks/reward_math.py, a reward file
written here (checked against what it was called with), K&K from parquet, bad inputs, a reward error mid-run,
and resumption."""

import json

import pytest
import torch

from openrlhf_lopti.__main__ import main as cli_main
from openrlhf_lopti.demo.tiny_model import build_tiny_model
from openrlhf_lopti.local.checkpoint import load_checkpoint
from openrlhf_lopti.local.config import TrainConfig
from openrlhf_lopti.local.dataset import step_indices
from openrlhf_lopti.local.model import save_model
from openrlhf_lopti.local.plots import panels_for
from openrlhf_lopti.local.trainer import LocalTrainer
from openrlhf_lopti.runs import read_metrics
from openrlhf_lopti.tasks import reward_kk, reward_math

TINY = ["--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "6", "--mini-batch-size", "4",
        "--loss-backend", "torch", "--no-progress", "--threads", "1"]  # fmt: skip
MATH = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(1, 4) for b in range(1, 3)]

# Records what it is called with (one JSON line per call) and scores by response length, so rewards vary.
LOGGING_REWARD = '''
import json

def reward_func(queries, prompts, labels):
    with open({log!r}, "a") as f:
        f.write(json.dumps([queries, prompts, labels]) + "\\n")
    lengths = [len(q) - len(p) for q, p in zip(queries, prompts)]
    return {{"rewards": [n % 5 - 2.0 for n in lengths], "scores": [float(n % 2) for n in lengths],
             "extra_logs": {{"response_chars": [float(n) for n in lengths]}}}}
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tokenizer = build_tiny_model(32, 1, 2, 512, 300, seed=0)
    path = tmp_path_factory.mktemp("models") / "tiny"
    save_model(model, tokenizer, path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def snapshot(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_math_jsonl_with_reward_math_from_data_script_to_eval(model_dir, tmp_path):
    write_jsonl(tmp_path / "math.jsonl", MATH)
    data = tmp_path / "data"
    for split in ("train", "test"):
        assert cli_main(["data", "math", "--input", str(tmp_path / "math.jsonl"), "--benchmark", "toy",
                         "--out", str(data / f"{split}.jsonl")]) == 0  # fmt: skip
    run = tmp_path / "run"
    argv = ["train", "--model", str(model_dir), "--out", str(run), "--data", str(data / "train.jsonl"),
            "--eval-data", str(data / "test.jsonl"), "--eval-prompts", "3", "--input-key", "prompt", "--label-key",
            "label", "--apply-chat-template", "--reward-file", reward_math.__file__, "--steps", "4", *TINY]  # fmt: skip
    assert cli_main(argv) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["epoch"] for r in rows] == [2 / 6, 4 / 6, 1.0, 8 / 6]
    for row in rows:  # reward_math: rewards = scores = answer_reward in {0, 1}; format_reward = \boxed found
        assert row["reward"] == row["accuracy"] == row["reward/answer_reward"] and 0 <= row["reward"] <= 1
        assert 0 <= row["reward/format_reward"] <= 1 and "format_rate" not in row
    assert {"eval_reward", "eval_accuracy", "eval_reward/format_reward"} <= set(rows[-1])
    assert (run / "plots.png").stat().st_size > 0
    titles = [title for key, title in panels_for({"run": rows}) if key.startswith("reward/")]
    assert titles == ["reward file's extra_logs: answer_reward", "reward file's extra_logs: format_reward"]
    # the trained model goes straight into `eval` on the same test file
    argv = ["eval", "--task", "math", "--model", str(run / "final_model"), "--data", str(data / "test.jsonl"),
            "--max-new-tokens", "4", "--out", str(tmp_path / "eval")]  # fmt: skip
    assert cli_main(argv) == 0
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["groups"]["toy"]["prompts"] == 6


def test_a_reward_file_gets_openrlhfs_arguments_and_its_logs_reach_the_metrics(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"q": r["problem"], "a": r["answer"]} for r in MATH[:5]])
    log = tmp_path / "calls.jsonl"
    (tmp_path / "logging_reward.py").write_text(LOGGING_REWARD.format(log=str(log)))
    cfg = TrainConfig(model=str(model_dir), out=str(tmp_path / "run"), data=str(data), input_key="q", label_key="a",
                      input_template="Q: {}\nA:", reward_file=str(tmp_path / "logging_reward.py"), steps=3,
                      prompts_per_step=3, n_samples=2, max_new_tokens=6, mini_batch_size=6, loss_backend="torch",
                      progress=False, seed=3)  # fmt: skip
    rows = LocalTrainer(cfg).run()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    startup, steps = calls[0], calls[1:]
    assert startup[0] == startup[1] == [f"Q: {r['problem']}\nA:" for r in MATH[:3]]  # empty responses
    assert len(steps) == 3
    for step, (queries, prompts, labels) in enumerate(steps):
        picked = [MATH[i] for i in step_indices(5, 3, step, 3) for _ in range(2)]  # n_samples per prompt
        assert labels == [r["answer"] for r in picked]
        assert prompts == [f"Q: {r['problem']}\nA:" for r in picked]
        assert all(q.startswith(p) for q, p in zip(queries, prompts))  # prompt + response, decoded together
        lengths = [len(q) - len(p) for q, p in zip(queries, prompts)]
        assert rows[step]["reward"] == pytest.approx(sum(n % 5 - 2 for n in lengths) / 6)
        assert rows[step]["accuracy"] == pytest.approx(sum(n % 2 for n in lengths) / 6)
        assert rows[step]["reward/response_chars"] == pytest.approx(sum(lengths) / 6)


def test_kk_from_a_parquet_file_with_reward_kk(model_dir, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    assert cli_main(["data", "kk", "--out", str(tmp_path / "kk"), "--people", "2", "3", "--train-per-n", "4",
                     "--test-per-n", "2"]) == 0  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "kk" / "train.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    run = tmp_path / "run"
    argv = ["train", "--model", str(model_dir), "--out", str(run), "--data", str(tmp_path / "train.parquet"),
            "--apply-chat-template", "--reward-file", reward_kk.__file__, "--steps", "2", *TINY]  # fmt: skip
    assert cli_main(argv) == 0
    for row in read_metrics(run / "metrics.jsonl"):  # the paper's rule in [-3, 3], split into its parts
        assert -3 <= row["reward"] <= 3
        assert row["reward"] == pytest.approx(row["reward/format_reward"] + row["reward/answer_reward"])
        assert row["accuracy"] == row["reward/accuracy"]


BAD_REWARDS = {
    "no_func": ("def reward(queries, prompts, labels):\n    return [0.0] * len(queries)\n",
                "defines no function reward_func(queries, prompts, labels) (the name OpenRLHF calls)"),
    "raises": ("def reward_func(queries, prompts, labels):\n    return [float(l['x']) for l in labels]\n",
               "reward_func raised TypeError: string indices must be integers, not 'str' (start-up check on the "
               "first 2 rows of --data with empty responses, 2 responses)"),
    "length": ("def reward_func(queries, prompts, labels):\n    return [0.0]\n",
               "reward_func's return has 1 values for 2 responses (start-up check on the first 2 rows of --data "
               "with empty responses)"),
    "nan": ("def reward_func(queries, prompts, labels):\n    return {'rewards': [float('nan')] * len(queries)}\n",
            "reward_func 'rewards'[0] is nan (start-up check on the first 2 rows of --data with empty responses); "
            "rewards must be finite numbers"),
    "not_a_number": ("def reward_func(queries, prompts, labels):\n    return {'rewards': labels}\n",
                     "reward_func 'rewards'[0] is '4', not a number (start-up check on the first 2 rows of --data "
                     "with empty responses)"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_REWARDS))
def test_bad_reward_files_fail_before_any_step(model_dir, tmp_path, capsys, case):
    body, message = BAD_REWARDS[case]
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": r["problem"], "label": r["answer"]} for r in MATH[-2:]])
    (tmp_path / "r.py").write_text(body)
    run = tmp_path / "run"
    argv = ["train", "--model", str(model_dir), "--out", str(run), "--data", str(data), "--reward-file",
            str(tmp_path / "r.py"), "--steps", "2", *TINY]  # fmt: skip
    assert cli_main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"openrlhf-lopti train: error: --reward-file {tmp_path / 'r.py'}: {message}"
    assert snapshot(run) == []


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": "1+1?", "label": "2"}, {"prompt": "2+2?", "answer": "4"}],
         "{data} line 2: no 'label' key (the row has answer, prompt); pass --label-key with the field's name"),
        ([{"problem": "1+1?", "label": "2"}],
         "{data} line 1: no 'prompt' key (the row has label, problem); pass --input-key with the field's name"),
        ([], "--data {data}: no rows (an empty dataset)"),
    ],
)  # fmt: skip
def test_bad_datasets_fail_before_any_step(model_dir, tmp_path, capsys, rows, message):
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run = tmp_path / "run"
    argv = ["train", "--model", str(model_dir), "--out", str(run), "--data", str(data), "--reward-file",
            reward_math.__file__, *TINY]  # fmt: skip
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.strip() == "openrlhf-lopti train: error: " + message.format(data=data)
    assert snapshot(run) == []


def test_a_reward_error_mid_run_names_the_step_and_keeps_what_was_written(model_dir, tmp_path, capsys):
    # a row that step 2 samples, and that neither step 1 nor the start-up check (the first rows) sees
    seed, rows, per_step = 0, 6, 2
    seen = set(step_indices(rows, seed, 0, per_step)) | set(range(per_step))
    boom = next(i for i in step_indices(rows, seed, 1, per_step) if i not in seen)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "label": "BOOM" if i == boom else str(i)}
                                              for i in range(rows)])  # fmt: skip
    (tmp_path / "r.py").write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    if 'BOOM' in labels:\n        raise ValueError('cannot score BOOM')\n"
        "    return [float(len(q) % 3) for q in queries]\n"
    )
    run = tmp_path / "run"
    argv = ["train", "--model", str(model_dir), "--out", str(run), "--data", str(data), "--reward-file",
            str(tmp_path / "r.py"), "--steps", "3", "--seed", str(seed), *TINY]  # fmt: skip
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"openrlhf-lopti train: error: --reward-file {tmp_path / 'r.py'}: reward_func raised ValueError: cannot "
        "score BOOM (step 2, 4 responses)"
    )
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]  # step 1 kept, nothing torn
    assert load_checkpoint(run)["step"] == 1 and (run / "config.json").exists()


def test_resume_on_a_dataset_run_continues_exactly(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": r["problem"], "label": r["answer"]} for r in MATH])
    (tmp_path / "r.py").write_text(LOGGING_REWARD.format(log=str(tmp_path / "log.jsonl")))

    def config(out, steps):
        return TrainConfig(model=str(model_dir), out=str(out), data=str(data), reward_file=str(tmp_path / "r.py"),
                           steps=steps, prompts_per_step=4, n_samples=2, max_new_tokens=6, mini_batch_size=4,
                           lr=1e-2, loss_backend="torch", progress=False)  # fmt: skip

    full = LocalTrainer(config(tmp_path / "full", 4)).run()
    assert any(r["grad_norm"] > 0 for r in full)  # the rewards vary, so the runs really train
    crashed = tmp_path / "crashed"
    LocalTrainer(config(crashed, 2)).run()
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # killed while logging step 3
    resumed = LocalTrainer(config(crashed, 4), resume=True)
    assert resumed.step == 2
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # noqa: E731
    assert strip(resumed.run()) == strip(full)
    weights = [load_checkpoint(run)["model"]["lm_head.weight"] for run in (crashed, tmp_path / "full")]
    assert torch.equal(*weights)


def test_kk_default_with_reward_kk_file_scores_as_the_built_in_rule(tmp_path):
    """No --data: generated K&K puzzles. Scored through tasks/reward_kk.py (queries decoded as OpenRLHF does)
    the run's rewards equal the built-in paper rule's, step by step."""
    from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
    from openrlhf_lopti.demo.warmup import supervised_warmup

    tok = build_word_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    torch.manual_seed(0)
    supervised_warmup(model, tok, 30, batch_size=16, lr=1e-2, progress=False)  # rewards then vary
    save_model(model, tok, tmp_path / "demo_model", prompt_style="compact")

    def run(name, **kw):
        cfg = TrainConfig(model=str(tmp_path / "demo_model"), out=str(tmp_path / name), steps=3, prompts_per_step=2,
                          n_samples=4, max_new_tokens=16, mini_batch_size=8, lr=1e-2, loss_backend="torch",
                          progress=False, **kw)  # fmt: skip
        return LocalTrainer(cfg).run()

    built_in, via_file = run("built_in"), run("file", reward_file=reward_kk.__file__)
    assert len({r["reward"] for r in built_in}) > 1
    assert [r["reward"] for r in via_file] == pytest.approx([r["reward"] for r in built_in])
    assert [r["accuracy"] for r in via_file] == pytest.approx([r["accuracy"] for r in built_in])
