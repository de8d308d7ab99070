"""Knights and Knaves (K&K) logic puzzles: statements, solver, generator, prompt and the paper's reward.

Statement encoding (the public K&K dataset of Xie et al. 2024, also used by Logic-RL and the paper):
person indices are 0-based and a statement is a nested tuple

    ('telling-truth', i)   person i is a knight        ('lying', i)   person i is a knave
    ('not', s)             ('and', s1, s2, ...)        ('or', s1, s2, ...)
    ('->', s1, s2)         ('<=>', s1, s2)

A puzzle is one statement per person; person i is a knight exactly when their statement is true.
The public files store the tuple of statements as its Python repr string; `solve` takes either form
(and JSON lists, which is what tuples become after a JSON round trip).

Reward (paper Table 4, the Logic-RL rule), on the model's response only:

    format  +1  exactly one each of <think>, </think>, <answer>, </answer>, in that order; else -1
    answer  +2  every person's role right; -1.5 every person has exactly one role but some are wrong;
            -2  the answer does not parse (a person with zero or several roles, empty answer) or the
                format is wrong
    reward = format + answer, in [-3, 3]

An answer line counts when it reads "<Name> is a knight" or "<Name> is a knave" (case-insensitive,
any whitespace between the words), as in Logic-RL.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from openrlhf_lopti.errors import UserError
from openrlhf_lopti.tasks import load_rows, messages_to_text

__all__ = [
    "MAX_PEOPLE",
    "NAMES",
    "answer_ok",
    "format_ok",
    "generate",
    "load_public",
    "make_prompt",
    "parse_answer",
    "parse_solution_text",
    "parse_statements",
    "prompt_text",
    "render_statement",
    "reward",
    "reward_parts",
    "solution_text_format",
    "solve",
]

# The solver enumerates all 2**n assignments as bits of one Python int; 2**20 bits is 128 KiB per operand.
MAX_PEOPLE = 20

# Our own pool of first names: distinct, single ASCII words, none of them an everyday English word.
NAMES: tuple[str, ...] = (
    "Alice", "Bruno", "Clara", "Dmitri", "Elena", "Felix", "Greta", "Hugo",
    "Ingrid", "Jonas", "Kira", "Leon", "Mira", "Nadia", "Oscar", "Priya",
    "Quentin", "Rosa", "Stefan", "Tara", "Ulrich", "Vera", "Walter", "Xenia",
    "Yusuf", "Zara", "Amir", "Bianca", "Caleb", "Daria", "Emil", "Fiona",
    "Gideon", "Hana", "Ivan", "Julia", "Kofi", "Lena", "Marco", "Nora",
    "Omar", "Paula", "Rafael", "Sofia", "Tomas", "Uma", "Victor", "Wanda",
    "Yara", "Zoltan", "Anton", "Beatrix", "Cyrus", "Delia", "Elias", "Freya",
    "Gustav", "Helga", "Isidor", "Jasper", "Katya", "Lucas", "Magnus", "Nina",
)  # fmt: skip

_LEAVES = ("telling-truth", "lying")
_BINARY = ("->", "<=>")
_NARY = ("and", "or")

Statement = tuple  # nested tuple, see the module docstring


# --------------------------------------------------------------------------------------------------
# Statements and solver
# --------------------------------------------------------------------------------------------------


def _normalize(node: Any, num_people: int) -> Statement:
    """Check one statement against the grammar and return it as nested tuples."""
    if not isinstance(node, (tuple, list)) or not node or not isinstance(node[0], str):
        raise ValueError(f"not a K&K statement: {node!r}")
    op, args = node[0], node[1:]
    if op in _LEAVES:
        if len(args) != 1 or isinstance(args[0], bool) or not isinstance(args[0], int):
            raise ValueError(f"{op} takes one person index: {node!r}")
        if not 0 <= args[0] < num_people:
            raise ValueError(f"person index {args[0]} out of range for {num_people} people")
        return (op, args[0])
    if op == "not":
        if len(args) != 1:
            raise ValueError(f"'not' takes one operand: {node!r}")
    elif op in _BINARY:
        if len(args) != 2:
            raise ValueError(f"{op!r} takes two operands: {node!r}")
    elif op in _NARY:
        if len(args) < 1:
            raise ValueError(f"{op!r} needs operands: {node!r}")
    else:
        raise ValueError(f"unknown operator {op!r}")
    return (op, *(_normalize(a, num_people) for a in args))


def parse_statements(statements: Any) -> tuple[Statement, ...]:
    """Return the puzzle's statements as a tuple of nested tuples, validated.

    Accepts nested tuples, nested lists (JSON) or the repr string stored in the public files.
    Raises ValueError on anything else.
    """
    if isinstance(statements, str):
        try:
            # literal_eval only builds literals: safe on untrusted text, unlike eval.
            statements = ast.literal_eval(statements.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
            raise ValueError(f"cannot parse statements string: {e}") from None
    if not isinstance(statements, (tuple, list)) or not statements:
        raise ValueError("statements must be a non-empty sequence, one statement per person")
    n = len(statements)
    if n > MAX_PEOPLE:
        raise ValueError(f"{n} people is more than the solver's limit of {MAX_PEOPLE}")
    return tuple(_normalize(s, n) for s in statements)


def _person_masks(n: int) -> list[int]:
    """Bit k of masks[i] is set when person i is a knight in assignment k.

    Assignment k follows itertools.product([True, False], repeat=n): person i is a knight when bit
    (n - 1 - i) of k is 0, so solutions come out in the public code's enumeration order.
    """
    total = 1 << n
    masks = []
    for i in range(n):
        run = 1 << (n - 1 - i)  # length of each block of equal values for person i
        m, length = (1 << run) - 1, 2 * run
        while length < total:  # repeat the (ones, zeros) block by doubling
            m |= m << length
            length *= 2
        masks.append(m)
    return masks


def _truth_mask(node: Statement, masks: list[int], full: int) -> int:
    """Set of assignments (as a bit mask) in which the statement is true."""
    op = node[0]
    if op == "telling-truth":
        return masks[node[1]]
    if op == "lying":
        return full ^ masks[node[1]]
    vals = [_truth_mask(a, masks, full) for a in node[1:]]
    if op == "not":
        return full ^ vals[0]
    if op == "and":
        out = full
        for v in vals:
            out &= v
        return out
    if op == "or":
        out = 0
        for v in vals:
            out |= v
        return out
    if op == "->":
        return (full ^ vals[0]) | vals[1]
    return full ^ (vals[0] ^ vals[1])  # '<=>'


def _solution_mask(statements: tuple[Statement, ...]) -> tuple[int, int]:
    n = len(statements)
    masks = _person_masks(n)
    full = (1 << (1 << n)) - 1
    ok = full
    for i, s in enumerate(statements):
        ok &= full ^ (masks[i] ^ _truth_mask(s, masks, full))  # knight_i <=> statement_i
    return ok, n


def solve(statements: Any) -> list[tuple[bool, ...]]:
    """Every assignment (True = knight) satisfying all statements, by brute force over 2**n.

    `statements` may be nested tuples, nested lists or the public files' repr string.
    The order is that of itertools.product([True, False], repeat=n).
    """
    ok, n = _solution_mask(parse_statements(statements))
    out = []
    while ok:
        low = ok & -ok
        k = low.bit_length() - 1
        out.append(tuple(not (k >> (n - 1 - i)) & 1 for i in range(n)))
        ok ^= low
    return out


# --------------------------------------------------------------------------------------------------
# Natural language and generation
# --------------------------------------------------------------------------------------------------


def _join(parts: Sequence[str], word: str) -> str:
    if len(parts) <= 2:
        return f" {word} ".join(parts)
    return ", ".join(parts[:-1]) + f", {word} " + parts[-1]


def render_statement(node: Statement, names: Sequence[str]) -> str:
    """English reading of one statement (operands of a depth-2 statement are always leaves)."""
    op = node[0]
    if op == "telling-truth":
        return f"{names[node[1]]} is a knight"
    if op == "lying":
        return f"{names[node[1]]} is a knave"
    parts = [render_statement(a, names) for a in node[1:]]
    if op == "not":
        return f"it is false that {parts[0]}"
    if op in _NARY:
        return _join(parts, op)
    if op == "->":
        return f"if {parts[0]} then {parts[1]}"
    return f"{parts[0]} if and only if {parts[1]}"


_SPEECH = (
    '{name} says: "{s}."',
    '{name} claims: "{s}."',
    '{name} states: "{s}."',
    'According to {name}, "{s}."',
    '{name} tells you: "{s}."',
)


def _quiz_text(names: Sequence[str], statements: Sequence[Statement], rng: random.Random) -> str:
    lines = [
        "Every inhabitant of a remote island is either a knight or a knave: knights always tell the truth "
        "and knaves always lie.",
        f"You meet {len(names)} inhabitants: {_join(list(names), 'and')}.",
    ]
    for name, st in zip(names, statements):
        s = render_statement(st, names)
        lines.append(rng.choice(_SPEECH).format(name=name, s=s[0].upper() + s[1:]))
    lines.append("Which of them are knights and which are knaves?")
    return " ".join(lines)


def _random_leaf(n: int, rng: random.Random) -> Statement:
    return (rng.choice(_LEAVES), rng.randrange(n))


def _random_statement(n: int, rng: random.Random) -> Statement:
    """One statement of depth at most 2 and width 2, the public dataset's default shape."""
    op = rng.choices(("leaf", "not", "and", "or", "->", "<=>"), weights=(2, 1, 3, 3, 2, 2))[0]
    if op == "leaf":
        return _random_leaf(n, rng)
    if op == "not":
        return ("not", _random_leaf(n, rng))
    a = _random_leaf(n, rng)
    b = _random_leaf(n, rng)
    while b == a:  # "X is a knight and X is a knight" says nothing new
        b = _random_leaf(n, rng)
    return (op, a, b)


