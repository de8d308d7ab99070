r"""Math task: final-answer extraction, answer equivalence and the paper's binary reward.

reward(response, answer) = 1.0 when the last \boxed{...} (or \fbox{...}) of the response is equivalent to
the ground-truth answer, else 0.0 (paper Sec. 5.2: DeepScaleR-style rule, no format term).

Equivalence, tried in order (the first that decides wins):
1. identical after LaTeX normalisation (`normalize`: \left/\right, \dfrac, \text{..}, units, degrees,
   percent, "x = " prefixes, thousands separators, \frac12, spacing, ...);
2. both are numbers (integers, decimals, a/b, \frac{a}{b}): exact rational comparison;
3. both are comma lists of the same kind: item by item (tuples and intervals in order, sets and bare
   lists in any order);
4. both are words ("Yes", "none"): case-insensitive comparison;
5. both are short algebraic expressions: parsed with sympy (on a whitelist of characters and names, so
   nothing the model writes can run as code or blow up) and compared numerically at fixed points.
"""

from __future__ import annotations

import re
from fractions import Fraction

from openrlhf_lopti.tasks import messages_to_text

__all__ = ["SYSTEM_PROMPT", "is_equiv", "last_boxed", "make_prompt", "normalize", "prompt_text", "reward"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# Beyond this many characters an answer is compared as a plain string only (keeps the reward linear).
_MAX_NORMALIZE_CHARS = 2000
_MAX_SYMPY_CHARS = 150


# --------------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------------


def _braced(text: str, i: int) -> tuple[str, int] | None:
    """Content of the brace group opening at text[i] == '{' and the index after it; None if unclosed."""
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j], j + 1
    return None


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} / \fbox{...} (nested braces allowed), or None.

    Also reads the brace-less form "\boxed 42". Linear in len(text): one rfind per command and one scan.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    best, cmd = -1, ""
    for c in _BOX_COMMANDS:
        i = text.rfind(c)
        if i > best:
            best, cmd = i, c
    if best < 0:
        return None
    j = best + len(cmd)
    if j < len(text) and text[j] == "{":
        got = _braced(text, j)
        return got[0] if got else None  # an unclosed box (truncated response) has no answer
    if j < len(text) and text[j] == " ":
        m = re.match(r" +([^\s$]+)", text[j : j + 200])
        return m.group(1) if m else None
    return None


# --------------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------------

_DROP = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "\\ ")
_SPACES = ("\\,", "\\;", "\\:", "\\quad", "\\qquad", "\\ ")  # of _DROP, those that stand for a space
_TEXT_CMDS = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}")
_UNIT_SUFFIX = re.compile(
    r"([-+]?[\d.,]+(?:/\d+)?)\s+(?!(?:pi|sqrt|and|or|i)\b)[a-zA-Z]{2,}(?:\s+[a-zA-Z]+)*\.?"
)
_VAR_PREFIX = re.compile(r"[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?\s*=\s*(.+)", re.DOTALL)


def normalize(answer: str) -> str:
    """Canonical string form of a final answer (LaTeX clean-up; see the module docstring)."""
    s = answer.strip()
    if len(s) > _MAX_NORMALIZE_CHARS:
        return re.sub(r"\s+", "", s)
    if "\\boxed" in s or "\\fbox" in s:  # a ground truth written as \boxed{..}
        s = last_boxed(s) or s
    s = s.replace("\n", " ").replace("\u2212", "-")  # newlines; unicode minus
    for a, b in (("\\[", ""), ("\\]", ""), ("\\(", ""), ("\\)", "")):
        s = s.replace(a, b)
    s = s.strip().strip("$").strip()
    for token in _DROP:
        s = s.replace(token, " " if token in _SPACES else "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _TEXT_CMDS.sub(r"\1", s)
    for token in ("^\\circ", "^{\\circ}", "\\circ", "°", "\\%", "%", "\\$"):
        s = s.replace(token, "")
    s = s.strip().rstrip(".").strip()
    m = _UNIT_SUFFIX.fullmatch(s)  # "5 cm" -> "5" (a unit needs a space: "5x" stays)
    if m:
        s = m.group(1)
    m = _VAR_PREFIX.fullmatch(s)  # "x = 5" -> "5"
    if m and "=" not in m.group(1):
        s = m.group(1)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d|[a-zA-Z](?![a-zA-Z]))", r"\\sqrt{\1}", s)
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # 1,000 -> 1000
        s = s.replace(",", "")
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)  # .5 -> 0.5
    m = re.fullmatch(r"\(([A-Ea-e])\)", s)  # multiple choice "(C)" -> "C"
    if m:
        s = m.group(1)
    return s


