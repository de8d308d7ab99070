"""Knights and Knaves: solver, generator, prompt, the paper's reward, public-file loader and data script."""

import itertools
import json
import random
import re
import time

import pytest

from openrlhf_lopti.tasks import data, kk

# --------------------------------------------------------------------------------------------------
# Solver
# --------------------------------------------------------------------------------------------------

# Two records of the public dataset (Xie et al. 2024), solutions checked by hand:
# Jack: "Samuel is a knight iff Samuel is a knave" is always false, so Jack is a knave;
# Samuel: "if Jack is a knight then Samuel is a knight" is then true, so Samuel is a knight.
JACK_SAMUEL = "(('<=>', ('telling-truth', 1), ('lying', 1)), ('->', ('telling-truth', 0), ('telling-truth', 1)))"
# Ethan knave, Abigail/David/Noah knights: Ethan's "David or Abigail is a knave" is false (ok, he lies);
# Abigail's "Abigail knight -> David knight" true; David's "Noah knight and Ethan knave" true;
# Noah's "Abigail knave <=> Ethan knight" is (F <=> F), true.
FOUR_PEOPLE = (
    "(('or', ('lying', 2), ('lying', 1)), ('->', ('telling-truth', 1), ('telling-truth', 2)), "
    "('and', ('telling-truth', 3), ('lying', 0)), ('<=>', ('lying', 1), ('telling-truth', 0)))"
)


def test_solve_public_records():
    assert kk.solve(JACK_SAMUEL) == [(False, True)]
    assert kk.solve(FOUR_PEOPLE) == [(False, True, True, True)]


def test_solve_accepts_tuples_lists_and_strings_alike():
    as_tuples = kk.parse_statements(FOUR_PEOPLE)
    as_lists = json.loads(json.dumps(as_tuples))  # what a JSON round trip makes of them
    assert isinstance(as_lists[0], list)
    assert kk.solve(as_tuples) == kk.solve(as_lists) == kk.solve(FOUR_PEOPLE)


def test_solve_zero_and_several_solutions_in_public_order():
    assert kk.solve([("lying", 0)]) == []  # "I am a knave" is unsayable
    assert kk.solve([("telling-truth", 0)]) == [(True,), (False,)]  # "I am a knight": both work
    # "A: B is a knight", "B: A is a knight": both knights or both knaves; product([True, False]) order.
    assert kk.solve([("telling-truth", 1), ("telling-truth", 0)]) == [(True, True), (False, False)]


def test_solve_nary_and_not():
    # A: "B, C and I are knights"; B: "not (C is a knave)"; C (one-operand or): "A is a knave".
    # A knight -> C knave -> B knave -> A's claim false: impossible. A knave -> C knight -> B knight,
    # and A's claim is false because A is not a knight: consistent.
    a_says = ("and", ("telling-truth", 1), ("telling-truth", 2), ("telling-truth", 0))
    st = [a_says, ("not", ("lying", 2)), ("or", ("lying", 0))]
    assert kk.solve(st) == [(False, True, True)]


def _eval_ref(node, assignment):
    op, args = node[0], node[1:]
    if op == "telling-truth":
        return assignment[args[0]]
    if op == "lying":
        return not assignment[args[0]]
    vals = [_eval_ref(a, assignment) for a in args]
    return {
        "not": lambda: not vals[0],
        "and": lambda: all(vals),
        "or": lambda: any(vals),
        "->": lambda: (not vals[0]) or vals[1],
        "<=>": lambda: vals[0] == vals[1],
    }[op]()


def _solve_ref(statements):
    n = len(statements)
    return [
        a
        for a in itertools.product([True, False], repeat=n)
        if all(_eval_ref(s, a) == a[i] for i, s in enumerate(statements))
    ]


def _random_tree(n, rng, depth):
    if depth == 0 or rng.random() < 0.3:
        return (rng.choice(["telling-truth", "lying"]), rng.randrange(n))
    op = rng.choice(["not", "and", "or", "->", "<=>"])
    if op == "not":
        return ("not", _random_tree(n, rng, depth - 1))
    width = rng.randint(1, 3) if op in ("and", "or") else 2
    return (op, *(_random_tree(n, rng, depth - 1) for _ in range(width)))


