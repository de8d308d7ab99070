"""The K&K data and reward for verl: ``python -m openrlhf_lopti data kk`` -> ``python -m openrlhf_lopti.verl.data``
-> parquet that verl's own ``RLHFDataset`` reads (main_ppo's ``data`` config), and the reward file loaded by path the
way verl loads ``reward.custom_reward_function``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_lopti.tasks import load_rows

REWARD_FILE = Path(__file__).resolve().parents[2] / "openrlhf_lopti" / "verl" / "reward.py"


@pytest.fixture(scope="module")
def kk_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("kk")
    run = subprocess.run([sys.executable, "-m", "openrlhf_lopti", "data", "kk", "--out", str(out), "--people", "3",
                          "5", "--train-per-n", "3", "--test-per-n", "2"], capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, "-m", "openrlhf_lopti.verl.data", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return out


def test_verls_dataset_reads_the_converted_files(kk_dir, tiny):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from . import harness

    tokenizer = AutoTokenizer.from_pretrained(tiny["path"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    cfg = harness.compose([])  # main_ppo's data config, as given
    data_config = OmegaConf.create(OmegaConf.to_container(cfg.data))
    data_config.update(max_prompt_length=4096, cache_dir=str(kk_dir / "cache"))
    dataset = RLHFDataset(data_files=str(kk_dir / "train.parquet"), tokenizer=tokenizer, config=data_config)
    rows, _ = load_rows(kk_dir / "train.jsonl")
    assert len(dataset) == len(rows) == 6
    item = dataset[0]
    assert item["data_source"] == rows[0]["datasource"] in ("kk_3ppl", "kk_5ppl")
    assert item["reward_model"] == {"style": "rule", "ground_truth": rows[0]["label"]}
    assert item["extra_info"]["num_people"] == rows[0]["num_people"]
    assert [m["content"] for m in item["raw_prompt"]] == [m["content"] for m in rows[0]["prompt"]]
    test = RLHFDataset(data_files=str(kk_dir / "test.parquet"), tokenizer=tokenizer, config=data_config)
    assert len(test) == 4


def test_the_converter_refuses_to_overwrite_and_plain_prompts(kk_dir, tmp_path):
    # as a user runs it: without the VERL_PLATFORM=cpu this test session exports (verl on the CPU logs a line)
    env = {key: value for key, value in os.environ.items() if key != "VERL_PLATFORM"}
    run = subprocess.run([sys.executable, "-m", "openrlhf_lopti.verl.data", str(kk_dir)], capture_output=True,
                         text=True, env=env)  # fmt: skip
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--overwrite" in run.stderr
    plain = tmp_path / "plain"
    subprocess.run([sys.executable, "-m", "openrlhf_lopti", "data", "kk", "--out", str(plain), "--people", "3",
                    "--train-per-n", "1", "--test-per-n", "1", "--plain-prompt"], check=True, capture_output=True)  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "openrlhf_lopti.verl.data", str(plain)], capture_output=True,
                         text=True, env=env)  # fmt: skip
    assert run.returncode == 2 and "without --plain-prompt" in run.stderr and run.stderr.count("\n") == 1


@pytest.mark.parametrize("path", [str(REWARD_FILE), "pkg://openrlhf_lopti.verl.reward"], ids=["file", "pkg"])
def test_the_reward_file_as_verl_loads_it(kk_dir, path):
    from verl.utils.import_utils import load_extern_object

    compute_score = load_extern_object(module_path=path, object_name="compute_score")
    label = load_rows(kk_dir / "test.jsonl")[0][0]["label"]
    right = f"<think> reasoning </think>\n<answer>\n{label}\n</answer>"
    assert compute_score(data_source="kk_3ppl", solution_str=right, ground_truth=label, extra_info={}) == {
        "score": 3.0, "format_reward": 1.0, "answer_reward": 2.0, "acc": 1.0,
    }  # fmt: skip
    flipped = label.replace("knight", "KNAVE").replace("knave", "knight").replace("KNAVE", "knave")
    wrong = f"<think> reasoning </think>\n<answer>\n{flipped}\n</answer>"
    assert compute_score(data_source="kk_3ppl", solution_str=wrong, ground_truth=label)["score"] == -0.5
    assert compute_score(data_source="kk_3ppl", solution_str="no tags", ground_truth=label)["score"] == -3.0


GOOD_ROW = {"prompt": [{"role": "user", "content": "hi"}], "label": "(1) A is a knight", "num_people": 2,
            "datasource": "kk_2ppl"}  # fmt: skip


def test_the_converter_refuses_an_out_that_is_a_file_in_one_line(tmp_path, capsys):
    """(Before: a FileExistsError traceback.)"""
    import json

    from openrlhf_lopti.verl.data import main

    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
    out = tmp_path / "train.jsonl"
    assert main([str(tmp_path), "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err == (f"openrlhf_lopti.verl.data: error: --out {out}: is a file; --out takes a folder (train.parquet and "
                   "test.parquet go there)\n")  # fmt: skip
    assert main([str(tmp_path), "--out", str(out / "sub")]) == 2  # a folder on the way that is a file
    assert capsys.readouterr().err.startswith(f"openrlhf_lopti.verl.data: error: --out {out / 'sub'}: cannot write ")
    assert not list(tmp_path.glob("*.parquet"))


@pytest.mark.parametrize(
    "train, test, error",
    [
        ([GOOD_ROW], [], "test.jsonl has no prompts: verl cannot load an empty dataset; write at least one (data kk "
                         "--test-per-n 1)"),  # fmt: skip
        ([dict(GOOD_ROW, num_people=None)], [GOOD_ROW], "train.jsonl line 1: num_people must be a whole number >= 1, "
                                                        "got None"),  # fmt: skip
        ([dict(GOOD_ROW, prompt=[{"content": "hi"}])], [GOOD_ROW], "train.jsonl line 1: prompt must be a list of "),
        ([GOOD_ROW], [GOOD_ROW, dict(GOOD_ROW, prompt=["hi"])], "test.jsonl line 2: prompt must be a list of "),
        ([dict(GOOD_ROW, label=3)], [GOOD_ROW], "train.jsonl line 1: label must be text, got 3"),
        # before: written, then the reward raised in a Ray worker after the first rollout
        ([dict(GOOD_ROW, label="Alice is a hero")], [GOOD_ROW], "train.jsonl line 1: label: cannot read label line "),
        ([GOOD_ROW], [dict(GOOD_ROW, label="")], "test.jsonl line 1: label: empty K&K label"),
    ],
    ids=["empty-split", "num_people-null", "message-without-role", "messages-as-strings", "label-not-text",
         "label-unreadable", "label-empty"],  # fmt: skip
)
def test_the_converter_names_a_bad_file_or_row_in_one_line_and_writes_nothing(tmp_path, capsys, train, test, error):
    """Before: an empty split wrote a parquet file of no columns that verl's dataset fails on later ("An error
    occurred while generating the dataset"), and these rows raised a TypeError / KeyError traceback."""
    import json

    from openrlhf_lopti.verl.data import main

    for split, rows in (("train", train), ("test", test)):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err, err
    assert not list(tmp_path.glob("*.parquet"))
    (tmp_path / "test.jsonl").write_text(json.dumps(dict(GOOD_ROW, num_people="3")) + "\n")
    (tmp_path / "train.jsonl").write_text(json.dumps(dict(GOOD_ROW, num_people=2.0)) + "\n")
    assert main([str(tmp_path)]) == 0  # a whole number written as text or a float is still one
