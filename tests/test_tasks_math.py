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
    # Times real work: under 1 ms each, idle; 2 s allows far more than 10x and still fails an evaluated power tower
    # (9^9^9^9 never finishes).
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
    # Times real work: 1.4 s measured beside busy processes (load 15, 2 cores); 15 s allows 10x and still fails
    # the super-linear parse it guards against (quadratic on 1 MB: ~10^12 steps, hours).
    assert time.perf_counter() - start < 15.0
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


# ---- From the mutation run (TESTING.md): each case below was computed by hand from the module docstring's rules.

EQUIVALENT_MORE = [
    # nested tuples: items compared recursively, two levels below the top
    ("((1,2),(3,4))", "((1,2),(3,4.0))"),
    ("(((1,2),3),4)", "(((1,2),3),4.0)"),
    ("((1,2),3)", "((1.0,2),3)"),
    ("\\{(1,2),(3,4)\\}", "\\{(3,4.0),(1,2)\\}"),  # a set of tuples, any order
    ("(1.0,2)", "(1,2)"),  # tuples and intervals item by item, not as strings
    ("[1.0,2]", "[1,2]"),
    ("[0.5,2)", "[\\frac12,2)"),
    ("(X, 1.0)", "(X,1)"),
    ("\\{5\\}", "\\{5.0\\}"),  # a one-element set is still a set
    ("\\frac1{x}", "1/x"),  # \frac1{x} -> \frac{1}{x}
    ("\\frac{x}2", "0.5x"),  # \frac{x}2 -> \frac{x}{2}; a decimal inside an expression
    ("0.5x", "\\frac{x}{2}"),
    ("2\\sqrt A", "\\sqrt{4A}"),  # \sqrt A -> \sqrt{A}, upper case too
    ("xy", "x\\cdot y"),  # "xy" is a product once one side is not a word
    ("AB", "A\\cdot B"),
    ("x\\sqrt{4}", "2x"),  # a letter run "xsqrt" is x times sqrt
    ("\\sqrt{4}", "2"),
    ("\\sin(y)^{2}+\\cos(y)^{2}+x", "1+x"),  # a symbol on one side only (y) still gets sample values
    ("a+b+c+d+f+g", "g+f+d+c+b+a"),  # six symbols: the most compared
    ("\u22125", "-5"),  # unicode minus
    ("x.", "x"),  # a sentence's full stop
    (".5", "0.5"),
    ("0" * 1999 + "1", "1"),  # 2000 characters: still normalised and compared as a number
    ("$" + "0" * 1997 + "1$", "1"),  # 2000 characters with the $: still normalised
    ("\\frac{x}{100}+0.0000000005", "\\frac{x}{100}"),  # |difference| 5e-10 < 1e-9 (absolute below 1)
    ("1000000000x+0.1", "1000000000x"),  # relative difference ~5e-11 < 1e-9 at values ~2e9
    # a pole at the first sample point (x = 13/7) is skipped; the other points decide
    ("\\frac{1}{7x-13}", "\\frac{2}{14x-26}"),
    ("1e3", "1000"),  # scientific notation is a number
    ("2.5E-4", "\\frac{1}{4000}"),
    ("2e3x+1.5e-3", "2000x+0.0015"),  # inside an expression too
    ("x \\in [1,2]", "[1,2]"),  # "x \in" is a prefix like "x ="
    ("x\\in(-\\infty,2)", "(-\\infty, 2)"),
    ("3 \\text{ and } 4", "3, 4"),  # a list in words
    ("1, 2, and 3", "3,2,1"),
]

