"""Every setting of convtune in one typed place.

Each setting has a default, a ``CONVTUNE_*`` environment variable and a one-line comment.
Read them through ``settings.<name>``; tests change them for a scope with ``settings.override``::

    >>> from convtune.settings import settings
    >>> with settings.override(verify_seed=7):
    ...     settings.verify_seed
    7
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _cache_dir_default() -> str:
    import platformdirs

    return platformdirs.user_cache_dir("convtune")


def _extension_dir_default() -> str:
    import platformdirs

    return str(Path(platformdirs.user_cache_dir("convtune")) / "extension")


# The environment the platform's folders come from (platformdirs: XDG on Linux, the home folder elsewhere): a default
# computed from the platform is worked out again where one of them changes.
_PLATFORM_ENV = ("HOME", "XDG_CACHE_HOME", "LOCALAPPDATA", "USERPROFILE")


def _compile_threads_default() -> int:
    return min(8, (os.cpu_count() or 2) // 2)


@dataclasses.dataclass(frozen=True)
class _Setting:
    name: str
    parse: Callable[[str], Any]
    default: Any  # a value, or a zero-argument callable computing it
    doc: str

    @property
    def env(self) -> str:
        return "CONVTUNE_" + self.name.upper()


def _at_least(low: float, kind: type = float, above: bool = False) -> Callable[[str], Any]:
    """A parser of finite ``kind`` values >= ``low`` (> ``low`` where ``above``)."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not math.isfinite(value) or value < low or (above and value == low):
            raise ValueError(f"expected a finite number {'>' if above else '>='} {low}, got {text!r}")
        return value
    return parse


def _seed(text: str) -> int:
    """A parser of a random generator's seed (``check_seed``)."""
    return check_seed(int(text), repr(text))


def check_seed(seed: int, shown: str) -> int:
    """``seed`` where it is a signed 64-bit integer (PyTorch's generators take -2**63 to 2**64 - 1, and each
    verification case adds its number to the seed); ``ValueError`` naming it as ``shown``."""
    if not -2**63 <= seed < 2**63:
        raise ValueError(f"expected an integer from -2**63 to 2**63 - 1 (a random generator's seed), got {shown}")
    return seed


def _off_or_at_least(low: float) -> Callable[[str], float]:
    """A parser of 0 (the rule off) or a finite number >= ``low``."""
    def parse(text: str) -> float:
        value = float(text)
        if value != 0 and not (math.isfinite(value) and value >= low):
            raise ValueError(f"expected 0 (off) or a finite number >= {low:g}, got {text!r}")
        return value
    return parse


def _path(text: str) -> str:
    """A file or folder's path as given, refused where spaces begin or end it: a quoting mistake far more often
    than a name (' /data/cache' is a folder named ' ' below the working directory)."""
    if text != text.strip():
        raise ValueError(f"the path {text!r} begins or ends with whitespace; give it without: {text.strip()!r}")
    return text


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return value
    return parse


