"""Input fuzzing: whatever a user passes, ConvProblem, Policy and the command line either work or raise a
clean TypeError/ValueError (one line and exit status 2 for the CLI), never anything else."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import convtune as ct
from convtune.cli import main

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
FUZZ = hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.dictionaries(st.sampled_from(PROBLEM_FIELDS), ANYTHING, min_size=1, max_size=3))
def test_a_conv_problem_is_made_or_refused_cleanly(changes):
    try:
        p = ct.ConvProblem(**(VALID | changes))
    except (TypeError, ValueError):
        return
    assert ct.ConvProblem.from_key(p.key) == p  # what is accepted is a whole, valid problem


@FUZZ
@given(st.dictionaries(st.sampled_from(POLICY_FIELDS), ANYTHING, min_size=1, max_size=3))
def test_a_policy_is_made_or_refused_cleanly(changes):
    try:
        ct.Policy(**changes)
    except (TypeError, ValueError):
        pass


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["--n", "--c", "--k", "--size", "--kernel", "--stride", "--pad", "--groups", "--dtype",
                                 "--layout", "--workspace-limit", "--tolerance", "--max-candidates", "-1", "0", "3",
                                 "1e999", "nan", "64MiB", "9" * 40, "x", "3x3", "float16", "NHWC"]), max_size=8))
def test_the_command_line_never_reports_an_internal_error(capsys, argv):
    code = main(["get", *argv])
    err = capsys.readouterr().err
    assert code in (0, 2) and "internal error" not in err, (argv, err)


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
LAYER_KEYS = ("c", "k", "spatial", "kernel", "stride", "padding", "dilation", "groups", "count", "transposed", "name")
LAYER_VALUES = st.one_of(st.integers(-2, 2**40), st.lists(st.integers(-2, 2**33), max_size=4), JSON_VALUES)
LAYER = st.fixed_dictionaries({"c": st.integers(1, 8), "k": st.integers(1, 8), "spatial": st.integers(1, 9),
                               "kernel": st.integers(1, 3)},
                              optional={key: LAYER_VALUES for key in LAYER_KEYS[4:]})  # valid where left alone


@hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.one_of(JSON_VALUES, st.lists(LAYER, min_size=1, max_size=3),
                st.lists(st.dictionaries(st.sampled_from(LAYER_KEYS), LAYER_VALUES, max_size=6), min_size=1, max_size=2),
                st.lists(LAYER, max_size=3).map(lambda layers: {"layers": layers})))
def test_a_layer_file_of_anything_is_tuned_or_refused_in_one_line(tmp_path_factory, capsys, content):
    import json

    folder = tmp_path_factory.mktemp("layers")
    path = folder / "layers.json"
    path.write_text(json.dumps(content))
    code = main(["tune", str(path), "--mode", "get", "--device", "cpu", "--db", str(folder / "t.sqlite")])
    err = capsys.readouterr().err
    assert code in (0, 1, 2) and "internal error" not in err and "Traceback" not in err, (content, err)


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["ls", "export", "import", "clear"]),
       st.one_of(st.none(), st.sampled_from(["", ".", "/", "missing/file", "x" * 300])),  # devices: test_db
       st.binary(max_size=64))
def test_the_cache_command_on_any_path_and_file_never_reports_an_internal_error(tmp_path_factory, capsys, action,
                                                                                 path, content):
    folder = tmp_path_factory.mktemp("cache")
    given_file = folder / "given.jsonl"
    given_file.write_bytes(content)
    target = str(given_file) if path is None else path
    code = main(["cache", "--db", str(folder / "t.sqlite"), action, *([target] if action in ("export", "import") else [])])
    err = capsys.readouterr().err
    assert code in (0, 1, 2) and "internal error" not in err, (action, target, err)


SETTING_VALUES = st.one_of(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=10), st.sampled_from(["0", "-1", "1e999", "nan", "inf", "-0", "1.5", "3",
                                                                   "true", "off", "all", "plugins", " 2 ", "0x10"]))


@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([name for name, *_ in __import__("convtune.settings", fromlist=["settings"]).settings.describe()
                        if name not in ("cache_dir", "extension_dir", "learned_model", "isolate")]), SETTING_VALUES)
def test_a_setting_from_the_environment_is_read_or_refused_naming_its_variable(name, value):
    # (isolate is left out: the tests' fixture overrides it, and an override wins over the environment)
    import pytest

    from convtune.settings import settings

    variable = f"CONVTUNE_{name.upper()}"
    kind = type(getattr(settings, name))  # the default's
    with pytest.MonkeyPatch.context() as env:  # one example's variable, gone before the next
        env.setenv(variable, value)
        try:
            settings.check()
        except ValueError as exc:
            assert variable in str(exc)
        else:  # accepted: then it is read as a value of the setting's own kind, finite where a number
            read = getattr(settings, name)
            assert type(read) is kind, (value, read)
            if isinstance(read, float):
                assert math.isfinite(read)