DIFFERENT_MORE = [
    ("(((1.0,2),3),4)", "(((1,2),3),4)"),  # three levels of nesting: past the recursion limit, strings only
    ("\\{((1.0,2),3),4\\}", "\\{((1,2),3),4\\}"),
    ("\\{1,2\\}", "\\{1,3\\}"),
    ("(1,2)", "(1,2,3)"),  # different lengths
    ("1,2", "1,2,3"),
    ("(" + ",".join(["1"] * 21) + ")", "(" + ",".join(["1.0"] * 21) + ")"),  # over 20 items: strings only
    ("0.3333333333333", "\\frac13"),  # numbers are compared exactly, not to sympy's tolerance
    ("0.3333333333333", "1/3"),
    ("12345678901234567890", "12345678901234567891"),
    ("a+b+c+d+f+g+h", "h+g+f+d+c+b+a"),  # seven symbols: not compared
    ("2X", "2"),
    ("1", "\\frac{0}{0}"),  # NaN at every point: cannot tell, so not equivalent
    ("1", "10^{999}"),  # inf at every point
    ("\\frac{x}{100}+0.0000000015", "\\frac{x}{100}"),  # 1.5e-9 > 1e-9 (absolute below 1)
    ("1000000000x+10", "1000000000x"),  # relative ~5e-9 > 1e-9
    ("0" * 2000 + "1", "1"),  # over 2000 characters: compared as strings only
    ("\\sqrt({4})", "2"),  # an unbraced command argument is not guessed
    ("1e3", "100"),
    ("1e3", "3e"),  # 3e is 3 times e, not a number
    ("x \\in [1,2]", "[1,3]"),
    ("x\\infty", "\\infty"),  # \infty is not the prefix \in
    ("x \\in [1,2] \\in [1,3]", "[1,2]"),  # two memberships: not a prefix
    ("3 \\text{ and } 4", "3, 5"),
]


@pytest.mark.parametrize("pred, truth", EQUIVALENT + EQUIVALENT_MORE)
def test_equivalent(pred, truth):
    assert m.is_equiv(pred, truth) and m.is_equiv(truth, pred)


@pytest.mark.parametrize("pred, truth", DIFFERENT + DIFFERENT_MORE)
def test_different(pred, truth):
    assert not m.is_equiv(pred, truth) and not m.is_equiv(truth, pred)


def test_twenty_items_are_compared_item_by_item():
    assert m.is_equiv("(" + ",".join(["1"] * 20) + ")", "(" + ",".join(["1.0"] * 20) + ")")


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("5.", "5"),
        ("\\frac{1}{2}.", "\\frac{1}{2}"),
        ("\\frac1{x}", "\\frac{1}{x}"),
        ("\\frac{x}2", "\\frac{x}{2}"),
        ("x = y = 5", "x=y=5"),  # two '=': not a "var = value" answer
        ("1 + x", "1+x"),
        ("\\fbox{7}", "7"),
        (".5", "0.5"),
        ("x+.5", "x+0.5"),
        ("(C)", "C"),
        ("(c)", "c"),
        ("(F)", "(F)"),  # choices are A-E
        ("x =\n5", "5"),
        ("5\\\ncm", "5"),  # LaTeX control space at a line break, then a unit
        ("\\[5\\]", "5"),
        ("\\(5\\)", "5"),
        ("$5$", "5"),
        ("$X$", "X"),
        ("5\\quad\\text{cm}", "5"),  # \quad is a space (then a unit)
        ("5\\qquad\\text{cm}", "5"),
        ("5\\ cm", "5"),
        ("5\\,\\text{cm}", "5"),  # thin, medium and thick spaces are spaces too (then a unit)
        ("5\\;\\text{cm}", "5"),
        ("5\\:cm", "5"),
        ("1\\,000", "1000"),  # a thin space as thousands separator
        ("1\\!000", "1000"),  # a negative space is removed
        ("\\left(1,2\\right)", "(1,2)"),
        ("10^{\\circ}", "10"),
        ("10^\\circ", "10"),
        ("10\\circ", "10"),
        ("10\u00b0", "10"),
        ("50%", "50"),
        ("50\\%", "50"),
        ("a b" * 700, "ab" * 700),  # over 2000 characters: whitespace removed, nothing else
    ],
)
def test_normalize(answer, expected):
    assert m.normalize(answer) == expected


def test_replace_command_needs_braced_arguments():
    assert m._replace_command("\\frac{1}{2}+\\frac{3}{4}", "\\frac", 2, "(({})/({}))") == "((1)/(2))+((3)/(4))"
    assert m._replace_command("\\sqrt({4})", "\\sqrt", 1, "sqrt({})") is None
    assert m._replace_command("\\frac{1}", "\\frac", 2, "(({})/({}))") is None  # second argument missing at the end
    assert m._replace_command("2\\sqrt", "\\sqrt", 1, "sqrt({})") is None


