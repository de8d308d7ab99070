r"""Math task: final-answer extraction, answer equivalence and the paper's binary reward.

reward(response, answer) = 1.0 when the last \boxed{...} (or \fbox{...}) of the response is equivalent to
the ground-truth answer, else 0.0 (paper Sec. 5.2: DeepScaleR-style rule, no format term).

Equivalence, tried in order (the first that decides wins):
1. identical after LaTeX normalisation (`normalize`: \left/\right, \dfrac, \text{..}, units, degrees,
   percent, "x = " and "x \in " prefixes, lists in words ("3 and 4" -> 3,4), thousands separators (1,000,
   1{,}000), \frac12, spacing, mixed numbers (3\frac12 -> \frac{7}{2}), magnitude words (5 million -> 5000000;
   never stripped as a unit), ...);
2. both are numbers (integers, decimals, scientific notation 1e3, a/b, \frac{a}{b}): exact rational comparison;
3. both are comma lists of the same kind: item by item (tuples and intervals in order, sets and bare
   lists in any order);
4. both are words ("Yes", "none"): case-insensitive comparison;
5. both are short algebraic expressions: parsed with sympy (on a whitelist of characters and names, so
   nothing the model writes can run as code; and only after `_log_size` has bounded every number the
   expression builds: no nested power, exp of a power, ...), then computed at fixed points by `_value`
   (exact fractions, else mpmath at fixed precision; sympy's own evaluation can loop for ever) and
   compared numerically, so nothing can blow up.
"""

from __future__ import annotations

