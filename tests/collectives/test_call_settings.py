"""CallSettings.of: the same arguments give the same immutable settings (kept, not rebuilt), and
what it keeps stays bounded and never hides an argument's error."""

import pytest

from cgx2.collectives import CallSettings, call_settings


@pytest.fixture
def nothing_kept():
    call_settings._kept.cache_clear()
    yield call_settings._kept
    call_settings._kept.cache_clear()


def test_the_same_arguments_give_the_same_settings(nothing_kept):
    first = CallSettings.of(4, 512, "avg", None, False, "hadamard", 128)
    assert CallSettings.of(4, 512, "avg", None, False, "hadamard", 128) is first
    assert first == CallSettings(4, 512, "avg", None, False, first.rotation)
    assert first.rotation_name == "hadamard" and first.rotation_block == 128
    others = [
        CallSettings.of(3, 512, "avg", None, False, "hadamard", 128),
        CallSettings.of(4, 256, "avg", None, False, "hadamard", 128),
        CallSettings.of(4, 512, "sum", None, False, "hadamard", 128),
        CallSettings.of(4, 512, "avg", 7, False, "hadamard", 128),
        CallSettings.of(4, 512, "avg", None, True, "hadamard", 128),
        CallSettings.of(4, 512, "avg", None, False, None, 128),
        CallSettings.of(4, 512, "avg", None, False, "hadamard", 64),
    ]
    assert all(other != first for other in others)
    assert len(set(others)) == len(others)


def test_a_bad_rotation_raises_every_time(nothing_kept):
    for _ in range(2):
        with pytest.raises(ValueError, match="rotation_block"):
            CallSettings.of(4, 512, rotation="hadamard", rotation_block=100)
    assert nothing_kept.cache_info().currsize == 0


def test_what_is_kept_stays_bounded_and_unhashable_seeds_are_built(nothing_kept):
    for seed in range(3 * call_settings.KEPT_SETTINGS):
        assert CallSettings.of(4, 512, seed=seed).seed == seed
    assert nothing_kept.cache_info().currsize == call_settings.KEPT_SETTINGS

    class Traced:  # as a SymInt: no hash
        __hash__ = None

    seed = Traced()
    assert CallSettings.of(4, 512, seed=seed).seed is seed
    assert nothing_kept.cache_info().currsize == call_settings.KEPT_SETTINGS