def test_sympy_text_limits():
    assert m._sympy_text("10" + "+x" * 74) is not None  # 150 characters: the most accepted
    assert m._sympy_text("10" + "+x" * 75) is None
    assert m._sympy_text("1" * 20) is not None
    assert m._sympy_text("1" * 21) is None  # a 21-digit number
    assert m._sympy_text("x^x^x") is None  # chained powers, also with letters
    assert m._sympy_text("2^x^2") is None


def test_last_boxed_edges():
    assert m.last_boxed("the answer is \\boxed") is None
    assert m.last_boxed("\\boxed ") is None
    assert m.last_boxed("\\boxed $") is None
    assert m.last_boxed("\\boxed " + "1" * 300) == "1" * 199  # the brace-less form reads a 200-character window
    with pytest.raises(TypeError, match="^text must be str, got int$"):
        m.last_boxed(5)


def test_is_equiv_type_errors():
    for pred, truth in (("1", 1), (1, "1")):
        with pytest.raises(TypeError, match="^answers must be str$"):
            m.is_equiv(pred, truth)


def test_prompt_text_carries_the_problem():
    text = m.prompt_text("What is 1+1?")
    assert text.count("What is 1+1?") == 1 and m.SYSTEM_PROMPT in text


# ---- Found by an audit, each reproduced first (the case failed before its fix).

BLOW_UPS = [
    "((999^{999})^{999})^{999}",  # bracketed nesting got past the chained-power check: hung while parsing
    "(999^{999})^{999}",  # 3 s
    "\\left(\\left(9^{99}\\right)^{99}\\right)^{99}",
    "\\frac{1}{999^{999}}^{999}",
    "\\sqrt{999^{999}}^{999}",
    "\\exp(999^{999})",  # no power of a power, but exp of a 3000-digit number: hung in evalf
    "\\exp(\\exp(\\exp(9)))",
    "\\sin(999^{999}999^{999}999^{999})",
    "99999999999999999999^{999}",  # a huge literal raised to a power
    "10^{10^{10}}",
    "(10^{9})!",  # factorials: '!' is not on the whitelist
    "99999!",
]


@pytest.mark.parametrize("blow_up", BLOW_UPS)
def test_blow_ups_are_refused_before_sympy(blow_up):
    # The guard is checked first: _sympy_text is what sympy would be given, and it is refused without sympy.
    assert m._sympy_text(m.normalize(blow_up)) is None
    assert m.reward("\\boxed{" + blow_up + "}", "2") == 0.0


def test_log_size_bounds_every_number_sympy_builds():
    assert 3.0 < m._log_size("2**(10)") < 3.02  # 1024
    assert 300 < m._log_size(" sqrt (2)**(999)") < 301  # 2^499.5 is sized as 2^999: an upper bound
    assert m._log_size("2**(999)*2**(999)") is None  # 600 digits: over the 400 allowed
    for nested in ("((999**(999))**(999))**(999)", "(9**(9))**(9)**(9)", "  exp  (999**(999))", "((1)/(7**(999)))"):
        assert m._log_size(nested) is None, nested
    assert m._log_size("  exp  (  exp  (5))") is not None  # e^148 ~ 10^64: nested exp is fine while small
    for bad in ("1 +", "(1", "1)", " sqrt  4", "2 ** * 3", "xy"):  # what sympy could not parse either
        assert m._log_size(bad) is None, bad
    # Still compared: big intermediates whose values are small.
    assert m.is_equiv("\\frac{2^{100}}{2^{99}}", "2")
    assert m.is_equiv("(\\sqrt{2})^{10}", "32")
    assert m.is_equiv("\\exp(\\ln(3))", "3")


