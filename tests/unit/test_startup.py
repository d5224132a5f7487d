"""The start-up line: process start times, the launcher's two times, phases as marks, the hooks' marks."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from flux_trainer.metrics import startup
from flux_trainer.metrics.startup import (
    LAUNCHED_AT_ENV,
    SPAWNED_AT_ENV,
    SPAWNED_VIA_ENV,
    StartupClock,
    launch_env,
    process_started_at,
)
from tests.conftest import undoing

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")


@needs_proc
def test_process_start_time_of_a_child_started_now():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    after = time.time()
    with undoing(child.kill, child.wait):
        started = process_started_at(child.pid)
    assert started is not None and before - 0.05 <= started <= after + 0.05


@needs_proc
def test_this_process_started_before_now():
    started = process_started_at()
    assert started is not None and started < time.time() - 0.1  # pytest's own imports took longer than that


def test_no_such_process():
    assert process_started_at(2**30) is None


def test_phases_from_the_launcher_times():
    clock = StartupClock.from_env({LAUNCHED_AT_ENV: "100.0", SPAWNED_AT_ENV: "103.5"}, started_at=104.0)
    clock.mark("imports", at=110.0)
    clock.mark("model load", at=115.25)
    clock.mark("imports", at=200.0)  # marked again later: the first mark stays
    assert clock.phases() == [("flux-train", 3.5), ("accelerate launch", 0.5), ("imports", 6.0), ("model load", 5.25)]
    assert clock.total() == 15.25
    assert clock.line() == (
        "start-up 15.2 s to the first step's end: flux-train 3.5 s, accelerate launch 0.5 s, imports 6.0 s, "
        "model load 5.2 s"
    )


def test_phases_under_a_twentieth_of_a_second_are_left_out_of_the_line():
    clock = StartupClock(start=0.0)
    clock.mark("kernels", at=0.04)
    clock.mark("first step", at=2.0)
    assert clock.line() == "start-up 2.0 s to the first step's end: first step 2.0 s"


@pytest.mark.parametrize(
    "env",
    [
        {},  # started by hand (accelerate launch -m flux_trainer.sdscripts.runner)
        {LAUNCHED_AT_ENV: "100", SPAWNED_AT_ENV: "105"},  # accelerate started after this process: another clock
        {LAUNCHED_AT_ENV: "102", SPAWNED_AT_ENV: "101"},  # the command after its own spawn
        {LAUNCHED_AT_ENV: "100", SPAWNED_AT_ENV: "soon"},
    ],
)
def test_launcher_times_that_cannot_be_right_start_the_clock_at_this_process(env):
    clock = StartupClock.from_env(env, started_at=104.0)
    assert clock.start == 104.0 and clock.marks == []


def test_a_process_started_directly_may_read_its_start_a_tick_before_its_spawn():
    env = {LAUNCHED_AT_ENV: "100", SPAWNED_AT_ENV: "103.005", SPAWNED_VIA_ENV: "process start"}
    clock = StartupClock.from_env(env, started_at=103.0)
    assert clock.phases() == [("flux-train", pytest.approx(3.005)), ("process start", 0.0)]


def test_launcher_that_could_not_read_its_start():
    clock = StartupClock.from_env({SPAWNED_AT_ENV: "103"}, started_at=104.0)
    assert clock.start == 103.0 and clock.phases() == [("accelerate launch", 1.0)]


def test_mark_reads_the_clock():
    now = iter([7.0, 9.5])
    clock = StartupClock(start=5.0, clock=lambda: next(now))
    clock.mark("a")
    clock.mark("b")
    assert clock.phases() == [("a", 2.0), ("b", 2.5)]


@needs_proc
def test_launch_env_first_run_from_the_process_start_later_runs_from_their_own(monkeypatch):
    monkeypatch.setattr(startup, "_launches", 0)
    now = time.time()
    first = launch_env(began_at=now)
    assert float(first[LAUNCHED_AT_ENV]) == pytest.approx(process_started_at(), abs=0.02)
    assert float(first[LAUNCHED_AT_ENV]) < now - 0.1 and float(first[SPAWNED_AT_ENV]) >= now - 0.001
    second = launch_env(began_at=now + 50, spawned_at=now + 60)  # a sweep's next job
    assert second == {
        LAUNCHED_AT_ENV: f"{now + 50:.3f}",
        SPAWNED_AT_ENV: f"{now + 60:.3f}",
        SPAWNED_VIA_ENV: "accelerate launch",
    }


def test_the_hooks_mark_each_phase_and_log_the_line_after_the_first_step(tmp_path, caplog):
    """Through RunHooks as the runner calls it: each hook ends its phase; the first step's end logs the line and
    gives TensorBoard the total (once)."""
    from flux_trainer.metrics.health import LossGuard, SlowdownDetector
    from flux_trainer.metrics.step import StepMetrics
    from flux_trainer.sdscripts.hooks import RunHooks
    from flux_trainer.sdscripts.runner import RunnerSpec

    ticks = iter([12.0, 13.0, 15.0, 16.0, 17.5, 20.0, 24.0, 30.0])
    clock = StartupClock(start=10.0, clock=lambda: next(ticks))
    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path, startup=clock)
    import torch

    accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, num_processes=1)
    accelerator.get_tracker = lambda *a, **k: (_ for _ in ()).throw(ValueError("no tracker in this test"))
    h.startup.mark("settings and dataset")  # the runner's load_target_model override
    h.model_loaded(None, accelerator)
    h.caches_ready(SimpleNamespace(seed=None))
    h.optimizer_created(SimpleNamespace(param_groups=[]))
    h.before_prepare(None, SimpleNamespace(), accelerator)
    h.metrics = StepMetrics("cpu", flops_per_step=0, images_per_step=1, clock=time.perf_counter, nvml=None)
    h.metrics.start()
    h.loss_guard, h.slowdown = LossGuard(patience=3), SlowdownDetector(nvml=None)
    h.step_start(accelerator)
    with caplog.at_level(logging.INFO, logger="flux_trainer.runner"):
        tags = h.step_end(accelerator, {"loss/current": 0.5}, 1)
    expected = [
        ("settings and dataset", 2.0),
        ("model load", 1.0),
        ("caches", 2.0),
        ("LoRA and optimizer", 1.0),
        ("optimizer kernels", 1.5),
        ("kernels", 2.5),
        ("prepare", 4.0),
        ("first step", 6.0),
    ]
    assert clock.phases() == expected
    assert tags["time/startup_s"] == 20.0
    assert any(r.getMessage() == clock.line() for r in caplog.records)
    assert "time/startup_s" not in h.step_end(accelerator, {"loss/current": 0.5}, 2)
