"""How the command fails: one line on stderr and an exit code, whatever went wrong.

Known failures (a run folder with nothing readable, a model config that cannot be built, a usage
error found after parsing) say what they are; anything else is still one line, with `--debug`
for its traceback. While a command runs, the libraries it calls keep their warnings to themselves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
import warnings
from typing import Callable, Iterator, Tuple, Type

from trainer_memcb.cli.output import one_line

__all__ = [
    "PROGRAM", "EXIT_DONE", "EXIT_NOTHING_FOUND", "EXIT_USAGE", "EXIT_DOES_NOT_FIT", "EXIT_MISSING_PACKAGE",
    "EXIT_UNTRACEABLE", "EXIT_INTERRUPTED", "UsageError", "KnownFailure", "say", "quiet_libraries", "answer",
]

PROGRAM = "trainer-memcb"
EXIT_DONE = 0
EXIT_NOTHING_FOUND = 1
EXIT_USAGE = 2
# `estimate --device-memory`: the answer of "fits?" for a script, 0 when it fits.
EXIT_DOES_NOT_FIT = 3
# A package the options need is not installed (peft for --lora-r): not a usage error.
EXIT_MISSING_PACKAGE = 4
# The step plan cannot trace the model's step under fake tensors: fits? has no answer.
EXIT_UNTRACEABLE = 5
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
# Loggers of the libraries the commands call, which print warnings of their own on stderr
# (a hub request retried, a truncated record, a glyph missing from a font).
_LIBRARY_LOGGERS = ("transformers", "huggingface_hub", "tensorboard", "matplotlib", "torch")


class UsageError(Exception):
    """Bad input found after parsing (an option that does not fit the model, a plot extension)."""


def say(message: str) -> None:
    """`trainer-memcb: <message>` on stderr, on one line."""
    print(f"{PROGRAM}: {one_line(message)}", file=sys.stderr)


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Python warnings off and only errors from the libraries' loggers; all put back after."""
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _stop_writing_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush of a closed pipe
    prints nothing either."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture): nothing to do
        pass


def answer(run: Callable[[], int], known: Tuple[Type[BaseException], ...], debug: bool) -> int:
    """`run()`'s exit code, or the exit code of its failure after one line on stderr.

    Args:
        run: the command.
        known: exceptions whose message is the whole answer (exit 1).
        debug: show the traceback of an unforeseen failure instead of its one line.
    """
    try:
        return run()
    except known as error:
        say(str(error))
        return EXIT_NOTHING_FOUND
    except UsageError as error:
        say(f"error: {error}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        say("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of stdout went away (`| head`): nobody is left to tell
        _stop_writing_stdout()
        return EXIT_NOTHING_FOUND
    except Exception as error:  # the last resort: whatever was not foreseen is still one line
        if debug:
            traceback.print_exc(file=sys.stderr)
        else:
            say(f"unexpected error: {type(error).__name__}: {error} (run with --debug for the traceback)")
        return EXIT_NOTHING_FOUND


class KnownFailure(Exception):
    """A failure whose message is the whole answer (exit 1): a run folder with nothing readable
    (`RunLogError`), a model config that cannot be built (`ModelConfigError`). Each handler turns
    its own into this one, as their classes come with torch, which a usage error never imports."""
