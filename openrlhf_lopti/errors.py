"""User errors of the ``openrlhf-lopti`` commands: one line on stderr, exit code 2, a traceback only with ``--debug``.

A command raises :class:`UserError` for anything the user can fix (a flag, a file and its line, a folder);
:func:`run_command` catches it once, for every command. Any other exception is a bug in this package and
keeps its traceback. ``UserError`` subclasses ``ValueError``, so library callers that catch ``ValueError``
(and the tests that expect one) see no difference.

Nothing here imports torch, transformers or the rest of the package: every layer may import it.
"""

import argparse
import sys
from typing import Callable, NoReturn, Optional

DEBUG_FLAG = "--debug"


class UserError(ValueError):
    """A mistake in the command line or its input files.

    The message is one line: what is wrong, where (flag, file, 1-based line or row, key) and the fix.
    """


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors raise :class:`UserError` instead of printing the
    usage and exiting, so that they are reported like every other user error (one line, exit code 2)."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see `{self.prog} --help`)")


def run_command(prog: str, main: Callable[[list], Optional[int]], argv: list) -> int:
    """Run ``main(argv)`` and turn a :class:`UserError` into ``"<prog>: error: <message>"`` and exit code 2, a
    Ctrl-C into ``"<prog>: interrupted"`` and exit code 130 (the shell's for SIGINT).

    ``--debug`` anywhere in ``argv`` is removed before ``main`` sees it and lets the exception (and its
    traceback) through instead.
    """
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    try:
        return int(main(argv) or 0)
    except UserError as exc:
        if debug:
            raise
        message = " ".join(str(exc).split("\n"))  # one line, whatever the message held
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the user's own stop, not a bug (a run folder keeps its last checkpoint)
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130

