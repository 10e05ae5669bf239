"""How the command prints: rich tables in a terminal, plain text when piped, JSON for machines.

The commands build `TextTable`s from data; nothing here computes a figure.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, TextIO, Tuple

from trainer_memcb.utils.units import format_bytes

__all__ = ["TextTable", "bytes_cell", "count_cell", "metric_cell", "print_tables", "print_json", "finite_json", "one_line"]

_MISSING = "-"
# Line breaks and tabs in a message (a path holding one, a library's paragraphs) become one space;
# other control characters (a terminal's escape sequences) are shown escaped.
_BREAKS = re.compile(r"[\n\r\t\v\f]+")
# C0 and C1 controls and Unicode's line and paragraph separators: str.splitlines() breaks lines at
# \x1c-\x1e, \x85, \u2028 and \u2029 too, and a terminal acts on the others.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def bytes_cell(num_bytes: Optional[int]) -> str:
    """`"501.9 MiB (526,264,752)"`: the human unit and the exact count; `"-"` when unknown."""
    if num_bytes is None:
        return _MISSING
    return f"{format_bytes(num_bytes)} ({num_bytes:,})"


def count_cell(count: Optional[int]) -> str:
    return _MISSING if count is None else f"{count:,}"


def metric_cell(value: Optional[float]) -> str:
    return _MISSING if value is None else f"{value:.4f}"


@dataclass
class TextTable:
    """A table for people: a title, column names, rows of cells already formatted.

    Attributes:
        title: shown above the table.
        columns: column names.
        rows: the cells.
        note: a line shown under the table, or "".
        text_columns: indexes of the left-aligned (text) columns; the others hold numbers and
            are right-aligned.
    """

    title: str
    columns: List[str]
    rows: List[List[str]] = field(default_factory=list)
    note: str = ""
    text_columns: Tuple[int, ...] = (0,)


def _plain(table: TextTable) -> str:
    widths = [len(column) for column in table.columns]
    for row in table.rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row)]

    def line(cells: Sequence[str]) -> str:
        parts = [cell.ljust(width) if index in table.text_columns else cell.rjust(width)
                 for index, (cell, width) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    lines = [table.title, line(table.columns), line(["-" * width for width in widths])]
    lines += [line(row) for row in table.rows]
    if table.note:
        lines.append(table.note)
    return "\n".join(lines)


def _rich(table: TextTable) -> Any:
    from rich.table import Table
    from rich.text import Text

    # Text, not str: rich reads "[...]" in a str as markup, and a run named "[/]" would raise.
    shown = Table(title=Text(table.title), title_justify="left", caption=Text(table.note) if table.note else None,
                  caption_justify="left")
    for index, column in enumerate(table.columns):
        shown.add_column(Text(column), justify="left" if index in table.text_columns else "right")
    for row in table.rows:
        shown.add_row(*(Text(cell) for cell in row))
    return shown


def print_tables(tables: Sequence[TextTable], stream: TextIO) -> None:
    """Rich tables when `stream` is a terminal, plain aligned text otherwise (pipes, files)."""
    if stream.isatty():
        from rich.console import Console

        console = Console(file=stream)
        for table in tables:
            console.print(_rich(table))
        return
    stream.write("\n\n".join(_plain(table) for table in tables) + "\n")


def finite_json(document: Any) -> Any:
    """The document with every NaN and infinity replaced by None, so that it is strict JSON.
    The documents printed here are a few levels deep."""
    if isinstance(document, float):
        return document if math.isfinite(document) else None
    if isinstance(document, dict):
        return {key: finite_json(value) for key, value in document.items()}
    if isinstance(document, (list, tuple)):
        return [finite_json(value) for value in document]
    return document


def print_json(document: Any, stream: TextIO) -> None:
    """Strict JSON (RFC 8259): a non-finite number is printed as null, never as NaN or Infinity."""
    json.dump(finite_json(document), stream, indent=2, sort_keys=True, allow_nan=False)
    stream.write("\n")


def one_line(message: str) -> str:
    """The message on one line, for stderr.

    Examples:
        >>> one_line("could not read (first\\n\\nsecond)\\x1b[2J")
        'could not read (first second)\\\\x1b[2J'
        >>> one_line("key \\x85 and \\u2028 here").splitlines()
        ['key \\\\x85 and \\\\u2028 here']
    """
    return _CONTROL.sub(_escaped, _BREAKS.sub(" ", str(message)).strip())


def _escaped(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"
