"""Keep other libraries' import chatter off the terminal.

Importing transformers' optimizer machinery imports peft, bitsandbytes and torchao, and on a
machine without their compiled kernels they print lines such as "Failed to load ... _C_mxfp8 ..."
or "Failed to load CPU gemm_4bit_forward ...", some from C code, some through `logging` or
`warnings`. None of it is this command's output. `quiet_output()` sends the process's stderr
(file descriptor 2, so that C-level writes are caught too) to a temporary file for the duration
and drops it; `--verbose` skips it and shows everything.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterator

__all__ = ["quiet_output"]


@contextlib.contextmanager
def quiet_output(enabled: bool = True) -> Iterator[None]:
    """While inside, whatever is written to stderr is discarded (unless `enabled` is False).

    Our own messages are printed after leaving it: errors propagate as exceptions and the CLI
    prints them once the stream is back.

    Examples:
        >>> import sys
        >>> with quiet_output():
        ...     print("Failed to load libfoo.so", file=sys.stderr)
    """
    if not enabled:
        yield
        return
    try:
        stderr_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stream (a test's capture): nothing to hide
        yield
        return
    sys.stderr.flush()
    saved = os.dup(stderr_fd)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), stderr_fd)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except Exception:  # a stream closed by a library: still put the descriptor back
                pass
            os.dup2(saved, stderr_fd)
            os.close(saved)
