"""The command lines of the fenced code blocks of a markdown file, for tests that run or parse what the docs say."""

from typing import List, Tuple


def fenced_lines(text: str) -> List[Tuple[int, str]]:
    """``(first line number, logical line)`` of each line inside a fenced block, backslash continuations joined."""
    found, inside, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        start = start if pending else number
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        found.append((start, pending))
        pending = ""
    return found
