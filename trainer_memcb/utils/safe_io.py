"""Reading and writing files without trusting them.

Reading: only regular files (a named pipe would block, a device would never end), at most a given
number of bytes, JSON at most `MAX_JSON_DEPTH` levels deep; folders are searched without following
symbolic links, to a bounded depth and number of entries.

Writing: never through a symbolic link and never a partial file. The bytes go to a temporary file
in the destination's folder, which then replaces the destination in one `os.replace` (a rename
replaces a link itself, never its target), or is removed when anything fails.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
import tempfile
from typing import IO, Any, Callable, List

from trainer_memcb.utils.units import format_bytes

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_WALK_DEPTH",
    "MAX_WALK_ENTRIES",
    "UnsafeFileError",
    "check_writable",
    "open_regular",
    "read_bytes",
    "read_json",
    "json_depth_exceeds",
    "find_files",
    "refuse_unsafe_destination",
    "atomic_write",
]

# Far above what the files read here hold (a trainer_state.json is 5 levels deep), far below
# Python's recursion limit, so that no later walk of the document can hit it.
MAX_JSON_DEPTH = 64
# A Trainer writes its TensorBoard events 2 folders down (runs/<date>_<host>/); custom loops a few more.
MAX_WALK_DEPTH = 8
# Entries (files and folders) looked at in one search before giving up.
MAX_WALK_ENTRIES = 100_000


class UnsafeFileError(Exception):
    """A file refused: not a regular file, too large, too deep, not JSON, or a link to write through.
    The message names the file and says why."""


def open_regular(path: str, max_bytes: int) -> IO[bytes]:
    """Open a regular file of at most `max_bytes` for reading in binary.

    O_NONBLOCK makes opening a named pipe return at once (instead of waiting for a writer), so
    that fstat can refuse it; on a regular file the flag changes nothing.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError as error:
        raise UnsafeFileError(f"{path} could not be read ({error.strerror or error})") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(f"{path} is not a regular file; not read")
        if info.st_size > max_bytes:
            raise UnsafeFileError(f"{path} is larger than {max_bytes:,} bytes ({format_bytes(max_bytes)}); not read")
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_bytes(path: str, max_bytes: int) -> bytes:
    """The whole of a regular file of at most `max_bytes` (one that grows past it while read is refused)."""
    with open_regular(path, max_bytes) as handle:
        try:
            data = handle.read(max_bytes + 1)
        except OSError as error:
            raise UnsafeFileError(f"{path} could not be read ({error.strerror or error})") from None
    if len(data) > max_bytes:
        raise UnsafeFileError(f"{path} is larger than {max_bytes:,} bytes ({format_bytes(max_bytes)}); not read")
    return data