import re
from fractions import Fraction
from math import e as _E
from math import log10

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
# Magnitude words are numbers, not units: "5 million" is not 5 (nor "2 thousandths", "3 dozen").
_MAGNITUDES = {"hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12, "dozen": 12}
_MAGNITUDE_WORDS = "|".join(_MAGNITUDES)
_UNIT_SUFFIX = re.compile(
    r"([-+]?[\d.,]+(?:/\d+)?)\s+(?!(?:pi|sqrt|and|or|i)\b|(?:" + _MAGNITUDE_WORDS + r"))"
    r"[a-zA-Z]{2,}(?:\s+[a-zA-Z]+)*\.?"
)
# A unit written as text after the answer, the whole rest of it: 5\text{ m}, \frac{1}{2}\text{cm}, 6\text{ m}^2
# (MATH's rule: "\text{ " marks a unit). One letter counts only after a space ("\text{ m}"), never as \mathrm{e}.
_TEXT_UNIT = re.compile(
    r"(?<=[\w})\]])\s*\\(?:text|mathrm|mbox)\s*\{(?:\s+[a-zA-Z]|\s*[a-zA-Z]{2,})[a-zA-Z ]*\}(?:\^\{?[23]\}?)?\s*$"
)
_MAGNITUDE = re.compile(  # the trailing words are units; "5 hundred thousand" is left alone
    r"([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s*(" + _MAGNITUDE_WORDS + r")s?"
    r"(?:\s+(?!" + _MAGNITUDE_WORDS + r")[a-zA-Z]+)*\.?"
)
# A whole number then a proper fraction, the whole answer: MATH's "express as a mixed number". sympy would
# read 3\frac{1}{2} as the product 3/2; 2\sqrt{3}, 3\pi, 2\frac{x}{3} stay products.
_MIXED_NUMBER = re.compile(r"([-+]?)(\d+)\\frac\{(\d+)\}\{(\d+)\}")
# "x = 5", "x \in [1,2]" (not \infty)
_VAR_PREFIX = re.compile(r"[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?\s*(?:=|\\in(?![a-zA-Z]))\s*(.+)", re.DOTALL)
# "3 and 4", "1, 2, and 3": a list written in words (after \text{ and } lost its command)
_AND_LIST = re.compile(r"\s*,?\s+and\s+")


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
    s = _TEXT_UNIT.sub("", s)
    s = re.sub(r"(\\(?:text|mathrm|mbox)\s*\{\s*[a-zA-Z]{2,}\s*\})\^\{?[23]\}?", r"\1", s)  # \text{cm}^2: a unit
    s = _TEXT_CMDS.sub(r"\1", s)
    s = re.sub(r"(?<=\d)\{,\}(?=\d{3}(?!\d))", ",", s)  # 10{,}000: LaTeX's thousands separator (3{,}14 stays)
    for token in ("^\\circ", "^{\\circ}", "\\circ", "°", "\\%", "%", "\\$"):
        s = s.replace(token, "")
    s = s.strip().rstrip(".").strip()
    m = _VAR_PREFIX.fullmatch(s)  # "x = 5" -> "5" (first, so that "x = 5 cm" loses its unit too)
    if m and "=" not in m.group(1) and not re.search(r"\\in(?![a-zA-Z])", m.group(1)):
        s = m.group(1)
    m = _UNIT_SUFFIX.fullmatch(s)  # "5 cm" -> "5" (a unit needs a space: "5x" stays)
    if m:
        s = m.group(1)
    m = _MAGNITUDE.fullmatch(s)  # "5 million (people)" -> "5000000", "1.5 thousand" -> "1500"
    if m:
        value = Fraction(m.group(1).replace(",", "")) * _MAGNITUDES[m.group(2)]
        s = str(value)  # "p/q" when not whole ("1.25 hundred" is whole; "0.125 dozen" is 3/2)
    s = _AND_LIST.sub(",", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d|[a-zA-Z](?![a-zA-Z]))", r"\\sqrt{\1}", s)
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # 1,000 -> 1000
        s = s.replace(",", "")
    m = _MIXED_NUMBER.fullmatch(s)  # 3\frac{1}{2} -> \frac{7}{2}, -3\frac12 -> -\frac{7}{2}: whole + fraction
    if m and int(m.group(3)) < int(m.group(4)):
        whole, num, den = int(m.group(2)), int(m.group(3)), int(m.group(4))
        s = f"{'-' if m.group(1) == '-' else ''}\\frac{{{whole * den + num}}}{{{den}}}"
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
        if re.fullmatch(r"[-+]?" + _SCIENTIFIC.pattern, s):  # 1e3, 2.5E-4
            return Fraction(s)
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


_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+\.?\d*|\.\d+)[eE]([-+]?\d{1,3})(?![\d.])")
_FUNCS = ("sqrt", "pi", "log", "sin", "cos", "tan", "exp")
_LATEX_WORDS = {
    "\\cdot": "*", "\\times": "*", "\\div": "/", "\\pi": " pi ", "\\ln": " log ", "\\log": " log ",
    "\\sin": " sin ", "\\cos": " cos ", "\\tan": " tan ", "\\exp": " exp ",
}  # fmt: skip
_SAFE_CHARS = re.compile(r"[0-9a-zA-Z+\-*/(). ]*")
_EXPONENT_OK = re.compile(
    r"\s*(?:-?\d{1,3}(?!\d)|[a-zA-Z](?![a-zA-Z(])|\(\s*-?(?:\d{1,3}\s*(?:/\s*\d{1,3}\s*)?|[a-zA-Z]\s*)\))"
)


# The largest log10 size (max(|v|, 1/|v|): a fraction's numerator and denominator) of any number sympy may
# build. Past 1e308 the numeric comparison sees inf anyway, and sympy's sqrt, log or rational power of a
# 2000-digit integer takes seconds (it factors); 400 digits take milliseconds.
_MAX_LOG10 = 400.0
_LOG10_SYMBOL = log10(41)  # the sample points are p/q with p, q <= 41
_LOG10_PI = 0.5  # pi < 10^0.5
_LOG10_E = log10(_E)
_TOKENS = re.compile(r"\d+\.?\d*|\.\d+|\*\*|[-+*/()]|[a-zA-Z]+|\S")


class _Refused(Exception):
    pass


