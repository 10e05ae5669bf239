"""Human units for people to read. The logs keep exact integers; only text uses these."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Union

__all__ = ["KiB", "MiB", "GiB", "MAX_SIZE_BYTES", "MAX_WHOLE_NUMBER", "SIZE_UNITS", "format_bytes", "parse_bytes", "parse_size",
           "parse_whole_number"]

# Binary units, named as such (IEC 80000-13): a MiB is 1024**2 bytes, never called "MB".
KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

# The units a size may be written in (case-insensitive): binary ones (IEC) and decimal ones (SI).
SIZE_UNITS = {"b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
              "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
# The largest size taken: 16 EiB, what a 64-bit address space can hold. Beyond it no device exists,
# and the figures would no longer fit a float for printing.
MAX_SIZE_BYTES = 2**64
_UNIT_NAMES = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
# The largest count a whole-number option takes (a batch, a length, a number of processes or of
# samples): 2**31 - 1. No training holds more of any of them, and two such counts multiplied (a
# batch of rows times their length) still fit torch's int64 sizes.
MAX_WHOLE_NUMBER = 2**31 - 1


def format_bytes(num_bytes: int) -> str:
    """`526_264_752` -> `"501.9 MiB"`; `2048` -> `"2.0 KiB"`; `12` -> `"12 B"`.

    Examples:
        >>> format_bytes(526_264_752)
        '501.9 MiB'
    """
    magnitude = abs(num_bytes)
    if magnitude >= GiB:
        return f"{num_bytes / GiB:.2f} GiB"
    if magnitude >= MiB:
        return f"{num_bytes / MiB:.1f} MiB"
    if magnitude >= KiB:
        return f"{num_bytes / KiB:.1f} KiB"
    return f"{num_bytes} B"


def parse_size(text: Union[str, int], what: str = "memory size") -> int:
    """A size in bytes from text with a unit: `"80GiB"` -> 85899345920, `"40 GB"` -> 40000000000.

    A number without a unit is refused (`"80"` is more likely 80 GiB than 80 bytes): write
    `80GiB`, or `80B` for bytes. An `int` is bytes. A count of bytes is whole (`"1.5B"` is refused);
    a fraction of a byte that a larger unit leaves is dropped (`"0.5KiB"` is 512, `"1.1GiB"`
    1181116006). The number is read exactly (decimal, never a float), so no size
    overflows; one above `MAX_SIZE_BYTES` (16 EiB), negative, or not finite is refused.

    Args:
        text: the size as written, or a byte count.
        what: what the size is, for the error message (`"--device-memory"`).

    Raises:
        ValueError: one line naming the text and what is allowed.

    Examples:
        >>> parse_size("80GiB"), parse_size("1.5 KiB"), parse_size("80GB"), parse_size(512)
        (85899345920, 1536, 80000000000, 512)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        number, unit, raw = Decimal(text), "b", str(text)
    else:
        raw = str(text).strip()
        compact = raw.replace("_", "").replace(",", "")
        number_text = compact.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ").strip()
        unit = compact[len(number_text):].strip().lower()
        try:
            number = Decimal(number_text)
        except InvalidOperation:
            raise ValueError(f"{what} {raw!r} is not a size such as 80GiB, 40GB or 512B "
                             f"(units: {_UNIT_NAMES})") from None
        if not unit and number.is_finite():
            raise ValueError(f"{what} {raw!r} has no unit: write {raw}GiB, {raw}GB, or {raw}B for bytes "
                             f"(units: {_UNIT_NAMES})")
        if unit not in SIZE_UNITS:
            raise ValueError(f"{what} {raw!r} is not a size such as 80GiB, 40GB or 512B "
                             f"(units: {_UNIT_NAMES})")
    if not number.is_finite():
        raise ValueError(f"{what} {raw!r} is not a finite size")
    if number < 0:
        raise ValueError(f"{what} {raw!r} is negative: give a size of at least 0B")
    if unit == "b" and number != number.to_integral_value():
        raise ValueError(f"{what} {raw!r} is not a whole number of bytes: write a whole count of B, or a larger unit "
                         f"such as 1.5GiB, 40GB or 512KiB (units: {_UNIT_NAMES})")
    # `adjusted()` is the decimal exponent: checked first, so that 1e999999GiB is never multiplied out.
    if number.adjusted() > 30 or number * SIZE_UNITS[unit] > MAX_SIZE_BYTES:
        raise ValueError(f"{what} {raw!r} is larger than any device: at most 16 EiB ({MAX_SIZE_BYTES:,} bytes)")
    return int(number * SIZE_UNITS[unit])


def parse_whole_number(text: str, least: int = 1, example: int = 8) -> int:
    """A whole number from `least` to `MAX_WHOLE_NUMBER` from text, for every whole-number option.

    Raises:
        ValueError: one line naming the text and the range allowed.

    Examples:
        >>> parse_whole_number("8"), parse_whole_number("0", least=0)
        (8, 0)
    """
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        allowed = "a positive integer" if least == 1 else f"a whole number of at least {least}"
        raise ValueError(f"{text!r} is not {allowed}, e.g. {example}")
    if value > MAX_WHOLE_NUMBER:
        raise ValueError(f"{text!r} is too large: give a whole number from {least} to {MAX_WHOLE_NUMBER:,}")
    return value


def parse_bytes(text: Union[str, int]) -> int:
    """`"80GiB"` -> 85899345920; `"80GB"` -> 80000000000; an int is bytes; a number written
    without a unit is refused (`parse_size`, the one rule for sizes).

    Raises:
        ValueError: naming the text and the units allowed.

    Examples:
        >>> parse_bytes("80GiB"), parse_bytes("1.5 KiB"), parse_bytes(512)
        (85899345920, 1536, 512)
    """
    return parse_size(text)
