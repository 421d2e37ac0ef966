"""What tuning produces: PerfResult (one measured candidate) and Choice (one ranked guess)."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import TYPE_CHECKING, Any

MICRO_BATCH_BACKEND = "mb"  # the backend of micro-batched algorithms: 'mb:<inner backend>.<variant>_s<split>'


def backend_of(name: str) -> str:
    """The backend an algorithm's name says it belongs to: names are 'backend:variant' (``Algorithm``
    refuses any other), so a stored result's name alone tells its family. The one place that reads it.

        >>> backend_of("cudnn:eng58_k25=0"), backend_of("mb:gemm.im2col_s4x2")
        ('cudnn', 'mb')
    """
    return name.split(":", 1)[0]


def family_of(name: str) -> str:
    """The family an algorithm's name says it belongs to, whose best-ranked candidate ``find`` tries early
    (``find.search_order``): its backend, or, where the name is 'backend:<family>_<direction>_<configuration>'
    (convtune's Triton kernels, one algorithm per direction and configuration), 'backend:<family>'.

        >>> family_of("cudnn:eng58_k25=0"), family_of("triton:depthwise_strip_bwd_data_t8b16c32w4")
        ('cudnn', 'triton:depthwise_strip')
        >>> family_of("mb:triton.depthwise_fwd_p64c32w4_s2"), family_of("gemm:1x1_strided")
        ('mb', 'gemm')
    """
    kernels = re.match(r"([^:]+:\w+?)_(?:fwd|bwd_data|bwd_filter)_", name)
    return kernels.group(1) if kernels else backend_of(name)


class Status(str, enum.Enum):
    OK = "ok"
    UNSUPPORTED = "unsupported"
    OVER_WORKSPACE_LIMIT = "over_workspace_limit"
    OUT_OF_MEMORY = "out_of_memory"
    FAILED = "failed"
    WRONG_RESULT = "wrong_result"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"
    # Not timed because the find's policy refuses what it declares or showed: not deterministic, TF32, reduced
    # precision (a workspace over the limit has its own status). A later, wider policy may allow it.
    EXCLUDED_BY_POLICY = "excluded_by_policy"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class PerfResult:
    """One candidate of one problem: how it fared, how fast, how much workspace, how exact.

    time_ms is the median (None when it was not timed); spread_ms the interquartile range;
    rel_error the relative L2 error against the float64 reference (None when not checked); place: for a
    candidate of a backend that ranks its candidates by its own heuristics (cuDNN), its place in that order
    for this problem (0: the backend's first choice; None: no such backend), which get's learned model reads.
    """

    algorithm: str
    status: Status
    time_ms: float | None = None
    spread_ms: float | None = None
    workspace_bytes: int = 0
    deterministic: bool = True
    uses_tf32: bool = False
    reduced_precision: bool = False
    rel_error: float | None = None
    message: str = ""
    place: int | None = None

    if TYPE_CHECKING:
        # The signature dataclasses generates at runtime, with the status value __post_init__ converts.
        def __init__(
            self, algorithm: str, status: Status | str, time_ms: float | None = None,
            spread_ms: float | None = None, workspace_bytes: int = 0, deterministic: bool = True,
            uses_tf32: bool = False, reduced_precision: bool = False, rel_error: float | None = None,
            message: str = "", place: int | None = None,
        ) -> None: ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def to_dict(self) -> dict[str, Any]:
        # its fields as they are (dataclasses.asdict deep-copies each, most of a store's time; every field is a
        # number, a string, a bool, None or the status)
        d = {f.name: getattr(self, f.name) for f in _DATACLASS_FIELDS}
        d["status"] = self.status.value
        if d["place"] is None:  # most results have none: left out, as an earlier version wrote them
            del d["place"]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PerfResult:
        """Validate and rebuild from ``to_dict`` output; anything malformed raises ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"a PerfResult must be a JSON object, got {type(data).__name__}")
        unknown = data.keys() - _FIELDS
        if unknown:
            raise ValueError(f"unknown PerfResult field(s) {sorted(unknown)}")
        if not isinstance(data.get("algorithm"), str) or not data["algorithm"]:
            raise ValueError("a PerfResult needs a non-empty string 'algorithm'")
        try:
            status = Status(data.get("status"))
        except ValueError:
            allowed = [s.value for s in Status]
            raise ValueError(f"PerfResult status {data.get('status')!r} is not one of {allowed}") from None
        for name in ("time_ms", "spread_ms", "rel_error"):
            v = data.get(name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:  # NaN is not >= 0 either
                raise ValueError(f"PerfResult {name}={v!r} must be a number >= 0 or null")
            if status is Status.OK and v == math.inf:
                raise ValueError("an ok PerfResult needs finite time_ms, spread_ms and rel_error")
        ws = data.get("workspace_bytes", 0)
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 0:
            raise ValueError(f"PerfResult workspace_bytes={ws!r} must be an int >= 0")
        for name in ("deterministic", "uses_tf32", "reduced_precision"):
            if name in data and not isinstance(data[name], bool):
                raise ValueError(f"PerfResult {name}={data[name]!r} must be true or false")
        if not isinstance(data.get("message", ""), str):
            raise ValueError("PerfResult message must be a string")
        place = data.get("place")
        if place is not None and (isinstance(place, bool) or not isinstance(place, int) or place < 0):
            raise ValueError(f"PerfResult place={place!r} must be an int >= 0 or null")
        return cls(**{**data, "status": status})


@dataclasses.dataclass(frozen=True)
class Choice:
    """One algorithm ranked by ``get``: predicted time, no measurement.

    workspace_bytes is None where it is not known without costly work and did not decide the ranking: a cuDNN
    execution plan learns its workspace only by being built (0.1 ms to a second), so ``get`` builds only the
    plans of a tie for its first place, unless the policy makes workspaces decide (a limit, prefer='least_memory').
    Such a choice is priced and placed as if it needed no workspace (a cuDNN plan's predicted time does not depend
    on its workspace).
    """

    name: str
    predicted_ms: float
    workspace_bytes: int | None


_DATACLASS_FIELDS = dataclasses.fields(PerfResult)  # to_dict's, in order
_FIELDS = frozenset(f.name for f in _DATACLASS_FIELDS)  # what from_dict accepts