def test_solve_matches_brute_force_reference():
    rng = random.Random(1234)
    for _ in range(400):
        n = rng.randint(1, 6)
        statements = tuple(_random_tree(n, rng, rng.randint(0, 3)) for _ in range(n))
        assert kk.solve(statements) == _solve_ref(statements), statements


@pytest.mark.parametrize(
    "bad",
    [
        "(('telling-truth', 2),)",  # index out of range
        "(('knight', 0),)",  # unknown operator
        "(('telling-truth', True),)",  # bool is not an index
        "(('->', ('lying', 0)),)",  # '->' needs two operands
        "(('not',),)",
        "__import__('os').system('true')",  # never evaluated as code
        "((",
        "()",
        42,
    ],
)
def test_parse_statements_rejects(bad):
    with pytest.raises(ValueError):
        kk.parse_statements(bad)


def test_solve_refuses_more_people_than_the_limit():
    with pytest.raises(ValueError):
        kk.solve([("lying", 0)] * (kk.MAX_PEOPLE + 1))


# --------------------------------------------------------------------------------------------------
# Generator and prompt
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 10, 12])
def test_generate_unique_solution_and_consistent_record(n):
    for seed in range(15):
        rec = kk.generate(n, seed)
        assert kk.solve(rec["statements"]) == [tuple(rec["solution"])]
        assert rec["num_people"] == n and len(rec["names"]) == len(set(rec["names"])) == n
        names, roles = kk.parse_solution_text(rec["solution_text_format"])
        assert names == rec["names"] and roles == rec["solution"]
        lines = rec["solution_text_format"].split("\n")
        assert lines[0] == f"(1) {rec['names'][0]} is a {'knight' if rec['solution'][0] else 'knave'}"
        assert len(lines) == n
        assert f"You meet {n} inhabitants" in rec["quiz"]
        assert all(name in rec["quiz"] for name in rec["names"])
        # every statement is spoken, quoted, in the quiz
        assert rec["quiz"].count('"') == 2 * n


def test_generate_is_deterministic_per_seed():
    assert kk.generate(5, 7) == kk.generate(5, 7)
    quizzes = {kk.generate(5, s)["quiz"] for s in range(30)}
    assert len(quizzes) == 30


def test_generate_rejects_bad_sizes():
    for n in (0, 1, kk.MAX_PEOPLE + 1):
        with pytest.raises(ValueError):
            kk.generate(n, 0)


def test_render_statement_covers_every_operator():
    names = ["Ann", "Bob", "Cy"]
    r = kk.render_statement
    assert r(("telling-truth", 0), names) == "Ann is a knight"
    assert r(("lying", 1), names) == "Bob is a knave"
    assert r(("not", ("lying", 1)), names) == "it is false that Bob is a knave"
    assert r(("and", ("lying", 0), ("lying", 1)), names) == "Ann is a knave and Bob is a knave"
    assert r(("or", ("lying", 0), ("lying", 1), ("lying", 2)), names) == (
        "Ann is a knave, Bob is a knave, or Cy is a knave"
    )
    assert r(("->", ("lying", 0), ("lying", 1)), names) == "if Ann is a knave then Bob is a knave"
    assert r(("<=>", ("lying", 0), ("lying", 1)), names) == "Ann is a knave if and only if Bob is a knave"


def test_prompts():
    rec = kk.generate(3, 0)
    msgs = kk.make_prompt(rec)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[1]["content"] == rec["quiz"]
    assert all(tag in msgs[0]["content"] for tag in ("<think>", "</think>", "<answer>", "</answer>"))
    text = kk.prompt_text(rec)
    assert rec["quiz"] in text and text.endswith("Assistant:")


# --------------------------------------------------------------------------------------------------
# Reward (paper Table 4 / Logic-RL)
# --------------------------------------------------------------------------------------------------

LABEL = "(1) Alice is a knight\n(2) Bruno is a knave\n(3) Clara is a knight"
RIGHT = "(1) Alice is a knight\n(2) Bruno is a knave\n(3) Clara is a knight"


def wrap(answer, think="Let me reason."):
    return f"<think>{think}</think>\n<answer>{answer}</answer>"


