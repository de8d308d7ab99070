"""``openrlhf-lopti tiny-model``: a Hugging Face checkpoint that writes any K&K text and has a chat template."""

import subprocess
import sys

from openrlhf_lopti.tasks import kk


def test_tiny_model_loads_and_its_tokenizer_writes_every_kk_word(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tiny"
    result = subprocess.run([sys.executable, "-m", "openrlhf_lopti", "tiny-model", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) and model.config.tie_word_embeddings
    puzzle = kk.generate(7, 12345)  # a size and seed the tokenizer's corpus did not hold
    chat = tokenizer.apply_chat_template(kk.make_prompt(puzzle), tokenize=False, add_generation_prompt=True)
    answer = f"<think> ... </think>\n<answer>\n{puzzle['solution_text_format']}\n</answer>"
    for text in (chat, answer, "any text at all: ünïcödé, 123 {}"):
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert chat.endswith("<|im_start|>assistant\n")
    for name in kk.NAMES:  # every name is one token (after a space, as in the puzzles)
        assert len(tokenizer(" " + name, add_special_tokens=False)["input_ids"]) == 1, name
    assert tokenizer.eos_token == "<|im_end|>"  # the end of an assistant turn ends generation


def test_tiny_model_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = subprocess.run([sys.executable, "-m", "openrlhf_lopti", "tiny-model", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2 and "--out" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_a_vocab_size_the_kk_text_cannot_give_is_refused_naming_the_flag(tmp_path):
    from openrlhf_lopti.demo.tiny_model import build_kk_tokenizer

    learned = len(build_kk_tokenizer(seed=0))  # every BPE id the K&K text yields
    assert len(build_kk_tokenizer(learned, seed=0)) == learned and len(build_kk_tokenizer(300, seed=0)) == 300
    out = tmp_path / "tiny"
    result = subprocess.run([sys.executable, "-m", "openrlhf_lopti", "tiny-model", "--out", str(out),
                             "--vocab-size", str(learned + 1)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2
    assert f"--vocab-size {learned + 1}" in result.stderr and f"at most {learned}" in result.stderr
    assert not out.exists() or not any(out.iterdir())
