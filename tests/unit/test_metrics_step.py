"""StepMetrics with a fake clock (exact numbers), the CUDA path with torch.cuda faked, NVML absent/present."""

import logging
import types

import pytest
import torch

from flux_trainer.metrics.nvml import NvmlReader
from flux_trainer.metrics.step import StepMetrics, reduce_max_across_ranks

GIB = 1 << 30


class FakeClock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.times.pop(0)


def test_exact_times_and_throughput():
    clock = FakeClock(0.0, 0.25, 1.0, 1.5, 3.0)
    m = StepMetrics("cpu", flops_per_step=100e12, images_per_step=4, peak_tflops=200.0, clock=clock, nvml=None)
    m.start()  # 0.0
    m.mark_data_ready()  # 0.25
    m.mark_data_ready()  # second micro-batch: not counted, no clock read
    t1 = m.on_step_end(1)  # 1.0
    assert t1["time/step_s"] == 1.0
    assert t1["time/data_s"] == 0.25
    assert t1["throughput/images_per_s"] == 4.0
    assert t1["throughput/tflops"] == pytest.approx(100.0)
    assert t1["throughput/mfu"] == pytest.approx(0.5)
    m.mark_data_ready()  # 1.5
    t2 = m.on_step_end(2)  # 3.0
    assert (t2["time/step_s"], t2["time/data_s"], t2["throughput/images_per_s"]) == (2.0, 0.5, 2.0)
    assert t2["throughput/tflops"] == pytest.approx(50.0)
    assert clock.times == [] and clock.calls == 5


def test_several_processes_add_the_images_per_second_of_all_of_them():
    m = StepMetrics("cpu", flops_per_step=1e12, images_per_step=2, clock=FakeClock(0.0, 0.5), nvml=None, processes=3)
    m.start()
    tags = m.on_step_end(1)
    assert tags["throughput/images_per_s"] == 4.0 and tags["throughput/images_per_s_all_ranks"] == 12.0
    one = StepMetrics("cpu", flops_per_step=1e12, images_per_step=2, clock=FakeClock(0.0, 0.5), nvml=None)
    one.start()
    assert "throughput/images_per_s_all_ranks" not in one.on_step_end(1)


def test_cpu_tags_first_step_and_no_peak():
    m = StepMetrics("cpu", flops_per_step=1e12, images_per_step=1, clock=FakeClock(5.0, 6.0), nvml=None)
    first = m.on_step_end(1)  # no start(): nothing to time from
    assert {k: first[k] for k in ("vram/allocated_gib", "vram/reserved_gib", "vram/peak_gib")} == dict.fromkeys(
        ("vram/allocated_gib", "vram/reserved_gib", "vram/peak_gib"), 0.0
    )
    assert not any(k.startswith(("time/", "throughput/", "gpu/")) for k in first)
    assert 0.001 < first["host/ram_gib"] < 1024  # this process' RSS
    second = m.on_step_end(2)
    assert second["time/step_s"] == 1.0
    assert "throughput/mfu" not in second  # peak unknown


def test_log_every_averages_over_the_interval():
    clock = FakeClock(0.0, 0.5, 1.0, 1.25, 3.0, 4.0, 8.0)
    m = StepMetrics("cpu", 1e12, 2, clock=clock, nvml=None, log_every=2)
    m.start()
    m.mark_data_ready()  # waited 0.5
    assert m.on_step_end(1) == {}
    m.mark_data_ready()  # waited 0.25
    tags = m.on_step_end(2)
    assert (tags["time/step_s"], tags["time/data_s"]) == (1.5, 0.375)  # (3.0 - 0.0) / 2, (0.5 + 0.25) / 2
    assert m.on_step_end(3) == {}
    tags = m.on_step_end(4)
    assert tags["time/step_s"] == 2.5 and tags["throughput/images_per_s"] == 0.8
    with pytest.raises(ValueError, match="log_every"):
        StepMetrics("cpu", 1, 1, log_every=0)