_SETTINGS = (
    # where the tuning database lives unless a path is given
    _Setting("cache_dir", _path, _cache_dir_default, "folder of tuning.sqlite"),
    # seed of the random inputs that verification uses
    _Setting("verify_seed", _seed, 0, "seed of verification inputs"),
    # every element of a result within this many tolerances of the reference, scaled by |ref| + rms (0: no bound)
    _Setting("element_factor", _at_least(0), 5.0, "the element bound, in tolerances (0: the norm alone)"),
    # wall-clock budget of one find() in seconds (0: no limit)
    _Setting("find_budget_s", _at_least(0), 0.0, "seconds one find may spend"),
    # most candidates one find() times (0: no limit)
    _Setting("find_max_candidates", _at_least(0, int), 0, "candidates one find may time"),
    # the search ends once this many candidates in a row were no faster than the best (0: never)
    _Setting("find_patience", _at_least(0, int), 8, "candidates in a row without a new best that end a find"),
    # after the search converged, a candidate that one of the measured problems most like this one (get's learned
    # model) timed within this factor of its own best still runs (0: none does)
    _Setting("find_contender_factor", _off_or_at_least(1), 1.1,
             "a candidate near a similar problem's best runs after convergence"),
    # a candidate predicted this many times slower than the best measured is not run (0: never)
    _Setting("find_prune_factor", _off_or_at_least(1), 10.0, "predicted slowdown that skips a candidate"),
    # threads compiling the next candidates' Triton kernels while find measures the current one (0: none, each
    # compiles when it first runs)
    _Setting("find_compile_threads", _at_least(0, int), _compile_threads_default,
             "threads that compile Triton candidates ahead"),
    # the background worker starts a measurement only once no problem has been queued for this long: a training
    # step that meets a new shape queues its layers' problems as it runs, and the worker's Python would otherwise
    # compete with the rest of that step for the interpreter (0: at once)
    _Setting("background_settle_s", _at_least(0), 0.1, "seconds without a new problem before measuring starts"),
    # a candidate still running its checks past this is a timeout, not timed; the timing ends at it (0: none)
    _Setting("candidate_deadline_s", _at_least(0), 60.0, "seconds a candidate's measurement may take"),
    # a candidate whose time exceeds the best so far by this factor stops being timed
    _Setting("early_stop_factor", _at_least(1), 1.5, "slowdown that ends a candidate's timing"),
    # target seconds of timing per candidate
    _Setting("timing_budget_s", _at_least(0, above=True), 0.25, "seconds the timer spends per candidate"),
    # repeats the timer takes at least
    _Setting("timing_min_repeats", _at_least(1, int), 3, "fewest timed repeats"),
    # repeats the timer takes at most
    _Setting("timing_max_repeats", _at_least(1, int), 50, "most timed repeats"),
    # stop repeating once (p75 - p25) / median is below this
    _Setting("timing_rel_spread", _at_least(0, above=True), 0.05, "spread that ends repeats"),
    # one sample's calls last about this long (ms): long against the events' resolution, and a CUDA graph holds them
    # (0.25: on an H100, 1 ms samples took 2.3x the timer's time and picked no better: bench/results/timer_methods.md)
    _Setting("timing_sample_ms", _at_least(0, above=True), 0.25, "length of one timed sample, ms"),
    # on CUDA a call at least this long (ms) is timed in an eager loop, not a captured graph (0: always a graph); the
    # length is the sizing calls' (eager, launches included), or the first call's where that took 50 ms or more
    _Setting("timing_eager_above_ms", _at_least(0), 0.0, "calls this long are timed without a CUDA graph (0: never)"),
    # on CUDA a captured graph holds at most this many calls and a sample replays it as often as its calls need (0: the
    # graph holds all a sample's calls; 16 saved 12% of the timer's time on an H100, a capture's fixed cost being most
    # of it: timer_methods.md)
    _Setting("timing_graph_calls", _at_least(0, int), 0, "most calls one captured graph holds (0: a whole sample's)"),
    # built cuDNN execution plans launch through the frontend's C++ graph, skipping its per-call Python checks
    # (read when a cuDNN execution plan first runs in the process)
    _Setting("cudnn_direct", _bool, True, "cuDNN execution plans launch without the frontend's Python layer"),
    # tuned layers run through convtune's C++ extension (built on first use; 0: the Python path)
    _Setting("native", _bool, True, "tuned layers run through the C++ extension"),
    # a layer whose measured GPU gain is below the host time its path adds calls PyTorch instead
    _Setting("host_rule", _bool, True,
             "layers that gain less than their host cost call PyTorch; ties go to the path cheaper on the host"),
    # which candidates find measures in a worker process (isolation.py): plugins, all or off
    _Setting("isolate", _one_of("plugins", "all", "off"), "plugins", "candidates measured in a worker process"),
    # the learned cost model get uses ('' : learned_get_<device>.pt beside the database; {device} is replaced)
    _Setting("learned_model", _path, "", "file of the learned cost model"),
    # convtune's own Triton kernels (triton:*) are candidates wherever they support a problem
    _Setting("triton", _bool, True, "convtune's Triton kernels join the portfolio"),
    # where the C++ extension is built and cached (one folder per sources and software versions)
    _Setting("extension_dir", _path, _extension_dir_default, "folder of the C++ extension's builds"),
    # a folder with cuDNN's include/cudnn.h and lib/libcudnn.so*, looked in first by the C++ build ('': where
    # PyTorch's nvidia-cudnn wheel put them, then /usr/local/cuda and /usr)
    _Setting("cudnn_home", _path, "", "folder of cuDNN's headers and library for the C++ build"),
    # show a progress bar in the command line
    _Setting("progress", _bool, True, "progress bars in the CLI"),
)