@pytest.mark.parametrize(
    "response, fmt, ans",
    [
        (wrap(RIGHT), 1.0, 2.0),
        (wrap("Clara is a knight, Bruno is a knave and Alice is a knight."), 1.0, 2.0),  # any order / prose
        (wrap("alice IS A KNIGHT\nbruno is\n a   knave\nCLARA is a knight"), 1.0, 2.0),  # case, whitespace
        (wrap(RIGHT.replace("Bruno is a knave", "Bruno is a knight")), 1.0, -1.5),  # parsed, one wrong
        (wrap("(1) Alice is a knight\n(3) Clara is a knight"), 1.0, -2.0),  # Bruno missing
        (wrap(RIGHT + "\nBruno is a knight"), 1.0, -2.0),  # Bruno given both roles
        (wrap(RIGHT + "\nBruno is a knave"), 1.0, -2.0),  # Bruno named twice: Logic-RL counts it unparsed
        (wrap("Alicea is a knight, Bruno is a knave, Clara is a knight"), 1.0, -2.0),  # not Alice
        (wrap("   "), 1.0, -2.0),  # empty answer
        (wrap("Alice: knight, Bruno: knave, Clara: knight"), 1.0, -2.0),  # no "is a" phrase
        (f"<think>x</think><answer>{RIGHT}", -1.0, -2.0),  # no </answer>
        (f"<think>x<answer>{RIGHT}</answer>", -1.0, -2.0),  # no </think>
        (f"{RIGHT}", -1.0, -2.0),  # no tags at all
        (f"<answer>{RIGHT}</answer><think>x</think>", -1.0, -2.0),  # wrong order
        (f"<think>x</think><answer>{RIGHT}</answer><answer>{RIGHT}</answer>", -1.0, -2.0),  # two answers
        (f"<think><think>x</think></think><answer>{RIGHT}</answer>", -1.0, -2.0),  # nested think
        (f"<think>x</answer></think><answer>{RIGHT}</answer>", -1.0, -2.0),
    ],
)
def test_reward_every_branch(response, fmt, ans):
    assert kk.reward_parts(response, LABEL) == (fmt, ans)
    r = kk.reward(response, LABEL)
    assert isinstance(r, float) and r == fmt + ans
    assert kk.answer_ok(response, LABEL) == (ans == 2.0)


def test_reward_label_names_with_spaces_and_punctuation():
    label = "(1) Mary Ann is a knight\n(2) J. is a knave"
    assert kk.parse_solution_text(label) == (["Mary Ann", "J."], [True, False])
    assert kk.reward(wrap("Mary Ann is a knight; J. is a knave"), label) == 3.0
    assert kk.reward(wrap("Ann is a knight; J. is a knave"), label) == -1.0


def test_parse_answer():
    names = ["Alice", "Bruno", "Clara"]
    assert kk.parse_answer("no tags", names) is None
    assert kk.parse_answer("<answer>Alice is a knight", names) is None
    assert kk.parse_answer(wrap("Alice is a knave. Clara is a knight, Clara is a knave."), names) == [False, None, None]
    # the last complete block counts
    two = "<answer>Alice is a knave</answer> later <answer>Alice is a knight</answer>"
    assert kk.parse_answer(two, names) == [True, None, None]


def test_bad_label_raises_and_non_string_response_raises():
    with pytest.raises(ValueError):
        kk.parse_solution_text("")
    with pytest.raises(ValueError):
        kk.reward(wrap(RIGHT), "Alice knight")
    with pytest.raises(TypeError):
        kk.reward(None, LABEL)
    with pytest.raises(TypeError):
        kk.parse_answer(b"<answer></answer>", ["Alice"])


def _logic_rl_reference(response, label):
    """Independent re-statement of the Logic-RL rule (count/find for tags, re for the answer)."""
    gt = dict(re.findall(r"\(\d+\)\s*(\w+) is a (knight|knave)", label))
    tags = ["<think>", "</think>", "<answer>", "</answer>"]
    ok = all(response.count(t) == 1 for t in tags)
    pos = [response.find(t) for t in tags]
    ok = ok and pos == sorted(pos)
    fmt = 1.0 if ok else -1.0
    matches = list(re.finditer(r"<answer>(.*?)</answer>", response, re.DOTALL))
    text = matches[-1].group(1).strip() if matches else ""
    if not ok or not text:
        return fmt, -2.0
    pred = {}
    for name in gt:
        kn = len(re.findall(rf"\b{name}\b\s+is\s+a\s+knight\b", text, re.IGNORECASE))
        kv = len(re.findall(rf"\b{name}\b\s+is\s+a\s+knave\b", text, re.IGNORECASE))
        if kn + kv != 1:
            return fmt, -2.0
        pred[name] = "knight" if kn else "knave"
    return fmt, 2.0 if pred == gt else -1.5


