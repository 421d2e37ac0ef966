"""Settings from the environment: a value that would make every search fail is refused with its variable's name."""

import dataclasses
import sys

import pytest

from convtune.algorithms.fft import smooth_size
from convtune.settings import settings


@pytest.mark.parametrize("name, value", [
    ("timing_min_repeats", "0"), ("timing_max_repeats", "-3"), ("find_budget_s", "-1"), ("find_budget_s", "nan"),
    ("timing_budget_s", "0"), ("timing_rel_spread", "inf"), ("early_stop_factor", "0.5"), ("find_patience", "1.5"),
    ("find_prune_factor", "0.5"), ("find_prune_factor", "-1"),
    ("verify_seed", "99999999999999999999"), ("verify_seed", str(-2**63 - 1)),
])
def test_a_setting_that_would_break_every_search_is_refused(monkeypatch, name, value):
    monkeypatch.setenv(f"CONVTUNE_{name.upper()}", value)
    monkeypatch.setattr(settings, "_overrides", {})  # (the tests' own cache folder is an override)
    with pytest.raises(ValueError, match=f"CONVTUNE_{name.upper()}"):
        getattr(settings, name)


@pytest.mark.parametrize("name", ["cache_dir", "extension_dir", "learned_model", "cudnn_home"])
def test_a_path_with_spaces_around_it_is_refused_with_the_path_it_meant(monkeypatch, tmp_path, name):
    # (CONVTUNE_CACHE_DIR=" /data/cache" made a folder named " " below the working directory)
    monkeypatch.setattr(settings, "_overrides", {})
    monkeypatch.setenv(f"CONVTUNE_{name.upper()}", f" {tmp_path} ")
    with pytest.raises(ValueError, match=f"CONVTUNE_{name.upper()}.*whitespace; give it without: '{tmp_path}'"):
        getattr(settings, name)
    monkeypatch.setenv(f"CONVTUNE_{name.upper()}", f"{tmp_path}/a b")  # spaces inside a name are a name's
    assert getattr(settings, name) == f"{tmp_path}/a b"


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_variable_is_an_unset_one(monkeypatch, value):
    # CONVTUNE_NATIVE= (and every other setting on by default) read as off, the opposite of no variable; an empty
    # number was refused as "could not convert string to float", an empty folder refused
    from convtune.settings import _SETTINGS

    monkeypatch.setattr(settings, "_overrides", {})
    for setting in _SETTINGS:
        monkeypatch.delenv(setting.env, raising=False)
    defaults = {setting.name: getattr(settings, setting.name) for setting in _SETTINGS}
    for setting in _SETTINGS:
        monkeypatch.setenv(setting.env, value)
    assert {setting.name: getattr(settings, setting.name) for setting in _SETTINGS} == defaults
    assert settings.native is True and settings.progress is True
    settings.check()


def test_settings_in_range_are_read(monkeypatch):
    assert settings.timing_min_repeats >= 1 and settings.find_budget_s >= 0
    for value, read in (("0", 0.0), ("1", 1.0), ("2.5", 2.5)):  # the prune: off, or a factor of 1 or more
        monkeypatch.setenv("CONVTUNE_FIND_PRUNE_FACTOR", value)
        assert settings.find_prune_factor == read


def test_the_fft_length_of_a_huge_problem_comes_at_once():
    # It searched one number at a time: 38 s at 10^10, no end at 10^30.
    assert smooth_size(10**10 + 1) == 10_066_329_600 and smooth_size(10**30) == 10**30


@pytest.mark.parametrize("env", [
    {"CONVTUNE_TIMING_MIN_REPEATS": "0"}, {"CONVTUNE_ELEMENT_FACTOR": "nan"}, {"CONVTUNE_CANDIDATE_DEADLINE_S": "-5"},
    {"CONVTUNE_TIMING_MAX_REPEATS": "1"},  # in range alone, below the fewest repeats (3)
])
def test_every_entry_point_refuses_a_bad_setting_before_it_measures_anything(monkeypatch, capsys, env):
    # It made every candidate fail instead: each candidate's measurement read the setting.
    import torch

    from convtune import ConvProblem, find, get, optimize, select
    from convtune.cli import main

    problem = ConvProblem("fwd", n=1, c=3, k=4, input_size=(9, 7), kernel_size=3)  # a size no other test asks get
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    variable = next(iter(env))
    for call in (lambda: find(problem), lambda: get(problem), *(lambda mode=mode: select(problem, mode=mode)
                                                                 for mode in ("get", "find", "hybrid", "db_then_get")),
                 lambda: optimize(torch.nn.Conv2d(3, 4, 3), torch.randn(1, 3, 9, 7), mode="find")):
        with pytest.raises(ValueError, match=variable):
            call()
    assert main(["get", "--c", "3", "--k", "4", "--size", "9x7", "--device", "cpu"]) == 2
    assert variable in capsys.readouterr().err
    assert main(["settings"]) == 2  # the table still shows, the bad value among the rest, then the error
    shown = capsys.readouterr()
    assert variable in shown.err
    if variable != "CONVTUNE_TIMING_MAX_REPEATS":  # a value that does not parse is shown as given, and why
        assert f"{env[variable]!r}: " in shown.out
    assert main(["algorithms", "--c", "3", "--k", "4", "--size", "9x7", "--device", "cpu"]) == 0  # measures nothing