# --------------------------------------------------------------------------------------------------
# Equivalence
# --------------------------------------------------------------------------------------------------


def _number(s: str) -> Fraction | None:
    try:
        if re.fullmatch(r"[-+]?(?:\d+\.?\d*|\.\d+)", s):
            return Fraction(s.rstrip(".") if s.endswith(".") else s)
        m = re.fullmatch(r"([-+]?\d+)/([-+]?\d+)", s)
        if m:
            return Fraction(int(m.group(1)), int(m.group(2)))
        m = re.fullmatch(r"([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}", s)
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) == "-" else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


_OPENERS = {"(": ")", "[": "]", "\\{": "\\}"}


def _split_list(s: str) -> tuple[str, list[str]] | None:
    """('kind', items) for a comma list at brace depth 0, kind being its brackets or '' for bare."""
    kind, body = "", s
    for op, cl in _OPENERS.items():
        if s.startswith(op) and len(s) > len(op) + 1:
            # intervals may mix brackets: "[1,2)"; sets must close with \}
            closers = ("\\}",) if op == "\\{" else (")", "]")
            for c in closers:
                if s.endswith(c):
                    kind, body = s[: len(op)] + s[-len(c) :], s[len(op) : -len(c)]
            break
    items, depth, start = [], 0, 0
    for i, c in enumerate(body):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    if len(items) < 2 and not kind.startswith("\\{"):
        return None
    return kind, items


def _lists_equal(a: tuple[str, list[str]], b: tuple[str, list[str]], depth: int) -> bool:
    (ka, ia), (kb, ib) = a, b
    if ka != kb or len(ia) != len(ib) or len(ia) > 20:
        return False
    if ka in ("", "\\{\\}"):  # sets and bare lists ("x = 1, 2"): any order
        left = list(ib)
        for x in ia:
            hit = next((k for k, y in enumerate(left) if _equiv(x, y, depth + 1)), None)
            if hit is None:
                return False
            left.pop(hit)
        return True
    return all(_equiv(x, y, depth + 1) for x, y in zip(ia, ib))


_FUNCS = ("sqrt", "pi", "log", "sin", "cos", "tan", "exp")
_LATEX_WORDS = {
    "\\cdot": "*", "\\times": "*", "\\div": "/", "\\pi": " pi ", "\\ln": " log ", "\\log": " log ",
    "\\sin": " sin ", "\\cos": " cos ", "\\tan": " tan ", "\\exp": " exp ",
}  # fmt: skip
_SAFE_CHARS = re.compile(r"[0-9a-zA-Z+\-*/(). ]*")
_EXPONENT_OK = re.compile(
    r"\s*(?:-?\d{1,3}(?!\d)|[a-zA-Z](?![a-zA-Z(])|\(\s*-?(?:\d{1,3}\s*(?:/\s*\d{1,3}\s*)?|[a-zA-Z]\s*)\))"
)


def _replace_command(s: str, cmd: str, nargs: int, fmt: str) -> str | None:
    r"""Rewrite every `cmd{a}{b}` into fmt.format(a, b); None if an argument is not braced."""
    while (i := s.find(cmd)) >= 0:
        j, args = i + len(cmd), []
        for _ in range(nargs):
            got = _braced(s, j) if j < len(s) and s[j] == "{" else None
            if got is None:
                return None
            args.append(got[0])
            j = got[1]
        s = s[:i] + fmt.format(*args) + s[j:]
    return s


def _split_identifiers(m: re.Match) -> str:
    """'xsqrt' -> ' x sqrt ': keep known function names, split other letter runs into symbols."""
    run, out, i = m.group(0), [], 0
    while i < len(run):
        name = next((f for f in _FUNCS if run.startswith(f, i)), None)
        out.append(name or run[i])
        i += len(name) if name else 1
    return " " + " ".join(out) + " "