def solution_text_format(names: Sequence[str], solution: Sequence[bool]) -> str:
    """'(1) Name is a knight\\n(2) Name is a knave ...', the label format of the public files."""
    return "\n".join(
        f"({i + 1}) {name} is a {'knight' if knight else 'knave'}"
        for i, (name, knight) in enumerate(zip(names, solution))
    )


def _solution_text(names: Sequence[str], solution: Sequence[bool]) -> str:
    parts = [f"{name} is a {'knight' if k else 'knave'}" for name, k in zip(names, solution)]
    return _join(parts, "and") + "."


def generate(num_people: int, seed: int, *, max_tries: int = 100_000) -> dict:
    """A random puzzle with exactly one solution, deterministic in (num_people, seed).

    Returns a record shaped like the public files: `quiz` (text), `names`, `statements` (repr string of
    the nested tuples), `solution` (list of bools, True = knight), `solution_text` and
    `solution_text_format`, plus `num_people`.
    """
    if not 2 <= num_people <= min(MAX_PEOPLE, len(NAMES)):
        raise ValueError(f"num_people must be in [2, {min(MAX_PEOPLE, len(NAMES))}], got {num_people}")
    # A string seed hashes the same in every process (unlike tuple hashing under PYTHONHASHSEED).
    rng = random.Random(f"kk-{num_people}-{seed}")
    names = rng.sample(NAMES, num_people)
    for _ in range(max_tries):
        statements = tuple(_random_statement(num_people, rng) for _ in range(num_people))
        ok, _ = _solution_mask(statements)
        if ok and ok & (ok - 1) == 0:  # exactly one bit set: a unique solution
            break
    else:  # pragma: no cover - uniqueness has probability around 1/3 per try
        raise RuntimeError(f"no unique-solution puzzle found in {max_tries} tries")
    (solution,) = solve(statements)
    return {
        "quiz": _quiz_text(names, statements, rng),
        "names": names,
        "statements": repr(statements),
        "solution": list(solution),
        "solution_text": _solution_text(names, solution),
        "solution_text_format": solution_text_format(names, solution),
        "num_people": num_people,
    }


