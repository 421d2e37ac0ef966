"""Policy: the user's constraints and preference for one choice.

    >>> Policy(workspace_limit="64MiB").workspace_limit
    67108864
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .errors import check_one_of
from .units import parse_bytes

PREFERENCES = ("fastest", "least_memory")


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a selection must respect and what it prefers.

    workspace_limit: bytes (or a size like '64MiB') an algorithm may use as workspace; None for no limit.
    deterministic: only algorithms that give bit-identical results run to run.
    allow_tf32: TF32 tensor-core math allowed for float32 problems.
    allow_reduced_precision: float16/bfloat16 accumulation (not float32) allowed.
    max_rel_error: relative L2 error a result may have; None takes the per-dtype default of verify.
    prefer: 'fastest', or 'least_memory' (the smallest workspace first, then the fastest among equals:
        with a policy's other limits, the leanest algorithm that works).
    tolerance: times within this fraction of each other tie; ties go to the smaller workspace, then
        to torch:native (PyTorch's own path, the least host time per call).
    max_candidates, budget_s: the tuning budget of one find (None: the settings' defaults).
    deadline_s: seconds a candidate's measurement may take: past it after one of its checked runs, it is a
        ``timeout`` and the search goes on, and the timing stops at it (None: the setting
        ``candidate_deadline_s``, 60 s). In this process a call cannot be stopped midway, so a call that
        never returns holds the search; in a worker process (``settings.isolate``) it is killed. Where
        no candidate finishes within it, the fastest right on both input sets is the answer, timed by
        its slower checked run.
    micro_batching: with a workspace_limit, find also offers algorithms run over sub-batches one
        after another (mu-cuDNN), so one whose workspace grows with the batch fits the limit.
    """

    workspace_limit: int | None = None  # a size string given to the constructor is parsed to bytes
    deterministic: bool = False
    allow_tf32: bool = True
    allow_reduced_precision: bool = True
    max_rel_error: float | None = None
    prefer: str = "fastest"
    tolerance: float = 0.02
    max_candidates: int | None = None
    budget_s: float | None = None
    micro_batching: bool = False
    deadline_s: float | None = None

    if TYPE_CHECKING:
        # The signature dataclasses generates at runtime, with the size string __post_init__ parses.
        def __init__(
            self, workspace_limit: int | str | None = None, deterministic: bool = False, allow_tf32: bool = True,
            allow_reduced_precision: bool = True, max_rel_error: float | None = None, prefer: str = "fastest",
            tolerance: float = 0.02, max_candidates: int | None = None, budget_s: float | None = None,
            micro_batching: bool = False, deadline_s: float | None = None,
        ) -> None: ...

    def __post_init__(self) -> None:
        if self.workspace_limit is not None:
            object.__setattr__(self, "workspace_limit", parse_bytes(self.workspace_limit, "Policy.workspace_limit"))
        for name in ("deterministic", "allow_tf32", "allow_reduced_precision", "micro_batching"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Policy.{name} must be a bool, got {getattr(self, name)!r}")
        check_one_of("Policy.prefer", self.prefer, PREFERENCES)
        _number("tolerance", self.tolerance)
        for name in ("max_rel_error", "budget_s", "deadline_s"):
            if getattr(self, name) is not None:
                _number(name, getattr(self, name))
        if self.max_candidates is not None and (isinstance(self.max_candidates, bool)
                                                or not isinstance(self.max_candidates, int)):
            raise TypeError(f"Policy.max_candidates must be an int or None, got {self.max_candidates!r}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"Policy.tolerance={self.tolerance} must be a fraction in [0, 1), e.g. 0.02 for 2%")
        if self.max_rel_error is not None and not self.max_rel_error > 0:
            raise ValueError(f"Policy.max_rel_error={self.max_rel_error} must be > 0, or None for the default")
        if self.max_candidates is not None and self.max_candidates < 1:
            raise ValueError(f"Policy.max_candidates={self.max_candidates} must be >= 1, or None for no limit")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"Policy.deadline_s={self.deadline_s} must be > 0 seconds, or None for the setting")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"Policy.budget_s={self.budget_s} must be > 0 seconds, or None for no limit")

    def violation(self, *, workspace_bytes: int, deterministic: bool, uses_tf32: bool,
                  reduced_precision: bool) -> tuple[str, str] | None:
        """(status, reason) if an algorithm with these properties breaks the policy, else None."""
        if self.workspace_limit is not None and workspace_bytes > self.workspace_limit:
            return "over_workspace_limit", f"needs {workspace_bytes} bytes of workspace, limit {self.workspace_limit}"
        if self.deterministic and not deterministic:
            return "excluded_by_policy", "not deterministic, and the policy asks for determinism"
        if not self.allow_tf32 and uses_tf32:
            return "excluded_by_policy", "uses TF32, and the policy forbids it"
        if not self.allow_reduced_precision and reduced_precision:
            return "excluded_by_policy", "accumulates in reduced precision, and the policy forbids it"
        return None


def _number(name: str, value: object) -> None:
    """Raise unless ``value`` is a finite real number (not a bool, not a tensor)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Policy.{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past the largest float
        raise ValueError(f"Policy.{name} is an integer of {int(value).bit_length()} bits, more than a float holds; "
                         f"give a finite number") from None
    if not finite:
        raise ValueError(f"Policy.{name}={value} must be finite")


DEFAULT_POLICY = Policy()