def json_depth_exceeds(document: Any, max_depth: int) -> bool:
    """Whether lists and objects nest deeper than `max_depth` (the outermost is level 1).
    Iterative, so that no depth can exhaust the stack."""
    pending = [(document, 1)] if isinstance(document, (dict, list)) else []
    while pending:
        value, depth = pending.pop()
        if depth > max_depth:
            return True
        children = value.values() if isinstance(value, dict) else value
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def read_json(path: str, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON document from a regular UTF-8 file of at most `max_bytes`, at most `max_depth` deep.

    Raises:
        UnsafeFileError: naming the file and why it is refused.

    Examples:
        >>> read_json("no/such/file.json", 1024)
        Traceback (most recent call last):
        ...
        trainer_memcb.utils.safe_io.UnsafeFileError: no/such/file.json could not be read (No such file or directory)
    """
    data = read_bytes(path, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UnsafeFileError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    try:
        document = json.loads(text)
    except RecursionError:  # the parser nests one call per level
        raise UnsafeFileError(f"{path} is nested deeper than {max_depth} levels") from None
    except ValueError as error:  # JSONDecodeError, and integers longer than Python converts
        raise UnsafeFileError(f"{path} is not valid JSON ({error})") from None
    if json_depth_exceeds(document, max_depth):
        raise UnsafeFileError(f"{path} is nested deeper than {max_depth} levels")
    return document


def find_files(root: str, pattern: str, max_depth: int = MAX_WALK_DEPTH,
               max_entries: int = MAX_WALK_ENTRIES) -> List[str]:
    """Regular files under `root` whose name matches `pattern` (fnmatch), sorted.

    Symbolic links are neither followed nor returned, so that a link to `.` or to `/usr` cannot
    make the search endless; folders deeper than `max_depth` below `root` and unreadable folders
    are not searched.

    Raises:
        UnsafeFileError: more than `max_entries` entries under `root`.
    """
    found: List[str] = []
    seen = 0
    pending = [(root, 0)]
    while pending:
        folder, depth = pending.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > max_entries:
                    raise UnsafeFileError(f"{root}: more than {max_entries:,} files and folders under it; not searched further")
                try:
                    if entry.is_symlink():
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        if depth < max_depth:
                            pending.append((entry.path, depth + 1))
                    elif entry.is_file(follow_symlinks=False) and fnmatch.fnmatchcase(entry.name, pattern):
                        found.append(entry.path)
                except OSError:
                    continue
    return sorted(found)


def refuse_unsafe_destination(path: str) -> None:
    """Raise UnsafeFileError when `path` is a symbolic link (dangling or not) or anything other
    than a regular file; a path that does not exist is fine."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as error:
        raise UnsafeFileError(f"{path} could not be checked ({error.strerror or error})") from None
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeFileError(f"{path} is a symbolic link; not writing through it")
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFileError(f"{path} is not a regular file; not replacing it")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str, write: Callable[[Any], Any], overwrite: bool = True, *, by_name: bool = False) -> None:
    """Write `path` through `write(handle)`, all or nothing, never through a symbolic link; with
    `by_name`, through `write(name)` for a writer that opens the file itself
    (`torch.cuda.memory._dump_snapshot`): the name is the temporary file's.

    The file gets the mode a plain `open(path, "w")` would give it (0o666 less the umask). With
    `overwrite=False` an existing `path` (a file, a link, anything) is never replaced: the finished
    file is linked in under its name (`os.link`, which fails when the name exists), so a file made
    meanwhile is not replaced either.

    Raises:
        UnsafeFileError: `path` is a symbolic link or not a regular file.
        FileExistsError: `path` exists and `overwrite` is False.
        OSError (or what `write` raises): nothing was written and no temporary file is left.

    Examples:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> atomic_write(os.path.join(folder, "out.txt"), lambda handle: handle.write(b"done"))
        >>> os.listdir(folder)
        ['out.txt']
    """
    refuse_unsafe_destination(path)
    if not overwrite and os.path.lexists(path):
        raise FileExistsError(f"{path} exists")
    folder = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".partial")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            if hasattr(os, "fchmod"):
                os.fchmod(handle.fileno(), 0o666 & ~_umask())
            write(temporary if by_name else handle)
            handle.flush()
            os.fsync(handle.fileno())
        # Checked again just before: a link planted meanwhile is refused. Were one planted after
        # this check, os.replace would replace the link itself, never write its target.
        refuse_unsafe_destination(path)
        if overwrite:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)  # FileExistsError when the name exists, whatever it is
            os.unlink(temporary)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def check_writable(path: str, folder: str, label: str = "") -> None:
    """Make and remove an empty temporary file where `atomic_write` will make its own, so that a
    folder that refuses files (no write permission, a read-only or virtual file system such as
    /proc) is found before the work whose result goes there, not after it.

    Raises:
        ValueError: `"{label} {path}: cannot write in the folder {folder} (why)"` (`label`, an
            option's name, left out when empty).
    """
    try:
        descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".check")
    except OSError as error:
        named = f"{label} {path}" if label else path
        raise ValueError(f"{named}: cannot write in the folder {folder} ({error.strerror or error})") from None
    os.close(descriptor)
    os.unlink(temporary)