def _sympy_text(s: str) -> str | None:
    """A normalised LaTeX answer as text sympy can parse safely, or None when unsupported."""
    if len(s) > _MAX_SYMPY_CHARS or re.search(r"\d{21}", s):
        return None
    s = re.sub(r"\\sqrt\[([^\[\]]*)\]\{", r"\\root{\1}{", s)
    for cmd, nargs, fmt in (("\\frac", 2, "(({})/({}))"), ("\\root", 2, "(({1})**(1/{0}))"), ("\\sqrt", 1, "sqrt({})")):
        s = _replace_command(s, cmd, nargs, fmt)
        if s is None:
            return None
    for word, repl in _LATEX_WORDS.items():
        s = s.replace(word, repl)
    s = s.replace("^", "**").replace("{", "(").replace("}", ")")
    # No backslash, quote, underscore, bracket, comma or '=' survives: nothing but arithmetic.
    if not _SAFE_CHARS.fullmatch(s) or not s.strip():
        return None
    if re.search(r"(?<!\d)\.(?!\d)", s):  # a dot only inside numbers: no attribute access
        return None
    s = re.sub(r"[a-zA-Z]+", _split_identifiers, s)
    for m in re.finditer(r"\*\*", s):  # small, non-chained exponents only: 9**9**9 would hang
        e = _EXPONENT_OK.match(s, m.end())
        if e is None or s[e.end() :].lstrip().startswith("**"):
            return None
    return s


def _sympy_equal(a: str, b: str) -> bool | None:
    """Numeric comparison of two expressions at fixed points; None when either cannot be parsed."""
    ta, tb = _sympy_text(a), _sympy_text(b)
    if ta is None or tb is None:
        return None
    try:
        import sympy
        from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations
    except ImportError:  # pragma: no cover - sympy ships with torch
        return None
    names = {f: getattr(sympy, f) for f in _FUNCS}
    names.update(Integer=sympy.Integer, Float=sympy.Float, Rational=sympy.Rational, Symbol=sympy.Symbol)
    names["__builtins__"] = {}
    letters = {c: sympy.Symbol(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    transforms = standard_transformations + (implicit_multiplication,)
    try:
        ea = parse_expr(ta, local_dict=dict(letters), global_dict=dict(names), transformations=transforms)
        eb = parse_expr(tb, local_dict=dict(letters), global_dict=dict(names), transformations=transforms)
        symbols = sorted(ea.free_symbols | eb.free_symbols, key=str)
        if len(symbols) > 6:
            return None
        # Distinct values per symbol (so x and y never coincide), three points for identities.
        primes = (13, 17, 19, 23, 29, 31, 37, 41)
        points = [
            {s: sympy.Rational(primes[(k + t) % 8], 7 + 2 * k + t) for k, s in enumerate(symbols)}
            for t in range(3 if symbols else 1)
        ]
        checked = 0
        for pt in points:
            va, vb = complex(ea.subs(pt).evalf(30)), complex(eb.subs(pt).evalf(30))
            if va != va or vb != vb or abs(va) == float("inf") or abs(vb) == float("inf"):
                continue  # a pole or NaN at this point says nothing
            if abs(va - vb) > 1e-9 * max(1.0, abs(va), abs(vb)):
                return False
            checked += 1
        return True if checked else None
    except Exception:  # sympy raises many types on odd input; any failure means "cannot tell"
        return None


def _equiv(pred: str, truth: str, depth: int = 0) -> bool:
    a, b = normalize(pred), normalize(truth)
    if a == b:
        return True
    if not a or not b or depth > 2 or max(len(a), len(b)) > _MAX_NORMALIZE_CHARS:
        return False
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None:
        return na == nb
    la, lb = _split_list(a), _split_list(b)
    if la is not None or lb is not None:
        return la is not None and lb is not None and _lists_equal(la, lb, depth)
    if re.fullmatch(r"[A-Za-z]{2,}", a) and re.fullmatch(r"[A-Za-z]{2,}", b):  # words, not products
        return a.casefold() == b.casefold()
    return bool(_sympy_equal(a, b))


def is_equiv(pred: str | None, truth: str) -> bool:
    """Whether a predicted final answer (None: no answer found) is equivalent to the ground truth."""
    if pred is None:
        return False
    if not isinstance(pred, str) or not isinstance(truth, str):
        raise TypeError("answers must be str")
    return _equiv(pred, truth)


def reward(response: str, answer: str) -> float:
    r"""Binary reward: 1.0 when the response's last \boxed{} is equivalent to `answer`, else 0.0."""
    return 1.0 if is_equiv(last_boxed(response), answer) else 0.0


# --------------------------------------------------------------------------------------------------
# Prompt
# --------------------------------------------------------------------------------------------------

SYSTEM_PROMPT = "Solve the math problem. Reason step by step, then write only the final answer inside \\boxed{}."


def make_prompt(problem: str) -> list[dict]:
    """Chat messages for one problem (the instruction rides in the user turn, as most math RL sets do)."""
    return [{"role": "user", "content": f"{problem}\n\n{SYSTEM_PROMPT}"}]


def prompt_text(problem: str) -> str:
    """The same prompt as plain text, for models without a chat template."""
    return messages_to_text(make_prompt(problem))
