"""Human byte sizes: '64MiB' <-> 67108864."""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
MAX_BYTES = 2**63 - 1  # what an int64 byte count holds
# Digits 0-9 only, as parse_int reads them ('６４MiB' was 64 MiB); a negative size is read, then refused as negative
_SIZE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """'64MiB' -> 67108864; '1.5GB' -> 1500000000; an int passes through.

    >>> parse_bytes("64MiB")
    67108864
    """
    if isinstance(text, bool):
        raise TypeError(f"{what} must be a number of bytes or a size like '64MiB', got {text!r}")
    exact: int | float | Fraction
    if isinstance(text, numbers.Integral):  # int, numpy's ints
        exact = int(text)
    elif isinstance(text, numbers.Real):  # a computed budget: free_bytes * 0.1
        if not math.isfinite(text):
            raise ValueError(f"{what}={text} is not a finite number of bytes")
        exact = float(text)
    elif isinstance(text, str):
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{what}={text!r} is not a size; write bytes or a size like 512KiB, 64MiB, 1GiB, 2GB")
        exact = Fraction(match.group(1)) * _UNITS[unit]  # exact: no float overflow, no rounding
    else:
        raise TypeError(f"{what} must be a number of bytes or a size like '64MiB', got {type(text).__name__}")
    if exact < 0:  # before int() rounds -0.5 bytes to 0, a limit of none
        raise ValueError(f"{what}={text} is negative; give 0 or more bytes")
    value = int(exact)
    if value > MAX_BYTES:
        raise ValueError(f"{what}={text!r} is more than {MAX_BYTES} bytes (8 EiB); give a smaller size")
    return value


_WHOLE = re.compile(r"\s*[+-]?[0-9]+\s*")


def parse_int(text: str, what: str) -> int:
    """A whole number written in digits, with an optional sign; ``ValueError`` naming ``what`` otherwise (``int``
    alone reads '1_0' as 10 and '５' as 5: a typo would be another size).

    >>> parse_int(" -12", "stride")
    -12
    """
    if not _WHOLE.fullmatch(text):
        raise ValueError(f"{what} {text!r} is not a whole number written in digits; write it in digits 0-9, "
                         f"e.g. 10")
    return int(text)


def format_ms(value: float | None) -> str:
    """A time in ms for a table: four decimals below 1 ms, three above; '-' for none.

    >>> format_ms(0.01234), format_ms(12.3456), format_ms(None)
    ('0.0123', '12.346', '-')
    """
    return "-" if value is None else f"{value:.4f}" if abs(value) < 1 else f"{value:.3f}"


def format_bytes(n: int | None) -> str:
    """67108864 -> '64.0 MiB'.

    >>> format_bytes(1536)
    '1.5 KiB'
    """
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
