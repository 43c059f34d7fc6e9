"""The spike sentinel (pure): a robust running baseline, a jump test, thresholds validated."""

from __future__ import annotations

import math
import random

import pytest

from screener.audit.sentinel import Sentinel, SentinelConfig


def _noisy(n: int, seed: int = 0, level: float = 2.0, spread: float = 0.05) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_nothing_fires_during_the_warm_up_or_on_noise():
    s = Sentinel()
    for loss, grad in zip(_noisy(500), _noisy(500, seed=1, level=0.3)):
        assert s.check(loss, grad) is None
    assert s.fired == 0


def test_a_slowly_falling_loss_and_a_noisy_gradient_never_fire():
    s = Sentinel()
    rng = random.Random(3)
    for i in range(2000):
        loss = 8.0 * math.exp(-i / 400) + 1.0
        grad = 0.5 * math.exp(-i / 800) * (1 + rng.uniform(-0.5, 0.5))
        assert s.check(loss, grad) is None, i


@pytest.mark.parametrize("what", ["loss", "grad"])
def test_a_jump_fires_and_does_not_move_the_baseline(what):
    s = Sentinel()
    for loss, grad in zip(_noisy(50), _noisy(50, seed=1, level=0.3)):
        s.check(loss, grad)
    spike = s.check(2.0 * (6 if what == "loss" else 1), 0.3 * (1e6 if what == "grad" else 1))
    assert spike is not None and spike.what == what and spike.value / spike.median > 5
    # the spike was not added: the next ordinary step does not fire, a second spike still does
    assert s.check(2.0, 0.3) is None
    assert s.check(2.0 * (6 if what == "loss" else 1),
                   0.3 * (1e6 if what == "grad" else 1)) is not None
    assert s.fired == 2


def test_an_exponent_flip_on_one_element_shows_in_the_gradients_magnitude():
    """The largest magnitude of a gradient near 0.3 whose top exponent bit flipped is ~1e37."""
    s = Sentinel()
    for loss, grad in zip(_noisy(30), _noisy(30, seed=1, level=0.3)):
        s.check(loss, grad)
    assert s.check(2.0, 1.0e37) is not None


def test_a_spike_the_data_explains_may_join_the_baseline():
    s = Sentinel(SentinelConfig(warmup=5, window=10))
    for _ in range(10):
        s.check(1.0, 1.0)
    assert s.check(1.0, 100.0) is not None
    for _ in range(10):  # the data's new level, accepted after attribution each time
        s.accept("grad", 100.0)
    assert s.check(1.0, 100.0) is None


def test_off_means_off():
    s = Sentinel(SentinelConfig(enabled=False))
    for _ in range(50):
        s.check(1.0, 1.0)
    assert s.check(1e9, 1e9) is None


@pytest.mark.parametrize("kwargs", [{"ratio": 1.0}, {"ratio": float("nan")}, {"z": True},
                                    {"warmup": 1}, {"window": 10 ** 9}, {"on_data": "ignore"},
                                    {"ratio": "5"}])
def test_thresholds_are_validated_in_one_line(kwargs):
    with pytest.raises(ValueError, match="sentinel"):
        SentinelConfig(**kwargs)


def test_the_rerun_verdicts():
    from screener.audit.sentinel import rerun_verdict

    # (loss bits, magnitude bits, digest): the step is compared by its gradient's magnitude
    spike, clean, other = (1, 99, 5, 5), (1, 2, 6, 6), (1, 3, 7, 7)
    assert rerun_verdict((1, 99), spike, [spike, spike]) == "data"
    assert rerun_verdict((1, 99), spike, [clean, clean]) == "persistent"
    assert rerun_verdict((1, 99), clean, [clean, clean]) == "transient"
    assert rerun_verdict((1, 99), clean, [clean, None]) == "transient"  # no referee
    assert rerun_verdict((1, 99), clean, [other, clean]) == "unsettled"
    assert rerun_verdict((1, 99), spike, [clean, other]) == "unsettled"
    assert rerun_verdict((1, 99), clean, [spike, spike]) == "unsettled"
    assert rerun_verdict((1, 99), spike, []) == "data"
    assert rerun_verdict((1, 99), clean, []) == "unsettled"
    # a loss summed differently by the loop (float64 .item()s) is no fault: the gradient matches
    assert rerun_verdict((7, 99), spike, [spike, spike]) == "data"