def _mutated_answer(rng):
    claims = ["Alice is a knight", "Bruno is a knave", "Clara is a knight"]
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        i = rng.randrange(len(claims)) if claims else 0
        edit = rng.choice(["flip", "drop", "dup", "rename", "case", "space", "noise"]) if claims else "noise"
        if edit == "flip":
            c = claims[i]
            claims[i] = c.replace("knight", "KNAVE") if "knight" in c else c.replace("knave", "knight")
        elif edit == "drop":
            claims.pop(i)
        elif edit == "dup":
            claims.append(claims[i])
        elif edit == "rename":
            claims[i] = "x" + claims[i] if rng.random() < 0.5 else claims[i].replace(" is", "x is", 1)
        elif edit == "case":
            claims[i] = claims[i].lower() if rng.random() < 0.5 else claims[i].upper()
        elif edit == "space":
            claims[i] = claims[i].replace(" a ", rng.choice(["  a\n", " an ", " not a "]))
        else:
            claims.append(rng.choice(["knight", "is a knave", "(2)", "Bruno", ""]))
    rng.shuffle(claims)
    return rng.choice([", ", "\n", ". "]).join(claims)


def test_reward_matches_reference_on_fuzzed_responses():
    rng = random.Random(0)
    pieces = [
        "<think>", "</think>", "<answer>", "</answer>", "<answer", "think>", " ", "\n", "\t", "(1) ",
        "Alice", "Bruno", "Clara", "alice", "Alicex", " is a knight", " is a knave", " is  a\nknave",
        " is not a knight", ", ", ".", "knight", "is a", "xyz", "\u00e9", "\u0000",
    ]  # fmt: skip
    seen = set()
    for _ in range(3000):
        resp = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.5:  # a well-formed skeleton holding a mutated right answer: every branch is hit
            resp = f"<think>{resp.replace('<', '')}</think><answer>{_mutated_answer(rng)}</answer>"
        got = kk.reward_parts(resp, LABEL)
        assert got == _logic_rl_reference(resp, LABEL), resp
        seen.add(got)
    assert {(1.0, 2.0), (1.0, -1.5), (1.0, -2.0), (-1.0, -2.0)} <= seen


