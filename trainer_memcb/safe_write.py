"""Write a file whole or not at all, and never through a symbolic link.

The file is written under a fresh, unguessable name in its own folder (created exclusively, so a
link planted there is never followed) and then renamed over the destination, so that a reader
sees the old file or the new one, never half of one. A destination that is a symbolic link is
refused: replacing it would break whatever the link is for, and writing to its target would write
outside the folder the caller meant. On any failure the temporary file is removed.
"""

from __future__ import annotations

import os
import secrets
from typing import Union

__all__ = ["SymlinkRefused", "write_file_atomically"]


class SymlinkRefused(OSError):
    """The destination is a symbolic link; nothing was written."""


def write_file_atomically(path: str, data: Union[str, bytes]) -> None:
    """Write `data` (text as UTF-8) to `path`, creating its folder if needed.

    Raises:
        SymlinkRefused: `path` is a symbolic link (its target is left untouched).
        OSError: the folder cannot be made or written; no temporary file is left behind.

    Example:
        >>> import os, tempfile
        >>> from trainer_memcb.safe_write import write_file_atomically
        >>> folder = tempfile.mkdtemp()
        >>> write_file_atomically(os.path.join(folder, "a.json"), "{}\\n")
        >>> os.listdir(folder)
        ['a.json']
    """
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    if os.path.islink(path):
        raise SymlinkRefused(f"{path} is a symbolic link; refusing to write through it")
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    # O_EXCL: a name that already exists (a planted link included) fails instead of being opened.
    # Mode 0o666 lets the umask decide the permissions, as for a file opened the usual way.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    descriptor = os.open(temporary, flags, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(payload)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
