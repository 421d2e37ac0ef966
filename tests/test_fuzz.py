"""Input fuzzing: whatever a user passes, ConvProblem, Policy and the command line either work or raise a
clean TypeError/ValueError (one line and exit status 2 for the CLI), never anything else.

Each property is a check of one input (True: handled cleanly) with the strategy that makes inputs for it
and how many to try (``PROPERTIES``): the tests below assert it on every input, and
``bench/reliability.py`` counts its outcomes (tried / clean / unclean / crashes) for the reliability report.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import convtune as ct
from convtune.cli import main
from convtune.settings import settings

ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(min_value=-3, max_value=2**40), max_size=4).map(tuple),
    st.dictionaries(st.integers(0, 9), st.integers(0, 9), max_size=3), st.sets(st.integers(0, 9), max_size=3),
    st.just(torch.tensor([3])), st.just(math.inf),
)
PROBLEM_FIELDS = ("direction", "n", "c", "k", "input_size", "kernel_size", "stride", "padding", "dilation", "groups",
                  "dtype", "layout", "device", "allow_tf32")
POLICY_FIELDS = ("workspace_limit", "deterministic", "allow_tf32", "allow_reduced_precision", "max_rel_error", "prefer",
                 "tolerance", "max_candidates", "budget_s", "micro_batching", "deadline_s")
VALID = dict(direction="fwd", n=1, c=2, k=2, input_size=(6, 6), kernel_size=3)


def conv_problem(changes: dict) -> bool:
    try:
        p = ct.ConvProblem(**(VALID | changes))
    except (TypeError, ValueError):
        return True
    return ct.ConvProblem.from_key(p.key) == p  # what is accepted is a whole, valid problem


def policy(changes: dict) -> bool:
    try:
        ct.Policy(**changes)
    except (TypeError, ValueError):
        pass
    return True


def _cli(argv: list[str], codes: tuple[int, ...]) -> bool:
    """The command line's exit status is one of ``codes`` and it reports no internal error."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code in codes and "internal error" not in err.getvalue() and "Traceback" not in err.getvalue()


def command_line(argv: list[str]) -> bool:
    return _cli(["get", *argv], (0, 2))


def layer_file(content: Any) -> bool:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "layers.json"
        path.write_text(json.dumps(content))
        return _cli(["tune", str(path), "--mode", "get", "--device", "cpu", "--db", str(Path(folder) / "t.sqlite")],
                    (0, 1, 2))


def cache_command(case: tuple[str, str | None, bytes]) -> bool:
    action, path, content = case
    with tempfile.TemporaryDirectory() as folder:
        given_file = Path(folder) / "given.jsonl"
        given_file.write_bytes(content)
        target = str(given_file) if path is None else path
        return _cli(["cache", "--db", str(Path(folder) / "t.sqlite"), action,
                     *([target] if action in ("export", "import") else [])], (0, 1, 2))


def environment_setting(case: tuple[str, str]) -> bool:
    name, value = case
    variable = f"CONVTUNE_{name.upper()}"
    kind = type(getattr(settings, name))  # the default's
    with pytest.MonkeyPatch.context() as env:  # one example's variable, gone before the next
        env.setenv(variable, value)
        try:
            settings.check()
        except ValueError as exc:
            return variable in str(exc)
        read = getattr(settings, name)  # accepted: then read as a value of the setting's own kind, finite
        return type(read) is kind and (not isinstance(read, float) or math.isfinite(read))


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
LAYER_KEYS = ("c", "k", "spatial", "kernel", "stride", "padding", "dilation", "groups", "count", "transposed", "name")
LAYER_VALUES = st.one_of(st.integers(-2, 2**40), st.lists(st.integers(-2, 2**33), max_size=4), JSON_VALUES)
LAYER = st.fixed_dictionaries({"c": st.integers(1, 8), "k": st.integers(1, 8), "spatial": st.integers(1, 9),
                               "kernel": st.integers(1, 3)},
                              optional={key: LAYER_VALUES for key in LAYER_KEYS[4:]})  # valid where left alone
SETTING_VALUES = st.one_of(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                                   max_size=10),
                           st.sampled_from(["0", "-1", "1e999", "nan", "inf", "-0", "1.5", "3", "true", "off", "all",
                                            "plugins", " 2 ", "0x10"]))
# (isolate is left out: the tests' fixture overrides it, and an override wins over the environment)
FUZZED_SETTINGS = [name for name, *_ in settings.describe()
                   if name not in ("cache_dir", "extension_dir", "learned_model", "isolate")]

# name -> (the strategy of inputs, how many to try, the check)
PROPERTIES: dict[str, tuple[Any, int, Callable[[Any], bool]]] = {
    "ConvProblem": (st.dictionaries(st.sampled_from(PROBLEM_FIELDS), ANYTHING, min_size=1, max_size=3), 300,
                    conv_problem),
    "Policy": (st.dictionaries(st.sampled_from(POLICY_FIELDS), ANYTHING, min_size=1, max_size=3), 300, policy),
    "convtune get (arguments)": (
        st.lists(st.sampled_from(["--n", "--c", "--k", "--size", "--kernel", "--stride", "--pad", "--groups", "--dtype",
                                  "--layout", "--workspace-limit", "--tolerance", "--max-candidates", "-1", "0", "3",
                                  "1e999", "nan", "64MiB", "9" * 40, "x", "3x3", "float16", "NHWC"]), max_size=8),
        60, command_line),
    "convtune tune (layer files)": (
        st.one_of(JSON_VALUES, st.lists(LAYER, min_size=1, max_size=3),
                  st.lists(st.dictionaries(st.sampled_from(LAYER_KEYS), LAYER_VALUES, max_size=6), min_size=1,
                           max_size=2),
                  st.lists(LAYER, max_size=3).map(lambda layers: {"layers": layers})),
        80, layer_file),
    "convtune cache (paths, files)": (
        st.tuples(st.sampled_from(["ls", "export", "import", "clear"]),
                  st.one_of(st.none(), st.sampled_from(["", ".", "/", "missing/file", "x" * 300])),  # devices: test_db
                  st.binary(max_size=64)),
        40, cache_command),
    "settings (environment)": (st.tuples(st.sampled_from(FUZZED_SETTINGS), SETTING_VALUES), 200, environment_setting),
}


@pytest.mark.parametrize("name", list(PROPERTIES))
def test_every_input_is_handled_or_refused_cleanly(name):
    strategy, examples, check = PROPERTIES[name]

    @hsettings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy)
    def each(value):
        assert check(value), value

    each()