MIXED_EQUIVALENT = [
    ("3\\frac{1}{2}", "\\frac{7}{2}"),
    ("3\\frac12", "3.5"),
    ("3 \\tfrac{1}{2}", "7/2"),
    ("2\\dfrac{1}{4}", "\\frac{9}{4}"),
    ("-3\\frac{1}{2}", "-\\frac{7}{2}"),  # -(3 + 1/2), not -3 + 1/2
    ("(1, 2\\frac{1}{2})", "(1, 2.5)"),  # list items are normalised one by one
    ("2\\sqrt{3}", "\\sqrt{12}"),  # products stay products
    ("3\\pi", "\\pi\\cdot 3"),
    ("2\\frac{x}{3}", "\\frac{2x}{3}"),
]
MIXED_DIFFERENT = [
    ("3\\frac{1}{2}", "\\frac{3}{2}"),  # was read as 3 * 1/2
    ("2\\frac{1}{4}", "\\frac{1}{2}"),
    ("-3\\frac{1}{2}", "-\\frac{5}{2}"),
    ("3\\frac{1}{2}", "3"),
]


@pytest.mark.parametrize("pred, truth", MIXED_EQUIVALENT)
def test_mixed_numbers_equivalent(pred, truth):
    assert m.is_equiv(pred, truth) and m.is_equiv(truth, pred)


@pytest.mark.parametrize("pred, truth", MIXED_DIFFERENT)
def test_mixed_numbers_different(pred, truth):
    assert not m.is_equiv(pred, truth) and not m.is_equiv(truth, pred)


def test_normalize_mixed_numbers():
    assert m.normalize("3\\frac{1}{2}") == "\\frac{7}{2}"
    assert m.normalize("-3\\dfrac12") == "-\\frac{7}{2}"
    assert m.normalize("3\\frac{5}{2}") == "3\\frac{5}{2}"  # not a proper fraction: not a mixed number


NUMBER_WORDS_EQUIVALENT = [
    ("10{,}000", "10000"),  # LaTeX's {,} thousands separator
    ("1{,}000{,}000", "1000000"),
    ("10,000", "10{,}000"),
    ("\\$1{,}500", "1500"),
    ("5 million", "5000000"),  # magnitude words are read as numbers
    ("1.5 thousand", "1500"),
    ("2 billion dollars", "2000000000"),
    ("x = 5 million", "5000000"),
    ("3 dozen", "36"),
    ("12\\text{ cm}^2", "12"),  # a unit with a power is still a unit
    ("12\\,\\mathrm{ft}^{3}", "12"),
]
NUMBER_WORDS_DIFFERENT = [
    ("5 million", "5"),  # were stripped as units
    ("1 thousand", "1"),
    ("2 thousandths", "2"),
    ("3 dozen", "3"),
    ("5 hundred thousand", "500"),
    ("3{,}14", "14,3"),  # a decimal comma is not a list
    ("12 x^2", "12"),  # x^2 is no unit
]


@pytest.mark.parametrize("pred, truth", NUMBER_WORDS_EQUIVALENT)
def test_number_words_equivalent(pred, truth):
    assert m.is_equiv(pred, truth) and m.is_equiv(truth, pred)


@pytest.mark.parametrize("pred, truth", NUMBER_WORDS_DIFFERENT)
def test_number_words_different(pred, truth):
    assert not m.is_equiv(pred, truth) and not m.is_equiv(truth, pred)


def test_normalize_number_words():
    assert m.normalize("10{,}000") == "10000"
    assert m.normalize("3{,}14") == "3{,}14"
    assert m.normalize("5 million") == "5000000"
    assert m.normalize("0.125 dozen") == "3/2"
    assert m.normalize("5 millionaires") == "5millionaires"  # neither a magnitude nor a unit
    assert m.normalize("x = 5 cm") == "5"  # the "x = " prefix goes first, then the unit


# sympy's own evaluation loops for ever on some short answers (Mul.flatten, sympy issue 25176; an evalf chase):
# the tree is parsed unevaluated and computed by _value (exact fractions, else mpmath at fixed precision).
SYMPY_LOOPS = [
    "\\sqrt{\\frac{\\sqrt[3]{\\sqrt{13}}}{0.5}}",
    "(25\\sqrt[3]{3}/4)^{1/4}",
    "\\frac{0.5}{\\sqrt[3]{2}}^{x}",
]


@pytest.mark.parametrize("answer", SYMPY_LOOPS)
def test_answers_sympy_loops_on_are_still_compared(answer):
    assert m.is_equiv(answer, "(" + answer + ")\\cdot 1")
    assert not m.is_equiv(answer, "2")


