"""LossGuard and SlowdownDetector: trigger when they should, stay quiet when they should not."""

import math
import types

import pytest

from flux_trainer.metrics.health import LossGuard, SlowdownDetector
from flux_trainer.metrics.nvml import NvmlReader


def test_loss_guard_triggers_after_patience_once_per_streak():
    guard = LossGuard(patience=3)
    assert guard.check(0.12, 9) is None
    assert guard.check(math.nan, 10) is None
    assert guard.check(math.inf, 11) is None
    message = guard.check(float("nan"), 12)
    assert message is not None
    assert "step 12" in message and "since step 10" in message
    for cause in ("learning rate", "fp16 overflow", "bad image or caption", "fp8"):
        assert cause in message
    assert guard.check(math.nan, 13) is None  # said once for this streak


def test_loss_guard_streak_resets_on_finite_loss():
    guard = LossGuard()  # default patience 3
    results = [guard.check(v, s) for s, v in enumerate([math.nan, math.nan, 0.1, math.nan, math.nan, 0.2, -math.inf])]
    assert results == [None] * 7
    assert LossGuard(patience=1).check(-math.inf, 5) is not None
    with pytest.raises(ValueError):
        LossGuard(patience=0)


def test_slowdown_quiet_on_steady_and_single_spikes():
    det = SlowdownDetector(window=20, factor=2.0, consecutive=3, min_history=5)
    times = [1.0, 1.1, 0.9, 1.0, 1.05] * 4 + [5.0] + [1.0] * 3 + [3.0, 3.0] + [1.0]  # a save spike, a short dip
    assert [det.observe(t, i) for i, t in enumerate(times)] == [None] * len(times)


def test_slowdown_warns_after_consecutive_slow_steps_without_nvml():
    det = SlowdownDetector(window=10, factor=2.0, consecutive=3, min_history=5)
    out = [det.observe(t, i) for i, t in enumerate([1.0] * 10 + [2.5, 2.5, 2.5, 2.5])]
    assert out[:12] == [None] * 12 and out[13] is None  # once per streak
    assert "step 12" in out[12] and "2.5x the median 1.000 s" in out[12] and "3 steps in a row" in out[12]
    assert "GPU:" not in out[12]


def test_slowdown_needs_history_first():
    det = SlowdownDetector(window=50, consecutive=1, min_history=10)
    assert [det.observe(t, i) for i, t in enumerate([1.0, 9.0, 9.0, 9.0])] == [None] * 4


def test_slowdown_message_includes_gpu_clocks_and_temperature(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        NVML_CLOCK_SM=1,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=100),
        nvmlDeviceGetPowerUsage=lambda h: 700_000,
        nvmlDeviceGetTemperature=lambda h, s: 89,
        nvmlDeviceGetClockInfo=lambda h, c: 1100,
        nvmlDeviceGetMaxClockInfo=lambda h, c: 1980,
    )
    det = SlowdownDetector(window=10, consecutive=2, min_history=3, nvml=NvmlReader(0, nvml=nvml))
    out = [det.observe(t, i) for i, t in enumerate([0.5, 0.5, 0.5, 1.2, 1.3])]
    assert out[:4] == [None] * 4
    assert "SM clock 1100 MHz of 1980" in out[4] and "89 C" in out[4] and "700 W" in out[4]
    assert "throttling" in out[4]