def test_reward_is_fast_and_total_on_adversarial_strings():
    rng = random.Random(1)
    mb = 1 << 20
    garbage = "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(mb))
    adversarial = [
        garbage,
        "<answer>" * (mb // 8),
        "<think>" * (mb // 14) + "</think>" * (mb // 16),
        "<think>x</think><answer>" + "Alice is a knight " * (mb // 18) + "</answer>",
        "<think>x</think><answer>Alice" + " " * mb + "is a knight</answer>",
        "<think>x</think><answer>" + "Alice is" + " \n" * (mb // 2) + "</answer>",
        "<think>x</think><answer>" + "(" * mb + "</answer>",
        "<think></think><answer>" + "\ud800\udfff" * 1000 + RIGHT + "</answer>",
        "",
    ]
    start = time.perf_counter()
    rewards = [kk.reward(s, LABEL) for s in adversarial]
    elapsed = time.perf_counter() - start
    assert all(r in (3.0, -0.5, -1.0, -3.0) for r in rewards)
    assert rewards[-2] == 3.0 and rewards[0] == -3.0
    # Times real work: 3.1 s measured beside busy processes (load 15, 2 cores); 30 s allows 10x and still fails
    # a super-linear regex on these megabytes (quadratic: ~10^12 steps, hours).
    assert elapsed < 30.0, f"reward took {elapsed:.2f}s on 8 MB of adversarial text"


# --------------------------------------------------------------------------------------------------
# Public files and the data script
# --------------------------------------------------------------------------------------------------


def _public_row(puzzle, index):
    """A row in the public files' layout (statements as repr string, no num_people)."""
    row = {k: puzzle[k] for k in ("quiz", "names", "solution", "solution_text", "solution_text_format", "statements")}
    row["index"] = index
    return row


def test_load_public_jsonl_and_parquet(tmp_path):
    rows = [_public_row(kk.generate(n, n), i) for i, n in enumerate((3, 4))]
    rows[1].pop("solution_text_format")  # rebuilt from names + solution
    path = tmp_path / "people_mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = kk.load_public(path, verify=True)
    assert [r["num_people"] for r in recs] == [3, 4]
    assert recs[1]["solution_text_format"] == kk.generate(4, 4)["solution_text_format"]

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert [r["solution"] for r in kk.load_public(tmp_path / "p.parquet", verify=True)] == [r["solution"] for r in recs]


def test_load_public_verify_catches_wrong_solution(tmp_path):
    row = _public_row(kk.generate(3, 0), 0)
    row["solution"] = [not s for s in row["solution"]]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert len(kk.load_public(path)) == 1
    with pytest.raises(ValueError):
        kk.load_public(path, verify=True)


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_data_script_generates_openrlhf_prompt_sets(tmp_path):
    argv = ["kk", "--out", str(tmp_path / "a"), "--people", "2", "3", "--train-per-n", "40", "--test-per-n", "10"]
    assert data.main(argv) == 0
    train, test = _read(tmp_path / "a" / "train.jsonl"), _read(tmp_path / "a" / "test.jsonl")
    assert len(train) == 80 and len(test) == 20
    assert len(_read(tmp_path / "a" / "test" / "people3.jsonl")) == 10
    rec = test[0]
    assert set(rec) == {"prompt", "label", "num_people", "datasource"}
    assert [m["role"] for m in rec["prompt"]] == ["system", "user"]
    assert rec["datasource"] == f"kk_{rec['num_people']}ppl"
    # labels are what reward_kk needs: a right answer built from the label scores the maximum
    for r in train + test:
        names, roles = kk.parse_solution_text(r["label"])
        assert len(names) == r["num_people"]
        assert kk.reward(wrap(r["label"]), r["label"]) == 3.0
    quizzes = lambda rows: {r["prompt"][1]["content"] for r in rows}  # noqa: E731
    assert not quizzes(train) & quizzes(test)
    assert len(quizzes(train)) == 80
    # deterministic
    data.main(argv[:2] + [str(tmp_path / "b")] + argv[3:])
    assert (tmp_path / "a" / "train.jsonl").read_text() == (tmp_path / "b" / "train.jsonl").read_text()


def test_data_script_plain_prompt(tmp_path):
    argv = ["kk", "--out", str(tmp_path), "--people", "3", "--train-per-n", "2", "--test-per-n", "1", "--plain-prompt"]
    data.main(argv)
    rec = _read(tmp_path / "test.jsonl")[0]
    assert isinstance(rec["prompt"], str) and rec["prompt"].endswith("Assistant:")


def test_data_script_public_source_respects_test_folder(tmp_path):
    src = tmp_path / "kk_public"
    (src / "train").mkdir(parents=True)
    (src / "test").mkdir()
    train_rows = [_public_row(kk.generate(3, s), s) for s in range(6)]
    test_rows = [_public_row(kk.generate(3, 100 + s), s) for s in range(2)]
    test_rows.append(train_rows[0])  # a quiz in both files must not stay in train
    (src / "train" / "people3_num6.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    (src / "test" / "people3_num3.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test_rows))
    splits = data.kk_splits([3], train_per_n=100, test_per_n=100, sources=[str(src)])
    test_q = {r["quiz"] for r in splits["test"][3]}
    assert test_q == {r["quiz"] for r in test_rows}
    assert len(splits["train"][3]) == 5 and not test_q & {r["quiz"] for r in splits["train"][3]}
    # without a test file the pool is split
    splits = data.kk_splits([3], train_per_n=100, test_per_n=2, sources=[str(src / "train")])
    assert len(splits["test"][3]) == 2 and len(splits["train"][3]) == 4


# --------------------------------------------------------------------------------------------------
# From the mutation run (TESTING.md): messages in full, boundaries, and the text the generator writes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        ([(1, 0)], "not a K&K statement: (1, 0)"),
        ([5], "not a K&K statement: 5"),
        ([()], "not a K&K statement: ()"),
        ([("lying", True), ("lying", 0)], "lying takes one person index: ('lying', True)"),
        ([("lying", 0, 1), ("lying", 0)], "lying takes one person index: ('lying', 0, 1)"),
        ([("telling-truth", 2), ("lying", 0)], "person index 2 out of range for 2 people"),
        ([("not", ("lying", 0), ("lying", 0))], "'not' takes one operand: ('not', ('lying', 0), ('lying', 0))"),
        ([("->", ("lying", 0))], "'->' takes two operands: ('->', ('lying', 0))"),
        ([("and",)], "'and' needs operands: ('and',)"),
        ([("knight", 0)], "unknown operator 'knight'"),
        ([], "statements must be a non-empty sequence, one statement per person"),
        ("((", "cannot parse statements string: '(' was never closed (<unknown>, line 1)"),
        ([("lying", 0)] * (kk.MAX_PEOPLE + 1), f"{kk.MAX_PEOPLE + 1} people is more than the solver's limit of 20"),
    ],
)
def test_parse_statements_messages(bad, message):
    with pytest.raises(ValueError) as err:
        kk.parse_statements(bad)
    assert str(err.value) == message


def test_twenty_people_is_the_limit_not_past_it():
    assert len(kk.parse_statements([("lying", 0)] + [("telling-truth", 0)] * 19)) == 20
    rec = kk.generate(20, 0)
    assert rec["num_people"] == 20 and kk.solve(rec["statements"]) == [tuple(rec["solution"])]


def test_generate_messages():
    with pytest.raises(ValueError, match=r"^num_people must be in \[2, 20\], got 1$"):
        kk.generate(1, 0)
    with pytest.raises(RuntimeError, match="^no unique-solution puzzle found in 0 tries$"):
        kk.generate(3, 0, max_tries=0)


def test_generate_can_make_every_person_a_knight():
    # the all-knights assignment is bit 0 of the solution mask: a unique solution there is accepted too
    assert any(all(kk.generate(2, seed)["solution"]) for seed in range(40))


def test_random_statements_follow_the_documented_mix():
    # weights (leaf, not, and, or, ->, <=>) = (2, 1, 3, 3, 2, 2) / 13, written here; 13,000 draws, fixed seed
    rng = random.Random(0)
    draws = [kk._random_statement(4, rng) for _ in range(13_000)]
    kind = ["leaf" if s[0] in ("telling-truth", "lying") else s[0] for s in draws]
    for op, weight in zip(("leaf", "not", "and", "or", "->", "<=>"), (2, 1, 3, 3, 2, 2)):
        assert abs(kind.count(op) / len(kind) - weight / 13) < 0.012, op
    assert all(s[1] != s[2] for s in draws if s[0] in ("and", "or", "->", "<=>"))  # two different leaves


class _FirstChoice:
    def choice(self, seq):
        return seq[0]


def test_quiz_text_in_full():
    statements = (("lying", 1), ("and", ("telling-truth", 0), ("lying", 2)), ("not", ("telling-truth", 1)))
    text = kk._quiz_text(["Alice", "Bruno", "Clara"], statements, _FirstChoice())
    assert text == (
        "Every inhabitant of a remote island is either a knight or a knave: knights always tell the truth "
        "and knaves always lie. You meet 3 inhabitants: Alice, Bruno, and Clara. "
        'Alice says: "Bruno is a knave." '
        'Bruno says: "Alice is a knight and Clara is a knave." '
        'Clara says: "It is false that Bruno is a knight." '
        "Which of them are knights and which are knaves?"
    )


def test_solution_text_in_full():
    assert kk._solution_text(["Alice", "Bruno", "Clara"], [True, False, True]) == (
        "Alice is a knight, Bruno is a knave, and Clara is a knight."
    )
    assert kk._solution_text(["Alice", "Bruno"], [False, True]) == "Alice is a knave and Bruno is a knight."


def test_answer_block_edges():
    assert kk.parse_answer("<answer>Alice is a knight</answer>", ["Alice"]) == [True]  # block at index 0
    # a stray <answer> after the last </answer> does not start the block
    assert kk.parse_answer("<answer>Alice is a knight</answer> <answer>", ["Alice"]) == [True]


def test_parse_solution_text_skips_blank_lines():
    assert kk.parse_solution_text("(1) Alice is a knight\n\n  \n(2) Bruno is a knave\n") == (
        ["Alice", "Bruno"],
        [True, False],
    )


def test_type_and_label_messages():
    with pytest.raises(TypeError, match="^response must be str, got int$"):
        kk.format_ok(5)
    with pytest.raises(TypeError, match="^response must be str, got bytes$"):
        kk.parse_answer(b"<answer></answer>", ["Alice"])
    with pytest.raises(TypeError, match="^label must be str, got int$"):
        kk.parse_solution_text(5)
    with pytest.raises(ValueError, match="^empty K&K label$"):
        kk.parse_solution_text("\n \n")
    with pytest.raises(ValueError, match="^cannot read label line 'Alice knight'$"):
        kk.parse_solution_text("Alice knight")


def test_load_public_normalises_and_keeps_a_stored_label(tmp_path):
    label = "(1) Ann is a knight\n(2) 7 is a knave\n"  # stored as given (trailing newline), not rebuilt
    row = {"quiz": "q", "names": ["Ann", 7], "solution": [1, 0], "solution_text_format": label}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (rec,) = kk.load_public(path)
    assert rec["names"] == ["Ann", "7"]
    assert rec["solution"] == [True, False] and all(type(s) is bool for s in rec["solution"])
    assert rec["solution_text_format"] == "(1) Ann is a knight\n(2) 7 is a knave\n"
    assert rec["num_people"] == 2


@pytest.mark.parametrize(
    "row, verify, message",
    [
        (
            {"quiz": "q", "names": ["A"]},
            False,
            "line 1: missing keys ['solution']; a public K&K row has quiz, names, solution, statements",
        ),
        ({"quiz": "q", "names": ["A", "B"], "solution": [True]}, False, "line 1: 2 names but 1 roles"),
        ({"quiz": "q", "names": ["A"], "solution": [True]}, True, "line 1: cannot verify without statements"),
        (
            {"quiz": "q", "names": ["A"], "solution": [True], "statements": "(('lying', 0),)"},
            True,
            "line 1: statements have 0 solutions, not the stored one",
        ),
    ],
)
def test_load_public_messages(tmp_path, row, verify, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError) as err:
        kk.load_public(path, verify=verify)
    assert str(err.value) == f"{path} {message}"


def test_a_label_line_with_two_people_is_refused_not_read_as_one():
    """The public solution_text ("Alice is a knight, and Bruno is a knave.") on one line was read as Alice alone,
    so a response wrong about Bruno scored +2."""
    prompt = "Alice and Bruno live on an island."
    wrong_about_bruno = "<think>r</think><answer>(1) Alice is a knight\n(2) Bruno is a knight</answer>"
    for label in ("Alice is a knight, and Bruno is a knave.", "(1) Alice is a knight (2) Bruno is a knave"):
        with pytest.raises(ValueError, match="holds more than one person; one '\\(k\\) Name is a knight' per line"):
            kk.reward(prompt + wrong_about_bruno, label)
    assert kk.reward(wrong_about_bruno, "(1) Alice is a knight\n(2) Bruno is a knave") == -0.5


def test_load_public_reads_roles_written_as_strings_and_refuses_others(tmp_path):
    """Some exports write the roles as "True" / "False": bool("False") made every such person a knight."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"quiz": "q", "names": ["A", "B", "C"], "solution": ["True", "False", "true"]}) + "\n")
    (rec,) = kk.load_public(path)
    assert rec["solution"] == [True, False, True]
    assert rec["solution_text_format"] == "(1) A is a knight\n(2) B is a knave\n(3) C is a knight"
    for role in ("knave", 2, None):
        path.write_text(json.dumps({"quiz": "q", "names": ["A"], "solution": [role]}) + "\n")
        with pytest.raises(ValueError, match=re.escape(f"{path} line 1: a role in 'solution' is {role!r}; each must")):
            kk.load_public(path)