def test_value_computes_without_sympy_evaluation():
    import mpmath
    import sympy

    ctx = mpmath.MPContext()
    root = sympy.Pow(13, sympy.Rational(1, 6), evaluate=False)
    tree = sympy.Pow(sympy.Mul(sympy.Float("2.0"), root, evaluate=False), sympy.S.Half, evaluate=False)
    assert abs(complex(m._value(tree, {}, ctx)) - 2**0.5 * 13 ** (1 / 12)) < 1e-12  # sympy's sqrt(...) never returns
    x = sympy.Symbol("x")
    assert m._value(sympy.Pow(x, 3, evaluate=False), {x: m.Fraction(13, 7)}, ctx) == m.Fraction(13, 7) ** 3  # exact
    assert not m.is_equiv("\\tan((\\sin(\\pi))^{-99})", "2")  # an evalf precision chase: past 10^400, no value


# A unit written as \text{..} after the answer (MATH's "\text{ " rule), after any expression, one letter too.
UNITS_EQUIVALENT = [
    ("5", "5\\text{ m}"),
    ("12", "12\\text{ s}"),
    ("6", "6\\text{ m}^2"),
    ("\\frac{1}{2}", "\\frac{1}{2}\\text{ cm}"),
    ("\\frac12", "\\frac{1}{2}\\text{cm}"),
    ("2\\sqrt{3}", "2\\sqrt{3}\\text{ cm}"),
    ("(1,2)", "(1,2)\\text{ units}"),
]
UNITS_DIFFERENT = [
    ("e", "\\mathrm{e}^2"),  # one letter without a space is a symbol (Euler's e), and its power stays
    ("5", "6\\text{ m}"),
    ("5", "\\text{ m}"),  # nothing before the text: it is the answer, not a unit
]


@pytest.mark.parametrize("pred, truth", UNITS_EQUIVALENT)
def test_a_text_unit_after_any_answer_is_dropped(pred, truth):
    assert m.is_equiv(pred, truth) and m.is_equiv(truth, pred)


@pytest.mark.parametrize("pred, truth", UNITS_DIFFERENT)
def test_text_that_is_not_a_trailing_unit_stays(pred, truth):
    assert not m.is_equiv(pred, truth) and not m.is_equiv(truth, pred)


@pytest.mark.parametrize("box", ["\\boxed{}", "\\boxed{ }", "\\boxed{\\,}", "\\boxed{$$}"])
def test_an_empty_answer_is_never_right_not_even_against_an_empty_label(box):
    assert m.reward(f"so {box}", "") == 0.0 and m.reward(f"so {box}", "5") == 0.0
    assert m.reward("so \\boxed{5}", "") == 0.0


def test_data_math_takes_a_one_answer_list_and_refuses_empty_or_other_answers(tmp_path):
    """OlympiadBench's final_answer is a list of one string: it was written as the label "['$\\\\frac{1}{2}$']",
    which no answer matches; an empty answer made every empty box right."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"question": "q", "final_answer": ["$\\frac{1}{2}$"]}) + "\n")
    flags = ["math", "--input", str(src), "--benchmark", "olympiad", "--out", str(out), "--problem-key", "question"]
    assert data.main([*flags, "--answer-key", "final_answer"]) == 0
    label = json.loads(out.read_text())["label"]
    assert label == "$\\frac{1}{2}$" and m.reward("\\boxed{\\frac{1}{2}}", label) == 1.0
    for answer, says in [("", "'final_answer' is empty"), ("  ", "'final_answer' is empty"),
                         (["1", "2"], "'final_answer' must be a string or a number (the answer), got list"),
                         ({"a": 1}, "'final_answer' must be a string or a number"), (True, "got bool")]:  # fmt: skip
        src.write_text(json.dumps({"question": "q", "final_answer": answer}) + "\n")
        with pytest.raises(data.UserError, match=f"^{src} line 1: .*{says}".replace("(", r"\(").replace(")", r"\)")):
            data.main([*flags, "--answer-key", "final_answer", "--overwrite"])
    src.write_text(json.dumps({"question": "q", "solution": "so \\boxed{}"}) + "\n")
    with pytest.raises(data.UserError, match=r"the \\boxed\{\} of 'solution' is empty"):
        data.main([*flags, "--overwrite"])