# --------------------------------------------------------------------------------------------------
# Prompt
# --------------------------------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You solve logic puzzles. First reason about the puzzle inside <think> </think> tags, then give "
    "your final answer inside <answer> </answer> tags. In the answer, write one line per person, "
    "numbered in the order the puzzle introduces them, saying whether that person is a knight or a "
    "knave, for example:\n"
    "<answer>\n(1) Alice is a knight\n(2) Bruno is a knave\n</answer>"
)


def make_prompt(record: dict) -> list[dict]:
    """Chat messages (system + user) for one puzzle record; the user turn is the quiz text."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": record["quiz"]},
    ]


def prompt_text(record: dict) -> str:
    """The same prompt as plain text, for models without a chat template."""
    return messages_to_text(make_prompt(record))


# --------------------------------------------------------------------------------------------------
# Answer parsing and reward
# --------------------------------------------------------------------------------------------------

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_LABEL_LINE = re.compile(r"^\s*(?:\(\d+\)\s*)?(\S.*?)\s+is\s+an?\s+(knight|knave)\b", re.IGNORECASE)
_CLAIM = re.compile(r"\bis\s+an?\s+(?:knight|knave)\b", re.IGNORECASE)


def format_ok(response: str) -> bool:
    """Exactly one of each tag, in the order <think> </think> <answer> </answer>."""
    if not isinstance(response, str):
        raise TypeError(f"response must be str, got {type(response).__name__}")
    pos = []
    for tag in _TAGS:
        if response.count(tag) != 1:  # str.count: linear, no regex
            return False
        pos.append(response.find(tag))
    return pos[0] < pos[1] < pos[2] < pos[3]


def parse_solution_text(solution_text: str) -> tuple[list[str], list[bool]]:
    """Names and roles (True = knight) from a '(1) Name is a knight' label, one person per line."""
    if not isinstance(solution_text, str):
        raise TypeError(f"label must be str, got {type(solution_text).__name__}")
    names, roles = [], []
    for line in solution_text.splitlines():
        if not line.strip():
            continue
        m = _LABEL_LINE.match(line)
        if m is None:
            raise ValueError(f"cannot read label line {line!r}")
        if len(_CLAIM.findall(line)) > 1:  # "Alice is a knight, and Bruno is a knave.": only Alice would be read
            raise ValueError(f"label line {line!r} holds more than one person; one '(k) Name is a knight' per line")
        names.append(m.group(1).strip())
        roles.append(m.group(2).lower() == "knight")
    if not names:
        raise ValueError("empty K&K label")
    return names, roles


def _answer_block(response: str) -> str | None:
    """Content of the last <answer>...</answer> block, found with two linear rfind calls."""
    end = response.rfind("</answer>")
    if end < 0:
        return None
    start = response.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return response[start + len("<answer>") : end]


def _name_pattern(name: str) -> re.Pattern:
    # Lookarounds instead of \b so names ending in punctuation still work; \s+ runs cannot backtrack
    # into each other because they are separated by literal words.
    return re.compile(rf"(?<!\w){re.escape(name)}(?!\w)\s+is\s+a\s+(knight|knave)(?!\w)", re.IGNORECASE)


def _roles_in(text: str, names: Sequence[str]) -> list[bool | None]:
    out: list[bool | None] = []
    for name in names:
        found = [m.group(1).lower() == "knight" for m in islice(_name_pattern(name).finditer(text), 2)]
        out.append(found[0] if len(found) == 1 else None)  # zero or several claims: unparsed
    return out


def parse_answer(response: str, names: Sequence[str]) -> list[bool | None] | None:
    """Roles read from the last <answer> block: per person True (knight), False (knave) or None.

    A person gets None unless exactly one "<Name> is a knight|knave" phrase names them (the Logic-RL
    rule). Returns None when the response has no complete <answer>...</answer> block.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be str, got {type(response).__name__}")
    block = _answer_block(response)
    if block is None:
        return None
    return _roles_in(block, names)


