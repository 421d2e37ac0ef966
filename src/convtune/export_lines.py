"""The tuning database's export format: one JSON object a line, plain or gzip-compressed.

A line is one stored result with what keys it: the schema it was written under, the device fingerprint, the
software versions, the problem key, when it was stored, the result (``PerfResult.to_dict``), and a checksum of
those values. The checksum refuses a line damaged into other valid JSON (a digit of a time changed), where a gzip
file's own check covers only compressed exports; lines written before it was added have none and are read as they
are. ``TuningDB.export`` writes these lines and ``TuningDB.import_`` reads them (``convtune cache export/import``).

    >>> from convtune import PerfResult
    >>> text = line(3, "cpu|x", "torch", "fwd|n1|c2|k2|in5x5|r3x3|s1x1|p0x0|d1x1|g1|float32|channels_first|cpu|tf32=1",
    ...             0.0, PerfResult("torch:native", "ok", time_ms=1.0))
    >>> parse(text.encode())[4].time_ms
    1.0
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from .files import write_whole
from .problem import ConvProblem
from .results import PerfResult
from .units import format_bytes

SCHEMAS = (1, 2, 3)  # the database schemas whose lines this version reads: 2 and 3 added tables and a checksum
# column, not a change to what a result line says
IMPORT_LIMIT_BYTES = 1 << 30  # of a decompressed export file (a sweep of thousands of problems: tens of MB)
FIELDS = ("schema", "fingerprint", "software", "problem", "stored_at", "result")  # and "checksum" (of these)
_NO_CHECKSUM = object()  # a line written before checksums were added


def checksum(fields: dict) -> str:
    """The checksum of a line's fields (``FIELDS``): of their values, not of how the file spells them."""
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode("utf-8"), digest_size=16).hexdigest()


def line(schema: int, fingerprint: str, software: str, problem: str, stored_at: float, result: PerfResult) -> str:
    """The export line of one stored result, its newline included."""
    fields = dict(zip(FIELDS, (schema, fingerprint, software, problem, stored_at, result.to_dict())))
    return json.dumps({**fields, "checksum": checksum(fields)}) + "\n"


def write(path: str | os.PathLike, lines: Sequence[str]) -> None:
    """``lines`` into ``path`` as a whole (never half-written), gzip-compressed where the name ends in ``.gz``."""
    data = "".join(lines).encode("utf-8")
    if str(path).lower().endswith(".gz"):
        data = gzip.compress(data, mtime=0)  # the same results, the same bytes
    write_whole(path, lambda target: target.write_bytes(data))


def parse(raw: bytes) -> tuple[str, str, ConvProblem, float, PerfResult]:
    """One export line, validated: (fingerprint, software, problem, stored_at, result); ``ValueError`` saying what
    is wrong with it."""
    try:
        fields = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text (a binary payload?)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to be an export line") from None
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
    given = fields.pop("checksum", _NO_CHECKSUM)
    if set(fields) != set(FIELDS):
        missing, unknown = set(FIELDS) - set(fields), set(fields) - set(FIELDS)
        raise ValueError(f"fields must be {list(FIELDS)} (and, since checksums were added, a checksum); missing "
                         f"{sorted(missing)}, unknown {sorted(unknown)}")
    if given is not _NO_CHECKSUM:
        try:
            matches = given == checksum(fields)
        except RecursionError:
            raise ValueError("JSON nested too deeply to be an export line") from None
        if not matches:
            raise ValueError("its checksum does not match its content: the line was changed or damaged since it "
                             "was exported; export it again from the database that holds it")
    if fields["schema"] not in SCHEMAS or isinstance(fields["schema"], bool):
        raise ValueError(f"schema {fields['schema']!r} is not one of {list(SCHEMAS)}; export it again with this "
                         f"convtune")
    for name in ("fingerprint", "software"):
        if not isinstance(fields[name], str) or not fields[name]:
            raise ValueError(f"{name}={fields[name]!r} must be a non-empty string")
    try:
        problem = ConvProblem.from_key(fields["problem"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"bad problem: {exc}") from None
    if fields["fingerprint"].split("|", 1)[0] != problem.device:
        raise ValueError(f"fingerprint {fields['fingerprint']!r} is not of a {problem.device} device like the problem")
    at = fields["stored_at"]
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
        raise ValueError(f"stored_at={at!r} must be seconds since the epoch (a number >= 0)")
    try:
        result = PerfResult.from_dict(fields["result"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"bad result: {exc}") from None
    return fields["fingerprint"], fields["software"], problem, float(at), result


def check_source(path: Path) -> None:
    """``ValueError`` naming ``path`` where it is a folder or where nothing is (what to import is a file)."""
    if path.is_dir() or not path.exists():
        what = "a folder" if path.is_dir() else "no file"
        raise ValueError(f"{path} is {what}, not an export file; give a file that `convtune cache export` "
                         f"(TuningDB.export) wrote; nothing was imported")


def read(path: Path) -> Iterator[bytes]:
    """An export file's lines, one at a time: as stored, or decompressed where it is gzip's (by its first
    bytes, whatever its name); ``ValueError`` naming the file for a folder, a missing file, a damaged one or one
    over IMPORT_LIMIT_BYTES of lines (an import keeps every parsed line until it stores them together)."""
    check_source(path)
    with open(path, "rb") as raw:
        packed = raw.read(2) == b"\x1f\x8b"
    read_bytes = 0
    try:
        with (gzip.open(path, "rb") if packed else open(path, "rb")) as f:
            while text := f.readline(IMPORT_LIMIT_BYTES + 1 - read_bytes):  # one line longer than the limit: bounded
                read_bytes += len(text)
                if read_bytes > IMPORT_LIMIT_BYTES:
                    raise ValueError(f"{path} holds over {format_bytes(IMPORT_LIMIT_BYTES)} of results"
                                     f"{' once decompressed' if packed else ''}; split it into smaller exports; "
                                     f"nothing was imported")
                yield text.rstrip(b"\n")
    except (OSError, EOFError, zlib.error) as exc:
        if not packed:
            raise
        raise ValueError(f"{path} is a damaged gzip file ({type(exc).__name__}: {exc}); nothing was imported") from None
