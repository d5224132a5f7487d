"""flux_kernels.runtime.timing on the CPU: warm-up calls untimed, `reps` calls per round, the median over rounds."""

from __future__ import annotations

import time

import pytest
import torch

from flux_kernels.runtime.timing import cold_l2_ms, median_ms, queued_ms


def test_queued_ms_times_reps_calls_per_round_after_the_warmup():
    calls = []

    def fn():
        calls.append(len(calls))
        time.sleep(0.002 if len(calls) > 2 else 0.05)  # the two warm-up calls are slow and must not count

    ms = queued_ms(fn, torch.device("cpu"), warmup=2, reps=4, rounds=3)
    assert len(calls) == 2 + 4 * 3
    assert 1.9 <= ms < 10  # per call: the 2 ms sleep and loop overhead, never the 50 ms warm-up


def test_median_ms_still_times_single_calls():
    calls = []
    ms = median_ms(lambda: (calls.append(1), time.sleep(0.002)), torch.device("cpu"), warmup=1, reps=3)
    assert len(calls) == 4 and 1.9 <= ms < 10


def test_cold_l2_ms_times_single_calls_after_the_warmup_and_takes_the_median():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.05 if len(calls) in (1, 5) else 0.002)  # the warm-up call, and one slow timed call

    ms = cold_l2_ms(fn, torch.device("cpu"), warmup=1, reps=5)
    assert len(calls) == 6 and 1.9 <= ms < 10  # the median, not the mean the slow call would pull up


def test_sustained_counts_calls_over_the_measured_seconds_and_charges_them_the_counters_joules():
    """Calls kept running for a while: the energy a call is the counter's rise over the measured calls only (not the
    settling ones), the watts that rise over the measured seconds; without a counter, time only."""
    from flux_kernels.runtime.timing import sustained

    counter = {"j": 100.0, "calls": 0}

    def fn():  # each call burns 0.5 J on the stand-in counter and takes ~2 ms
        counter["calls"] += 1
        counter["j"] += 0.5
        time.sleep(0.002)

    r = sustained(fn, secs=0.05, energy_j=lambda: counter["j"], settle_s=0.02)
    assert r["j"] == pytest.approx(0.5)  # the settling calls' joules are left out
    assert 2.0 <= r["ms"] < 20.0 and r["w"] == pytest.approx(0.5 / (r["ms"] / 1e3), rel=0.05)
    assert counter["calls"] >= 1 + 0.05 / 0.02  # the first call, the settling ones, at least the measured seconds'
    bare = sustained(fn, secs=0.0, settle_s=0.0)
    assert bare["j"] is None and bare["w"] is None and bare["ms"] >= 2.0  # one call at least, timed