def answer_ok(response: str, solution_text: str) -> bool:
    """True when the response gets the full answer score (+2): valid format and every role right."""
    return reward_parts(response, solution_text)[1] == 2.0


def reward_parts(response: str, solution_text_format: str) -> tuple[float, float]:
    """(format score, answer score) of the paper's rule; see the module docstring."""
    names, truth = parse_solution_text(solution_text_format)  # first, so a bad label always raises
    if not format_ok(response):
        return -1.0, -2.0
    block = _answer_block(response)
    if block is None or not block.strip():
        return 1.0, -2.0
    pred = _roles_in(block, names)
    if any(p is None for p in pred):
        return 1.0, -2.0
    return 1.0, (2.0 if pred == truth else -1.5)


def reward(response: str, solution_text_format: str) -> float:
    """Paper Table 4 reward (format + answer, in [-3, 3]) of a model response against the label."""
    fmt, ans = reward_parts(response, solution_text_format)
    return fmt + ans


# --------------------------------------------------------------------------------------------------
# Public data files
# --------------------------------------------------------------------------------------------------


def _role(value, at: str) -> bool:
    """A stored role as a bool (True = knight): a bool, 0 / 1, or the strings "true" / "false" (any case) that some
    exports write; bool("False") would be True."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) == "bool" or value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise UserError(f"{at}: a role in 'solution' is {value!r}; each must be true / false (knight / knave)")


def load_public(path: str | Path, *, verify: bool = False) -> list[dict]:
    """Records of a public K&K file (jsonl, json list or parquet), normalised.

    Each record keeps the public keys (`quiz`, `names`, `statements`, `solution`,
    `solution_text_format`, ...), with `solution` as a list of bools, `solution_text_format` rebuilt
    from names and solution if missing, and `num_people` added. With `verify=True`, raise ValueError
    unless the statements have exactly the stored solution.
    """
    path = Path(path)
    out = []
    rows, where = load_rows(path)
    for row, at in zip(rows, where):
        missing = [k for k in ("quiz", "names", "solution") if k not in row]
        if missing:
            raise UserError(f"{at}: missing keys {missing}; a public K&K row has quiz, names, solution, statements")
        rec = dict(row)
        rec["names"] = [str(n) for n in rec["names"]]
        rec["solution"] = [_role(s, at) for s in rec["solution"]]
        if len(rec["names"]) != len(rec["solution"]):
            raise UserError(f"{at}: {len(rec['names'])} names but {len(rec['solution'])} roles")
        if not rec.get("solution_text_format"):
            rec["solution_text_format"] = solution_text_format(rec["names"], rec["solution"])
        rec["num_people"] = len(rec["names"])
        if verify:
            if "statements" not in rec:
                raise UserError(f"{at}: cannot verify without statements")
            sols = solve(rec["statements"])
            if sols != [tuple(rec["solution"])]:
                raise UserError(f"{at}: statements have {len(sols)} solutions, not the stored one")
        out.append(rec)
    return out