def _log_size(text: str) -> float | None:
    r"""Upper bound on the log10 size of every number sympy builds from `text` (a `_sympy_text` string, at the
    sample points), or None when it is over _MAX_LOG10 or the text does not parse.

    Read on Python's grammar with implicit products, before sympy sees the text: sympy evaluates powers while
    parsing, so ((999^999)^999)^999 or \exp(999^{999}) would never return. Sizes obey size(a + b) <=
    2 size(a) size(b), size(a * b), size(a / b) <= size(a) size(b), size(a ** b) <= size(a) ** |b| with
    |b| <= size(b), whatever the brackets.
    """
    toks, i = _TOKENS.findall(text), 0

    def peek() -> str:
        return toks[i] if i < len(toks) else ""

    def take(expected: str | None = None) -> str:
        nonlocal i
        if i >= len(toks) or (expected is not None and toks[i] != expected):
            raise _Refused
        i += 1
        return toks[i - 1]

    def bounded(h: float) -> float:
        if h > _MAX_LOG10:
            raise _Refused
        return h

    def expr() -> float:
        h = term()
        while peek() in ("+", "-"):
            take()
            h = bounded(h + term() + log10(2))
        return h

    def term() -> float:
        h = unary()
        while True:
            t = peek()
            if t in ("*", "/"):
                take()
                h = bounded(h + unary())
            elif t == "(" or t[:1].isalnum() or t[:1] == ".":  # an implicit product: "2 x", "2 (x)"
                h = bounded(h + power())
            else:
                return h

    def unary() -> float:
        if peek() in ("+", "-"):
            take()
            return unary()
        return power()

    def power() -> float:
        h = atom()
        if peek() == "**":
            take()
            exponent = unary()  # right-associative, like Python
            h = bounded(h * 10 ** min(exponent, 5.0))
        return h

    def atom() -> float:
        t = take()
        if t == "(":
            h = expr()
            take(")")
            return h
        if t[0].isdigit() or t[0] == ".":
            whole, _, frac = t.partition(".")
            return bounded(max(log10(max(int(whole + frac or "0"), 2)), len(frac)))
        if t == "pi":
            return _LOG10_PI
        if t in _FUNCS:  # a call; sympy's "sqrt 4" does not parse either
            take("(")
            h = expr()
            take(")")
            # |exp(a)| and 1/|exp(a)| are at most e^|a|; sqrt shrinks sizes; 1/log(1 + 1/N) ~ N; sin, cos and
            # tan reduce an argument whose size is bounded.
            return bounded(10 ** min(h, 5.0) * _LOG10_E) if t == "exp" else h
        if len(t) == 1 and t.isalpha():
            return _LOG10_SYMBOL
        raise _Refused

    try:
        h = expr()
        return h if i == len(toks) else None
    except (_Refused, RecursionError):
        return None


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
    # 1e3 inside an expression is scientific notation, not the product 1 * e * 3
    s = _SCIENTIFIC.sub(lambda m: f"({m.group(1)}*10**({m.group(2).lstrip('+')}))", s)
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
    if _log_size(s) is None:  # nor bracketed: (999**999)**999, exp(999**999); nor huge numbers at all
        return None
    return s


class _OutOfRange(Exception):
    pass


def _mp(v, ctx):
    """An exact Fraction as an mpmath complex (mpmath does not take Fractions); an mpmath value unchanged."""
    return ctx.mpc(ctx.mpf(v.numerator) / v.denominator) if isinstance(v, Fraction) else v


