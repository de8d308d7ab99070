"""Math task: \\boxed extraction, answer equivalence, binary reward, safety on hostile answers, data script."""

import json
import time

import pytest

from openrlhf_lopti.tasks import data
from openrlhf_lopti.tasks import math as m


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one
        ("\\boxed{\\left\\{ x^{2} \\right\\}}", "\\left\\{ x^{2} \\right\\}"),  # nested braces
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("\\boxed{3} and an unfinished \\boxed{4", None),  # truncated: the last box has no answer
        ("no box, the answer is 3", None),
        ("", None),
    ],
)
def test_last_boxed(text, expected):
    assert m.last_boxed(text) == expected


EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac12", "1/2"),
    ("-\\frac{1}{2}", "-0.5"),
    ("\\frac{-1}{2}", "-\\tfrac12"),
    ("3.0", "3"),
    ("1,000", "1000"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\sqrt[3]{8}", "2"),
    ("2^{10}", "1024"),
    ("x^2+2x+1", "(x+1)^2"),
    ("\\frac{\\pi}{4}", "\\pi/4"),
    ("2\\pi", "\\pi \\cdot 2"),
    ("e^{2}", "e^2"),
    ("10^\\circ", "10"),
    ("50\\%", "50"),
    ("\\$5", "5"),
    ("5 \\text{ cm}", "5"),
    ("x = 5", "5"),
    ("x=1, 2", "2,1"),  # bare lists: any order
    ("\\{1,2\\}", "\\{2, 1\\}"),  # sets: any order
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("(-\\infty, 3]", "(-\\infty,3]"),
    ("\\text{(C)}", "C"),
    ("Yes", "yes"),
    ("\\boxed{7}", "7"),  # a ground truth written with its box
]

DIFFERENT = [
    ("x+1", "x+2"),
    ("0.333", "\\frac13"),  # no rounding
    ("\\pi", "3.14159"),
    ("(1,2)", "(2,1)"),  # tuples keep their order
    ("[1,2)", "[1,2]"),
    ("2x", "2y"),  # different variables are different
    ("2 pi", "2"),  # "pi" is not a unit
    ("1", "2"),
    ("", "0"),
    ("no", "yes"),
]


@pytest.mark.parametrize("pred, truth", EQUIVALENT)
def test_equivalent(pred, truth):
    assert m.is_equiv(pred, truth) and m.is_equiv(truth, pred)


@pytest.mark.parametrize("pred, truth", DIFFERENT)
def test_different(pred, truth):
    assert not m.is_equiv(pred, truth) and not m.is_equiv(truth, pred)


def test_reward_is_binary_on_the_last_box():
    assert m.reward("work... \\boxed{\\dfrac{1}{2}}", "\\frac12") == 1.0
    assert m.reward("\\boxed{\\frac12} wait, no: \\boxed{1}", "\\frac12") == 0.0
    assert m.reward("the answer is 1/2", "1/2") == 0.0  # no box, no reward
    assert m.is_equiv(None, "1") is False
    with pytest.raises(TypeError):
        m.reward(None, "1")


@pytest.mark.parametrize(
    "hostile",
    [
        "__import__('os').system('touch /tmp/pwned')",
        "x.__class__",
        "(1).real",
        "lambda: 1",
        "9^{9^{9^{9}}}",  # chained power: would never finish if evaluated
        "10^{100000000}",
        "x^{x^{x}}",
        "1" * 400,
        "[" * 100 + "]" * 100,
        "\\frac{" * 60 + "1" + "}{2}" * 60,
    ],
)
def test_hostile_answers_are_refused_quickly(hostile):
    start = time.perf_counter()
    assert m.is_equiv(hostile, "1") is False
    assert m._sympy_text(m.normalize(hostile)) is None
    assert time.perf_counter() - start < 2.0


def test_sympy_text_allows_only_arithmetic():
    assert m._sympy_text("\\frac{1}{2}+x^{2}") is not None
    for bad in ("__import__", "a.b", "x_1", "f'1'", "x==1", "[1]", "9^{9^{9}}", "2^{1000000}"):
        assert m._sympy_text(bad) is None, bad


def test_reward_is_fast_on_huge_responses():
    mb = 1 << 20
    cases = [
        "\\boxed{" * (mb // 7),  # many unclosed boxes
        "{" * mb + "\\boxed{1}",
        "\\boxed{" + "1+" * (mb // 2) + "1}",  # an enormous boxed expression
        "\\boxed{" + "{" * mb + "}" * mb + "}",
        "x" * mb,
    ]
    start = time.perf_counter()
    rewards = [m.reward(c, "1") for c in cases]
    assert time.perf_counter() - start < 5.0
    assert rewards == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_prompts():
    msgs = m.make_prompt("What is 1+1?")
    assert msgs[-1]["role"] == "user" and "What is 1+1?" in msgs[-1]["content"] and "\\boxed{}" in msgs[-1]["content"]
    assert m.prompt_text("What is 1+1?").endswith("Assistant:")


def test_data_script_math(tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [
        {"problem": "1+1?", "answer": "2"},
        {"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
        {"problem": "int answer", "answer": 3},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out" / "m.jsonl"
    assert data.main(["math", "--input", str(src), "--benchmark", "toy", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in recs] == ["2", "\\frac{1}{2}", "3"]
    assert all(r["benchmark"] == r["datasource"] == "toy" for r in recs)
    assert recs[0]["prompt"] == m.make_prompt("1+1?")
    src.write_text(json.dumps({"problem": "no answer"}) + "\n")
    with pytest.raises(ValueError):
        data.main(["math", "--input", str(src), "--benchmark", "toy", "--out", str(out)])
