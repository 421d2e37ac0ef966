"""Settings from the environment: a value that would make every search fail is refused with its variable's name."""

import pytest

from convtune.algorithms.fft import smooth_size
from convtune.settings import settings


@pytest.mark.parametrize("name, value", [
    ("timing_min_repeats", "0"), ("timing_max_repeats", "-3"), ("find_budget_s", "-1"), ("find_budget_s", "nan"),
    ("timing_budget_s", "0"), ("timing_rel_spread", "inf"), ("early_stop_factor", "0.5"), ("find_patience", "1.5"),
])
def test_a_setting_that_would_break_every_search_is_refused(monkeypatch, name, value):
    monkeypatch.setenv(f"CONVTUNE_{name.upper()}", value)
    with pytest.raises(ValueError, match=f"CONVTUNE_{name.upper()}"):
        getattr(settings, name)


def test_settings_in_range_are_read():
    assert settings.timing_min_repeats >= 1 and settings.find_budget_s >= 0


def test_the_fft_length_of_a_huge_problem_comes_at_once():
    # It searched one number at a time: 38 s at 10^10, no end at 10^30.
    assert smooth_size(10**10 + 1) == 10_066_329_600 and smooth_size(10**30) == 10**30
