"""Human units for people to read. The logs keep exact integers; only text uses these."""

from __future__ import annotations

__all__ = ["KiB", "MiB", "GiB", "format_bytes"]

# Binary units, named as such (IEC 80000-13): a MiB is 1024**2 bytes, never called "MB".
KiB = 1024
MiB = 1024**2
GiB = 1024**3


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
