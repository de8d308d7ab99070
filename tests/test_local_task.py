"""The local trainer's view of K&K: compact prompts/solutions, the word tokenizer, puzzle seeds, prompt styles."""

import pytest

from openrlhf_lopti.demo.tiny_model import build_word_tokenizer
from openrlhf_lopti.errors import UserError
from openrlhf_lopti.local import task
from openrlhf_lopti.tasks import kk


@pytest.mark.parametrize("people", [2, 3, 5, 8])
def test_compact_words_cover_every_prompt_and_solution(people):
    vocab = set(task.COMPACT_WORDS)
    for record in task.puzzles(0, 0, 40, [people]):
        words = (task.compact_prompt(record) + " " + task.compact_solution(record)).split()
        assert set(words) <= vocab, set(words) - vocab


def test_compact_solution_gets_the_full_reward_and_a_wrong_one_does_not():
    for record in task.puzzles(0, 0, 20, [2, 3]):
        solution = task.compact_solution(record)
        assert kk.reward(solution, record["solution_text_format"]) == 3.0
        assert task.score(solution, record) == (3.0, True, True)
        flipped = solution.replace("knight", "KNAVE").replace("knave", "knight").replace("KNAVE", "knave")
        assert task.score(flipped, record) == (-0.5, False, True)
    assert task.score("no tags at all", record) == (-3.0, False, False)


def test_word_tokenizer_round_trips_compact_text():
    tok = build_word_tokenizer()
    record = task.puzzles(0, 7, 1, [3])[0]
    text = task.compact_prompt(record) + " " + task.compact_solution(record)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert len(ids) == len(text.split())


def test_puzzles_are_deterministic_and_seed_ranges_disjoint():
    assert task.train_puzzles(3, 5, 4, [2]) == task.train_puzzles(3, 5, 4, [2])
    assert task.train_puzzles(3, 5, 4, [2]) != task.train_puzzles(3, 6, 4, [2])
    assert task.train_puzzles(0, 0, 4, [2]) != task.train_puzzles(1, 0, 4, [2])
    assert [r["num_people"] for r in task.puzzles(0, 0, 5, [2, 3])] == [2, 3, 2, 3, 2]
    bases = sorted([task.EVAL_SEED_BASE, task.VALID_SEED_BASE, task.WARMUP_SEED_BASE, task.TRAIN_SEED_BASE])
    assert len(set(bases)) == 4
    with pytest.raises(ValueError, match="people"):
        task.puzzles(0, 0, 1, [])


def test_prompt_styles():
    record = task.puzzles(0, 0, 1, [2])[0]
    tok = build_word_tokenizer()
    assert task.resolve_prompt_style("auto", tok, "compact") == "compact"
    assert task.resolve_prompt_style("auto", tok, None) == "text"  # no chat template
    with pytest.raises(ValueError, match="prompt_style"):
        task.resolve_prompt_style("fancy", tok)
    # chat without a chat template: one line, as --apply-chat-template's (was transformers' ValueError traceback
    # in the first prompt)
    with pytest.raises(UserError, match=r"^--prompt-style chat, but the model's tokenizer has no chat template; use "
                                        r"--prompt-style text"):  # fmt: skip
        task.resolve_prompt_style("chat", tok, "compact")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert task.resolve_prompt_style("chat", tok, "compact") == "chat"
    assert task.resolve_prompt_style("auto", tok, None) == "chat"
    assert task.prompt_for(record, "compact") == task.compact_prompt(record)
    text = task.prompt_for(record, "text")
    assert record["quiz"] in text and text.endswith("Assistant:")
    with pytest.raises(ValueError, match="tokenizer"):
        task.prompt_for(record, "chat")
