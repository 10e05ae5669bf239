"""How the command prints: rich tables in a terminal, plain text when piped, JSON for machines.

The commands build `TextTable`s from data; nothing here computes a figure.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, TextIO, Tuple

from trainer_memcb.utils.units import format_bytes

__all__ = ["TextTable", "bytes_cell", "count_cell", "metric_cell", "print_tables", "print_json", "finite_json", "one_line",
           "terminal_width"]

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


def _longest_word(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


def _folded(table: TextTable, widths: Sequence[int]) -> Any:
    """The table as rich draws it, each column `widths` wide (at least its longest word), so that
    a narrow terminal folds cells at spaces and never cuts a name or a byte count."""
    from rich.table import Table
    from rich.text import Text

    # Text, not str: rich reads "[...]" in a str as markup, and a run named "[/]" would raise.
    shown = Table(title=Text(table.title), title_justify="left", caption=Text(table.note) if table.note else None,
                  caption_justify="left")
    for index, (column, width) in enumerate(zip(table.columns, widths)):
        shown.add_column(Text(column), justify="left" if index in table.text_columns else "right",
                         overflow="fold", width=width)
    for row in table.rows:
        shown.add_row(*(Text(cell) for cell in row))
    return shown


def _records(table: TextTable) -> List[Any]:
    """A table too wide for the terminal, one small table per row: each column's name beside the
    row's cell, the row's first cell as the heading."""
    from rich.table import Table
    from rich.text import Text

    shown: List[Any] = [Text(table.title)]
    for row in table.rows:
        record = Table(show_header=True)
        record.add_column(Text(table.columns[0]), overflow="fold")
        record.add_column(Text(row[0]), overflow="fold")
        for column, cell in zip(table.columns[1:], row[1:]):
            record.add_row(Text(column), Text(cell))
        shown.append(record)
    if table.note:
        shown.append(Text(table.note))
    return shown


def _min_widths(table: TextTable) -> List[int]:
    return [max([_longest_word(column)] + [_longest_word(row[index]) for row in table.rows if index < len(row)])
            for index, column in enumerate(table.columns)]


def _column_widths(table: TextTable, width: int) -> Optional[List[int]]:
    """Each column's width for the table to fit `width` terminal columns: as wide as its widest cell
    when all fit, else at least its longest word, the room left shared in proportion to what each
    column lacks; None when even the longest words do not fit side by side."""
    # rich's default box: one space of padding each side and one border per column, one more at the end.
    room = width - (3 * len(table.columns) + 1)
    natural = [max([len(column)] + [len(row[index]) for row in table.rows if index < len(row)])
               for index, column in enumerate(table.columns)]
    if sum(natural) <= room:
        return natural
    least = _min_widths(table)
    spare = room - sum(least)
    if spare < 0:
        return None
    lacking = [most - fewest for most, fewest in zip(natural, least)]
    given = [spare * lack // sum(lacking) for lack in lacking]
    widths = [fewest + extra for fewest, extra in zip(least, given)]
    for index in sorted(range(len(widths)), key=lambda i: lacking[i] - given[i], reverse=True)[:spare - sum(given)]:
        widths[index] += 1
    return widths


def _transposed(table: TextTable) -> TextTable:
    """Rows become columns: one column per row, headed by its first cell (an optimizer, a run)."""
    rows = [[column] + [row[index] for row in table.rows] for index, column in enumerate(table.columns) if index]
    return TextTable(table.title, [table.columns[0]] + [row[0] for row in table.rows], rows, note=table.note,
                     text_columns=tuple(range(len(table.rows) + 1)))


def _rich(table: TextTable, width: int) -> List[Any]:
    """What rich prints for `table` at `width` columns: the table, folded at spaces where it must
    be; else turned on its side (a few wide rows, a plan's optimizers, fit as columns); else one
    small table per row. A word (a name, a byte count) is never cut unless it alone is wider
    than the terminal."""
    widths = _column_widths(table, width)
    if widths is not None:
        return [_folded(table, widths)]
    if table.rows:
        side = _transposed(table)
        side_widths = _column_widths(side, width)
        if side_widths is not None:
            return [_folded(side, side_widths)]
    return _records(table)


def terminal_width(stream: TextIO) -> Optional[int]:
    """The columns of the terminal `stream` writes to: `COLUMNS` when set (as rich reads it), else
    the terminal's own size; None when neither is known."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        width = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return None
    return width or None


def print_tables(tables: Sequence[TextTable], stream: TextIO) -> None:
    """Rich tables when `stream` is a terminal, plain aligned text otherwise (pipes, files).

    In a terminal narrower than a table, cells fold at spaces rather than being cut: names and
    byte counts stay whole; a table whose longest words do not fit side by side is shown one row
    at a time."""
    if stream.isatty():
        from rich.console import Console

        console = Console(file=stream, width=terminal_width(stream))
        for table in tables:
            for renderable in _rich(table, console.width):
                console.print(renderable)
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