def test_disabled_does_nothing():
    clock = FakeClock()
    m = StepMetrics("cpu", 1, 1, enabled=False, clock=clock)
    m.start()
    m.mark_data_ready()
    assert m.on_step_end(1) == {}
    assert clock.calls == 0 and m.nvml is None


def test_cuda_path_reads_allocator_resets_peak_and_never_syncs(monkeypatch):
    calls = []

    def stats(dev):  # the allocator's nested dict, as torch.cuda.memory_stats_as_nested_dict gives it
        calls.append(("stats", dev))
        return {
            "allocated_bytes": {"all": {"current": 2 * GIB, "peak": 5 * GIB}, "small_pool": {"current": 1}},
            "reserved_bytes": {"all": {"current": 3 * GIB, "peak": 6 * GIB}},
            "num_alloc_retries": retries.pop(0),
            "num_ooms": 0,
        }

    def flattening(*_a, **_k):
        raise AssertionError("one read of the nested dict, not memory_stats()'s flattened copy per value")

    fake = {
        "memory_allocated": flattening,
        "memory_reserved": flattening,
        "max_memory_allocated": flattening,
        "memory_stats": flattening,
        "reset_peak_memory_stats": lambda dev: calls.append(("reset", dev)),
        "memory_stats_as_nested_dict": stats,
    }
    retries = [2, 2, 7]  # cumulative, as PyTorch counts them
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)

    def no_sync(*_a, **_k):
        raise AssertionError("StepMetrics must not synchronise the device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    m = StepMetrics("cuda:1", 1e12, 1, clock=FakeClock(0.0, 1.0, 2.0, 3.0), nvml=None)
    m.start()
    tags = m.on_step_end(1)
    assert (tags["vram/allocated_gib"], tags["vram/reserved_gib"], tags["vram/peak_gib"]) == (2.0, 3.0, 5.0)
    assert tags["vram/reserved_peak_gib"] == 6.0
    assert calls == [("stats", torch.device("cuda", 1)), ("reset", torch.device("cuda", 1))]
    # the allocator's retries since the last log, not PyTorch's running total
    later = [m.on_step_end(step)["vram/alloc_retries"] for step in (2, 3)]
    assert [tags["vram/alloc_retries"], *later] == [2.0, 0.0, 5.0]


def test_nvml_absent_gives_no_gpu_tags_and_no_noise(caplog, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    caplog.set_level(logging.INFO)

    def broken_init():
        raise RuntimeError("NVML Shared Library Not Found")

    queried = []
    fake = types.SimpleNamespace(nvmlInit=broken_init, nvmlDeviceGetHandleByIndex=lambda i: queried.append(i))
    fake.nvmlDeviceGetUtilizationRates = fake.nvmlDeviceGetTemperature = lambda *a: queried.append(a)
    for reader in (NvmlReader(0), NvmlReader(0, nvml=fake)):
        m = StepMetrics("cpu", 1e12, 1, clock=FakeClock(0.0, 1.0, 2.0), nvml=reader)
        m.start()
        for step in (1, 2):
            tags = m.on_step_end(step)
            assert "time/step_s" in tags
            assert not [k for k in tags if k.startswith("gpu/")]
        assert reader.available is False
    assert queried == []  # after a failed init NVML is not asked again, step after step
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


class FakeNvml:
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, power_supported: bool = True) -> None:
        self.power_supported = power_supported
        self.events: list[str] = []
        self.energy_mj: int | None = None  # the card's energy counter; None: a board without one

    def nvmlInit(self):
        self.events.append("init")

    def nvmlShutdown(self):
        self.events.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetUtilizationRates(self, h):
        assert h == ("handle", 0)
        return types.SimpleNamespace(gpu=97, memory=40)

    def nvmlDeviceGetPowerUsage(self, h):
        if not self.power_supported:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 612_345  # milliwatts

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 71 if sensor == self.NVML_TEMPERATURE_GPU else -1

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1980 if clock == self.NVML_CLOCK_SM else -1

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        return 1980

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if self.energy_mj is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.energy_mj


def test_nvml_present_tags_and_unsupported_reading(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml()
    m = StepMetrics("cpu", 1e12, 1, clock=FakeClock(0.0, 1.0), nvml=NvmlReader(0, nvml=fake))
    m.start()
    tags = m.on_step_end(1)
    assert {k: v for k, v in tags.items() if k.startswith("gpu/")} == {
        "gpu/util_pct": 97.0,
        "gpu/power_w": 612.345,
        "gpu/temp_c": 71.0,
        "gpu/sm_clock_mhz": 1980.0,
    }
    m.close()
    assert fake.events == ["init", "shutdown"]
    partial = NvmlReader(0, nvml=FakeNvml(power_supported=False)).read()
    assert "gpu/power_w" not in partial and partial["gpu/temp_c"] == 71.0


def test_energy_a_step_is_the_counters_rise_over_the_last_logs_over_the_steps_between(monkeypatch):
    """`gpu/energy_j_per_step`: the card's energy counter (millijoules) read at start() and at each log; its rise over
    the steps of the last ENERGY_WINDOW logs (one step's reading is coarse); none before a step was counted, nor on
    a board without the counter; a counter that goes back starts the window again."""
    from flux_trainer.metrics import step as step_module

    monkeypatch.setattr(step_module, "ENERGY_WINDOW", 2)
    fake = FakeNvml()
    fake.energy_mj = 1_000_000
    m = StepMetrics("cpu", 1e12, 1, clock=lambda: 0.0, nvml=NvmlReader(0, nvml=fake), log_every=2)
    m.start()
    fake.energy_mj += 230_000
    assert m.on_step_end(1) == {}  # not a logging step: nothing read
    fake.energy_mj += 240_000
    assert m.on_step_end(2)["gpu/energy_j_per_step"] == pytest.approx(235.0)  # 470 J over two steps
    fake.energy_mj += 2 * 207_000
    m.on_step_end(3)
    assert m.on_step_end(4)["gpu/energy_j_per_step"] == pytest.approx((470 + 414) / 4)  # the window: both logs
    fake.energy_mj += 2 * 300_000
    m.on_step_end(5)
    assert m.on_step_end(6)["gpu/energy_j_per_step"] == pytest.approx((414 + 600) / 4)  # the oldest log left it
    fake.energy_mj = 5_000  # the counter went back
    m.on_step_end(7)
    assert "gpu/energy_j_per_step" not in m.on_step_end(8)
    fake.energy_mj += 2 * 250_000
    m.on_step_end(9)
    assert m.on_step_end(10)["gpu/energy_j_per_step"] == pytest.approx(250.0)
    bare = FakeNvml()
    m = StepMetrics("cpu", 1e12, 1, clock=lambda: 0.0, nvml=NvmlReader(0, nvml=bare))
    m.start()
    assert "gpu/energy_j_per_step" not in m.on_step_end(1) and "gpu/power_w" in m.on_step_end(2)


class FakeAccelerator:
    def __init__(self, num_processes: int, others: list[list[float]]) -> None:
        self.num_processes = num_processes
        self.device = torch.device("cpu")
        self.others = others
        self.gathered = 0

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.gathered += 1
        return torch.cat([tensor] + [torch.tensor(o, dtype=tensor.dtype) for o in self.others])


def test_reduce_max_across_ranks():
    values = {"vram/allocated_gib": 2.0, "vram/peak_gib": 9.0, "vram/reserved_gib": 4.0, "time/step_s": 0.5}
    single = FakeAccelerator(1, [])
    assert reduce_max_across_ranks(values, single) == values and single.gathered == 0
    # Other rank's vram tags in sorted-key order: allocated, peak, reserved.
    multi = FakeAccelerator(2, [[3.0, 8.0, 6.0]])
    out = reduce_max_across_ranks(values, multi)
    assert out == {"vram/allocated_gib": 3.0, "vram/peak_gib": 9.0, "vram/reserved_gib": 6.0, "time/step_s": 0.5}
    assert multi.gathered == 1
    assert values["vram/allocated_gib"] == 2.0  # input not modified