def _value(e, point: dict, ctx):
    """Value of an unevaluated sympy tree: exact (Fraction) while it can be, else an mpmath complex at fixed
    precision; _OutOfRange past 10^400. sympy's own evaluation is not used: it can loop for ever on answers
    of 30 characters (Mul.flatten on sqrt(2.0*13**(1/6)), sympy issue 25176; evalf chasing tan(sin(pi)**-99))."""
    import sympy

    if e.is_Symbol:
        return point[e]
    if e.is_Integer or e.is_Rational:
        return Fraction(int(e.p), int(e.q))
    if e.is_Float:
        return Fraction(str(e))
    if e is sympy.pi:
        return ctx.pi
    args = [_value(a, point, ctx) for a in e.args]
    if e.is_Add or e.is_Mul:
        v = args[0]
        for a in args[1:]:
            if not (isinstance(v, Fraction) and isinstance(a, Fraction)):
                v, a = _mp(v, ctx), _mp(a, ctx)
            v = v + a if e.is_Add else v * a
    elif e.is_Pow:
        b, x = args
        if isinstance(b, Fraction) and isinstance(x, Fraction) and x.denominator == 1:
            if abs(x) * max(b.numerator.bit_length(), b.denominator.bit_length()) > 1400:
                raise _OutOfRange
            v = b ** int(x)  # 0 ** -1 raises ZeroDivisionError: a pole
        else:
            v = ctx.power(_mp(b, ctx), _mp(x, ctx))
    elif isinstance(e, (sympy.exp, sympy.log, sympy.sin, sympy.cos, sympy.tan)) and len(args) == 1:
        a = _mp(args[0], ctx)
        if isinstance(e, sympy.exp) and ctx.re(a) > 1000:
            raise _OutOfRange
        v = getattr(ctx, type(e).__name__)(a)
    else:
        raise _OutOfRange  # nothing else is on the whitelist
    if isinstance(v, Fraction):
        if max(v.numerator.bit_length(), v.denominator.bit_length()) > 1400:  # ~ 10^420
            raise _OutOfRange
    elif not ctx.isfinite(v) or abs(v) > ctx.mpf(10) ** 400:
        raise _OutOfRange
    return v


def _sympy_equal(a: str, b: str) -> bool | None:
    """Numeric comparison of two expressions at fixed points; None when either cannot be parsed."""
    ta, tb = _sympy_text(a), _sympy_text(b)
    if ta is None or tb is None:
        return None
    try:
        import mpmath
        import sympy
        from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations
    except ImportError:  # pragma: no cover - sympy ships with torch
        return None
    names = {f: getattr(sympy, f) for f in _FUNCS}
    names.update(Integer=sympy.Integer, Float=sympy.Float, Rational=sympy.Rational, Symbol=sympy.Symbol)
    names.update(Add=sympy.Add, Mul=sympy.Mul, Pow=sympy.Pow)  # what evaluate=False writes
    names["__builtins__"] = {}
    letters = {c: sympy.Symbol(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    transforms = standard_transformations + (implicit_multiplication,)
    ctx = mpmath.MPContext()  # a private context: fixed precision, the global mpmath settings untouched
    ctx.dps = 30
    try:
        # evaluate=False: the parse builds the tree and computes nothing (no power, no simplification).
        ea, eb = (
            parse_expr(t, local_dict=dict(letters), global_dict=dict(names), transformations=transforms, evaluate=False)
            for t in (ta, tb)
        )
        symbols = sorted(ea.free_symbols | eb.free_symbols, key=str)
        if len(symbols) > 6:
            return None
        # Distinct values per symbol (so x and y never coincide), three points for identities.
        primes = (13, 17, 19, 23, 29, 31, 37, 41)
        points = [
            {s: Fraction(primes[(k + t) % 8], 7 + 2 * k + t) for k, s in enumerate(symbols)}
            for t in range(3 if symbols else 1)
        ]
        checked = 0
        for pt in points:
            try:
                va, vb = complex(_value(ea, pt, ctx)), complex(_value(eb, pt, ctx))
            except (ZeroDivisionError, _OutOfRange):
                continue  # a pole, or a value past 10^400, at this point says nothing
            if abs(va - vb) > 1e-9 * max(1.0, abs(va), abs(vb)):
                return False
            checked += 1
        return True if checked else None
    except Exception:  # sympy raises many types on odd input; any failure means "cannot tell"
        return None


def _equiv(pred: str, truth: str, depth: int = 0) -> bool:
    a, b = normalize(pred), normalize(truth)
    if not a or not b:  # an empty answer is never right, not even against an empty ground truth
        return False
    if a == b:
        return True
    if depth > 2 or max(len(a), len(b)) > _MAX_NORMALIZE_CHARS:
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