class Settings:
    """Typed access to the settings; environment variables are read on every access, a default computed from the
    platform (the user's cache folder, the CPU count) once per value of the variables it follows (``_PLATFORM_ENV``)."""

    def __init__(self) -> None:
        self._overrides: dict[str, Any] = {}
        self._computed: dict[tuple, Any] = {}  # defaults computed from the platform (``_Setting.default`` callables)
        self._by_name = {s.name: s for s in _SETTINGS}

    def __getattr__(self, name: str) -> Any:
        by_name = self.__dict__.get("_by_name", {})
        if name not in by_name:
            raise AttributeError(f"convtune has no setting {name!r}; known: {sorted(by_name)}")
        if name in self._overrides:
            return self._overrides[name]
        setting = by_name[name]
        raw = os.environ.get(setting.env)
        # an empty variable is an unset one, as most tools read it: CONVTUNE_NATIVE= is the default (on), not off,
        # and CONVTUNE_CACHE_DIR= the default folder, not the one the process runs in
        if raw is not None and raw.strip():
            try:
                return setting.parse(raw)
            except ValueError as exc:
                raise ValueError(f"environment variable {setting.env}={raw!r} is invalid: {exc}") from None
        if not callable(setting.default):
            return setting.default
        key = (name, *map(os.environ.get, _PLATFORM_ENV))  # the platform's folders follow these
        if key not in self._computed:
            self._computed[key] = setting.default()
        return self._computed[key]

    @contextlib.contextmanager
    def override(self, **values: Any) -> Iterator[None]:
        """Set settings for the duration of a ``with`` block (tests use this)."""
        unknown = set(values) - set(self._by_name)
        if unknown:
            raise AttributeError(f"convtune has no setting(s) {sorted(unknown)}")
        blank = sorted(name for name, value in values.items() if isinstance(value, str) and not value.strip()
                       and self._by_name[name].default != "")  # ('' is the default of some: learned_model's)
        if blank:  # (an empty variable reads as unset; an override of nothing would set something else)
            raise ValueError(f"settings.override({blank[0]}={values[blank[0]]!r}): an empty value; give a value, or "
                             f"leave the setting out for its default")
        saved = dict(self._overrides)
        self._overrides.update(values)
        try:
            yield
        finally:
            self._overrides = saved

    def check(self) -> None:
        """Read every setting now and check those that bound each other; raises ValueError naming the setting.

        ``get``, ``find`` and ``select``'s model answer call this before they ask any candidate anything (so
        ``optimize`` and the command line do too): a setting read while a candidate is described or measured
        must not fail there, where it would be that candidate's failure (and every other's) instead of the
        clear error it is. An answer from the database reads none of them and checks nothing.
        """
        for setting in _SETTINGS:
            getattr(self, setting.name)
        low, high = self.timing_min_repeats, self.timing_max_repeats
        if high < low:
            raise ValueError(f"timing_max_repeats ({high}, CONVTUNE_TIMING_MAX_REPEATS) is below timing_min_repeats "
                             f"({low}, CONVTUNE_TIMING_MIN_REPEATS): make the most repeats at least the fewest")

    def overrides(self) -> dict[str, Any]:
        """The values ``override`` has set now (a worker process takes them along; the environment it inherits)."""
        return dict(self._overrides)

    def describe(self) -> list[tuple[str, str, Any, str]]:
        """(name, environment variable, current value, meaning) for every setting; an environment value that
        does not parse shows as that value and why (``check`` raises for it)."""
        return [(s.name, s.env, self._shown(s), s.doc) for s in _SETTINGS]

    def _shown(self, setting: _Setting) -> Any:
        try:
            return getattr(self, setting.name)
        except ValueError as exc:
            return f"{os.environ.get(setting.env)!r}: {exc}"

    @property
    def db_path(self) -> Path:
        return Path(self.cache_dir).expanduser() / "tuning.sqlite"  # CONVTUNE_CACHE_DIR=~/...: the home folder


settings = Settings()