def test_the_defaults_pass_the_settings_check():
    settings.check()


def test_a_default_from_the_platform_is_computed_once_and_the_environment_still_wins_at_once(monkeypatch):
    from convtune import settings as settings_module

    calls = []
    fresh = settings_module.Settings()
    setting = fresh._by_name["cache_dir"]
    monkeypatch.setitem(fresh._by_name, "cache_dir", dataclasses.replace(
        setting, default=lambda: calls.append(1) or "/platform/cache"))
    monkeypatch.delenv("CONVTUNE_CACHE_DIR", raising=False)
    assert [fresh.cache_dir for _ in range(3)] == ["/platform/cache"] * 3 and calls == [1]
    monkeypatch.setenv("CONVTUNE_CACHE_DIR", "/from/env")
    assert fresh.cache_dir == "/from/env"
    with fresh.override(cache_dir="/overridden"):
        assert fresh.cache_dir == "/overridden"
    monkeypatch.delenv("CONVTUNE_CACHE_DIR")
    assert fresh.cache_dir == "/platform/cache" and calls == [1]
    monkeypatch.setenv("HOME", "/another/home")  # the platform's folders follow it: worked out again
    assert fresh.cache_dir == "/platform/cache" and calls == [1, 1]


@pytest.mark.skipif(sys.platform != "linux", reason="platformdirs reads XDG_CACHE_HOME on Linux")
def test_the_user_cache_folder_follows_the_home_folder_and_xdg(tmp_path, monkeypatch):
    from convtune import settings as settings_module

    fresh = settings_module.Settings()
    monkeypatch.delenv("CONVTUNE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "a"))
    first = fresh.cache_dir
    monkeypatch.setenv("HOME", str(tmp_path / "b"))
    second = fresh.cache_dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    third = fresh.cache_dir
    assert len({first, second, third}) == 3 and str(tmp_path / "b") in second and str(tmp_path / "xdg") in third


def test_the_learned_models_path_follows_its_settings_and_the_home_folder(tmp_path, monkeypatch):
    from convtune import learned

    monkeypatch.setenv("HOME", str(tmp_path))
    with settings.override(learned_model="", cache_dir=str(tmp_path / "c")):
        assert learned.default_path("cuda") == tmp_path / "c" / "learned_get_cuda.pt"
    with settings.override(learned_model="~/m_{device}.pt"):
        assert learned.default_path("cpu") == tmp_path / "m_cpu.pt"
        monkeypatch.setenv("HOME", str(tmp_path / "other"))
        assert learned.default_path("cpu") == tmp_path / "other" / "m_cpu.pt"


def test_a_seed_past_pytorchs_generators_is_refused_with_its_name():
    # (it reached torch.Generator.manual_seed deep in the first candidate's check: "Overflow when unpacking long long")
    import convtune as ct

    p = ct.ConvProblem("fwd", n=1, c=2, k=2, input_size=(5, 5), kernel_size=3)
    with pytest.raises(ValueError, match=r"got find\(seed=1180591620717411303424\)"):
        ct.find(p, seed=2**70)
    assert ct.find(p, seed=2**63 - 1)[0].ok and ct.find(p, seed=-2**63)[0].ok and ct.find(p, seed=-1)[0].ok


@pytest.mark.parametrize("name, value", [("CONVTUNE_CANDIDATE_DEADLINE_S", "600000"),  # a week: "no limit"
                                         ("CONVTUNE_TIMING_BUDGET_S", "1e300")])
def test_a_long_deadline_or_timing_budget_holds_in_a_worker_process_too(monkeypatch, name, value):
    # The worker's limit (4 deadlines and 10 timing budgets) was waited for in one poll: past 24.8 days the wait
    # raised OverflowError, and find failed with it ('convtune find': internal error).
    import adversaries
    import convtune as ct
    from convtune import isolation

    monkeypatch.setenv(name, value)
    problem = ct.ConvProblem("fwd", n=1, c=2, k=2, input_size=(6, 6), kernel_size=3)
    try:
        with settings.override(isolate="plugins", timing_min_repeats=1, timing_max_repeats=2):
            results = ct.find(problem, candidates=[adversaries.Correct()])
    finally:
        isolation._worker.close()
    assert results[0].ok, results[0].message
    # a Policy's deadline may be an int no float sum of it holds (4 x 2**1023): capped all the same
    assert isolation.hard_limit_s(2**1023, None) == isolation.MAX_WAIT_S


def test_an_override_of_an_empty_value_is_refused_by_name():
    # An empty environment variable is an unset one; an override of '' would set what no variable can
    # (cache_dir='' put the database in the current folder; native='' turned the runtime off).
    for name in ("cache_dir", "native"):
        with pytest.raises(ValueError, match=rf"settings.override\({name}=''\): an empty value"):
            with settings.override(**{name: ""}):
                pass
