"""Prompt datasets: the same prompts and labels as OpenRLHF 0.11.2's own reader, bad rows named, batches per step."""

import json
from types import SimpleNamespace

import pytest

from openrlhf_lopti.demo.tiny_model import build_kk_tokenizer
from openrlhf_lopti.errors import UserError
from openrlhf_lopti.local.dataset import epochs_done, load_prompt_set, step_indices

ROWS = [
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}], "label": "2",
     "datasource": "toy"},
    {"prompt": [{"role": "user", "content": "2+3?"}], "label": "5", "datasource": "toy"},
    {"prompt": [{"role": "user", "content": "7*6?"}], "label": "42"},
]  # fmt: skip
PLAIN = [{"question": "1+1?", "answer": "2"}, {"question": "2+3?", "answer": "5"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_kk_tokenizer(vocab_size=300)


def openrlhf_prompts(path, tokenizer, input_key, label_key, apply_chat_template, input_template=None):
    """(datasources, prompts, labels) as OpenRLHF's blending_datasets + PromptDataset read ``path``."""
    from openrlhf.datasets.prompts_dataset import PromptDataset
    from openrlhf.datasets.utils import blending_datasets

    data_args = SimpleNamespace(input_key=input_key, label_key=label_key, apply_chat_template=apply_chat_template)
    strategy = SimpleNamespace(print=lambda *a: None, is_rank_0=lambda: False,
                               args=SimpleNamespace(use_ms=False, data=data_args))  # fmt: skip
    dataset = PromptDataset(blending_datasets(str(path), None, strategy), tokenizer, strategy, input_template)
    items = [dataset[i] for i in range(len(dataset))]
    return [i[0] for i in items], [i[1] for i in items], [i[2] for i in items]


def write(path, rows):
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == "":  # a datasets save_to_disk folder
        from datasets import Dataset

        Dataset.from_list(rows).save_to_disk(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.parquet", "saved_dataset"])
def test_chat_prompts_equal_openrlhfs_in_every_file_format(tmp_path, tokenizer, name):
    path = write(tmp_path / name, ROWS)
    ours = load_prompt_set(str(path), "--data", "prompt", "label", True, tokenizer)
    sources, prompts, labels = openrlhf_prompts(path, tokenizer, "prompt", "label", True)
    assert ours.prompts == prompts and ours.labels == labels and ours.datasources == sources
    assert prompts[1].startswith("<|im_start|>user\n2+3?") and len(ours) == 3


def test_plain_prompts_template_string_as_user_message_and_no_label(tmp_path, tokenizer):
    path = write(tmp_path / "plain.jsonl", PLAIN)
    ours = load_prompt_set(str(path), "--data", "question", "answer", False, tokenizer, "Q: {}\nA:")
    _, prompts, labels = openrlhf_prompts(path, tokenizer, "question", "answer", False, "Q: {}\nA:")
    assert (ours.prompts, ours.labels) == (prompts, labels)
    ours = load_prompt_set(str(path), "--data", "question", "", True, tokenizer)  # a string through the template
    _, prompts, labels = openrlhf_prompts(path, tokenizer, "question", None, True)
    assert ours.prompts == prompts and ours.labels == labels == ["", ""]
    two = load_prompt_set(f"{path},{path}", "--data", "question", "answer", False, tokenizer)  # concatenated
    assert two.labels == ["2", "5", "2", "5"] and two.where[2] == f"{path} line 1"


def test_bad_datasets_are_named_with_file_line_and_key(tmp_path, tokenizer):
    def error(rows, *args, name="d.jsonl"):
        path = write(tmp_path / name, rows)
        with pytest.raises(UserError) as e:
            load_prompt_set(str(path), "--data", *args, tokenizer)
        return str(e.value).replace(str(path), "FILE")

    assert error([ROWS[0], {"label": "3"}], "prompt", "label", True) == (
        "FILE line 2: no 'prompt' key (the row has label); pass --input-key with the field's name"
    )
    assert error([{"prompt": "x"}], "prompt", "label", False) == (
        "FILE line 1: no 'label' key (the row has prompt); pass --label-key with the field's name"
    )
    assert error([], "prompt", "label", False) == "--data FILE: no rows (an empty dataset)"
    assert error(ROWS, "prompt", "label", False) == (
        "FILE line 1: 'prompt' is a list of chat messages: pass --apply-chat-template (OpenRLHF's "
        "--data.apply_chat_template) to render it"
    )
    assert error([{"prompt": 3, "label": "x"}], "prompt", "label", False, name="d.parquet") == (
        "FILE row 1: 'prompt' must be a string, got int"
    )
    no_template = SimpleNamespace(chat_template=None)
    with pytest.raises(UserError, match="tokenizer has no chat template"):
        load_prompt_set(str(tmp_path / "d.jsonl"), "--data", "prompt", "label", True, no_template)


def test_batches_are_a_function_of_seed_and_step_and_cover_each_epoch():
    rows, per_step = 10, 4
    steps = [step_indices(rows, 7, s, per_step) for s in range(10)]  # 4 epochs
    assert steps == [step_indices(rows, 7, s, per_step) for s in range(10)]  # a resumed run sees the same
    stream = [i for s in steps for i in s]
    for epoch in range(4):
        assert sorted(stream[epoch * rows : (epoch + 1) * rows]) == list(range(rows))  # every row once
    assert stream[:rows] != stream[rows : 2 * rows]  # a new order each epoch
    assert step_indices(rows, 8, 0, per_step) != steps[0]  # and per seed
    assert epochs_done(rows, 5, per_step) == 2.0
