"""Every command in a fenced block of the README and of docs/*.md parses with the real parser of the command it runs.

So the docs and the code cannot drift apart: a renamed flag, a removed command or a missing required
argument in a doc fails here. ``<...>`` in a command is a placeholder (a value, or the user's own flags).
Every relative markdown link in those files must point to an existing file.
"""

import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from openrlhf_lopti.__main__ import COMMANDS
from openrlhf_lopti.errors import UserError
from .doc_blocks import fenced_lines

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = "__placeholder__"
# `python -m <module>` entry points outside `openrlhf-lopti <command>`, and where their parser is.
MODULES = {
    "openrlhf_lopti.tasks.data": "openrlhf_lopti.tasks.data",
    "openrlhf_lopti.tasks.evaluate": "openrlhf_lopti.tasks.evaluate",
    "openrlhf_lopti.cli.train_ppo_ray": "openrlhf_lopti.cli.train_ppo_ray",
    "openrlhf_lopti.verl.data": "openrlhf_lopti.verl.data",
}
# Modules whose package imports an extra this environment lacks (openrlhf_lopti.verl imports verl, which lives
# in .venv-verl only): their file is loaded on its own, which needs only the core.
BY_FILE = {"openrlhf_lopti.verl.data": ROOT / "openrlhf_lopti" / "verl" / "data.py"}


def load_module(name: str):
    if name not in BY_FILE:
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name + "__by_file", BY_FILE[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fenced_commands(text: str) -> list[tuple[int, list[str]]]:
    """``(line number, words)`` of each `openrlhf-lopti ...` / `python -m openrlhf_lopti...` command in a
    fenced code block (backslash continuations joined, comments and ``VAR=value`` prefixes dropped)."""
    commands = []
    for start, line in fenced_lines(text):
        logical = re.sub(r"<[^<>]*>", PLACEHOLDER, line)
        try:
            words = shlex.split(logical, comments=True)
        except ValueError:  # not shell (e.g. a Python block)
            continue
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["openrlhf-lopti"]:
            commands.append((start, words))
        elif len(words) >= 3 and Path(words[0]).name in ("python", "python3") and words[1] == "-m":
            if words[2].split(".")[0] == "openrlhf_lopti":
                commands.append((start, words))
    return commands


def parser_and_args(words: list[str]):
    """The real parser of the command ``words`` runs, and the arguments it gets."""
    if words[0] == "openrlhf-lopti" or words[2] == "openrlhf_lopti":
        rest = words[1:] if words[0] == "openrlhf-lopti" else words[3:]
        assert rest and rest[0] in COMMANDS, f"unknown command {rest[:1]}"
        module = importlib.import_module(COMMANDS[rest[0]][0])
        return module.build_parser(), rest[1:]
    assert words[2] in MODULES, f"no parser known for `python -m {words[2]}`"
    return load_module(MODULES[words[2]]).build_parser(), words[3:]


COMMAND_LINES = [
    (f"{doc.relative_to(ROOT)}:{n}", words)
    for doc in DOCS
    for n, words in fenced_commands(doc.read_text(encoding="utf-8"))
]


def test_the_readme_has_commands_of_every_kind():
    used = {w[1] if w[0] == "openrlhf-lopti" else w[3] if w[2] == "openrlhf_lopti" else w[2] for _, w in COMMAND_LINES}
    assert {"demo", "train", "eval", "data", "tiny-model", "openrlhf_lopti.cli.train_ppo_ray"} <= used


@pytest.mark.parametrize("line, words", COMMAND_LINES, ids=[where for where, _ in COMMAND_LINES])
def test_readme_command_parses_with_the_real_parser(line, words):
    parser, argv = parser_and_args(words)
    try:
        _, unknown = parser.parse_known_args(argv)
    except (UserError, SystemExit) as e:  # our parsers raise UserError, upstream's exit
        pytest.fail(f"{line}: `{' '.join(words)}` does not parse: {e}")
    assert all(PLACEHOLDER in w for w in unknown), f"{line}: unknown arguments {unknown}"


def test_demo_time_in_the_readme_is_the_one_in_its_help():
    from openrlhf_lopti.demo.run import build_parser

    said = re.search(r"about (\d+-\d+ minutes)", build_parser().description)
    assert said, "the demo's --help states its time"
    assert f"about {said.group(1)}" in README.read_text(encoding="utf-8")


def relative_links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of each relative markdown link ``[text](target)`` outside fenced blocks
    (no scheme, not a bare ``#anchor``; the ``#anchor`` part dropped)."""
    links, inside = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if inside:
            continue
        for target in re.findall(r"\]\(([^()\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            links.append((number, target.split("#")[0]))
    return links


def test_relative_links_point_to_existing_files():
    broken = [
        f"{doc.relative_to(ROOT)}:{n}: {target}"
        for doc in DOCS
        for n, target in relative_links(doc.read_text(encoding="utf-8"))
        if not (doc.parent / target).exists()
    ]
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_the_link_check_sees_links():
    assert relative_links("see [a](docs/A.md#x), [b](https://x.org), [c](#here)\n```\n[d](e.md)\n```") == [(1, "docs/A.md")]
