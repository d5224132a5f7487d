import gzip
import json

import pytest
import torch

from flux_trainer.metrics.profile import Kernel, StepProfiler, busy_us, format_summary, kind_of, summarize


@pytest.mark.parametrize(
    "name, kind",
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention"),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
        ("triton_tem_fused_addmm_0", "matmul"),
        ("triton_poi_fused_add_mul_native_layer_norm_3", "triton"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
        ("Memcpy DtoD (Device -> Device)", "copy/cast"),
        ("void at::native::reduce_kernel<512, 1, ...>", "reduction"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
        ("some_custom_kernel", "other"),
    ],
)
def test_kernel_kinds(name, kind):
    assert kind_of(name) == kind


def test_busy_time_is_the_union_of_overlapping_kernels():
    ks = [Kernel("a", 0, 10), Kernel("b", 5, 10), Kernel("c", 20, 5), Kernel("d", 21, 1)]
    assert busy_us(ks) == 20.0  # [0,15] + [20,25]
    assert busy_us([]) == 0.0


def test_summary_per_step_shares_and_idle():
    ks = [Kernel("nvjet_gemm", 0, 6000), Kernel("triton_poi_x", 6000, 2000), Kernel("nvjet_gemm", 10000, 6000),
          Kernel("triton_poi_x", 16000, 2000)]  # fmt: skip
    s = summarize(ks, wall_s=0.020, steps=2)
    assert s["wall_ms_per_step"] == pytest.approx(10.0)
    assert s["device_busy_ms_per_step"] == pytest.approx(8.0)
    assert s["device_idle_ms_per_step"] == pytest.approx(2.0)
    assert s["by_kind"]["matmul"] == {"ms_per_step": pytest.approx(6.0), "share": pytest.approx(0.75),
                                      "count_per_step": 1.0}  # fmt: skip
    assert [r["name"] for r in s["top_kernels"]] == ["nvjet_gemm", "triton_poi_x"]
    text = format_summary(s)
    assert "idle 2.0 ms/step (20% of wall)" in text and "matmul" in text


def _batches(profiler, n, start=1):
    import torch

    written = []
    a = torch.randn(64, 64)
    for step in range(start, start + n):
        written.append(profiler.on_batch(step, torch.device("cpu")))
        (a @ a).relu_().sum()
    return written


def test_window_counts_batches_with_accumulation(tmp_path):
    prof = StepProfiler(tmp_path, at=2, steps=1, accumulation=2)
    assert (prof.first, prof.stop_at) == (3, 5)
    assert _batches(prof, 6) == [False, False, False, False, True, False]
    summary = (tmp_path / "profile" / "summary.txt").read_text()
    assert summary.startswith("profiled 1 step(s)") and "aten::mm" in summary
    trace = json.load(gzip.open(tmp_path / "profile" / "trace-rank0.json.gz"))
    assert trace["traceEvents"]


def test_python_calls_are_in_the_trace_only_when_asked(tmp_path):
    def python_events(python: bool) -> list[str]:
        out = tmp_path / str(python)
        _batches(StepProfiler(out, at=1, steps=1, python=python), 2)
        trace = json.load(gzip.open(out / "profile" / "trace-rank0.json.gz"))
        return [e["name"] for e in trace["traceEvents"] if e.get("cat") == "python_function"]

    assert python_events(False) == []
    assert any("_batches" in name for name in python_events(True))  # this file's helper, seen as a Python call


def test_close_writes_a_window_the_run_ended_inside(tmp_path):
    prof = StepProfiler(tmp_path, at=2, steps=5)
    assert not prof.close()  # nothing open yet
    assert _batches(prof, 3) == [False, False, False]
    assert prof.close() and prof.steps == 2  # batches 2 and 3
    assert json.loads((tmp_path / "profile" / "summary.json").read_text())["steps"] == 2


def test_only_rank_zero_writes_the_summary(tmp_path):
    prof = StepProfiler(tmp_path, at=1, steps=1, rank=1)
    _batches(prof, 2)
    assert (tmp_path / "profile" / "trace-rank1.json.gz").is_file()
    assert not (tmp_path / "profile" / "summary.txt").exists()


def test_bad_window_is_refused(tmp_path):
    with pytest.raises(ValueError, match="profile_at"):
        StepProfiler(tmp_path, at=0)


def test_matmul_rates_split_projections_from_lora_factors():
    from types import SimpleNamespace as E

    from flux_trainer.metrics.profile import matmul_rates

    mm = E(name="aten::mm", input_shapes=[[4096, 3072], [3072, 3072]], device_time_total=100.0, cpu_parent=None)
    lora = E(name="aten::mm", input_shapes=[[4096, 3072], [3072, 16]], device_time_total=10.0, cpu_parent=None)
    addmm = E(name="aten::addmm", input_shapes=[[3072], [4096, 3072], [3072, 3072], [], []], device_time_total=100.0,
              cpu_parent=E(name="aten::linear"))  # fmt: skip
    inner = E(name="aten::mm", input_shapes=[[4096, 3072], [3072, 3072]], device_time_total=100.0, cpu_parent=addmm)
    other = E(name="aten::add", input_shapes=[[1]], device_time_total=5.0, cpu_parent=None)
    rates = matmul_rates([mm, lora, addmm, inner, other], steps=2)
    big = 2 * 4096 * 3072 * 3072
    assert rates["large"]["calls_per_step"] == 1.0  # mm + addmm over 2 steps; the mm inside addmm is not counted
    assert rates["large"]["tflops"] == pytest.approx(2 * big / 200e-6 / 1e12)
    assert rates["small"]["tflop_per_step"] == pytest.approx(2 * 4096 * 3072 * 16 / 2 / 1e12)
    assert rates["small"]["ms_per_step"] == pytest.approx(0.005)


def test_matmul_rates_read_real_profiler_events():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flux_trainer.metrics.profile import matmul_rates

    x, w, lora = torch.randn(512, 2048), torch.randn(2048, 2048), torch.randn(2048, 16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.nn.functional.linear(x, w, torch.randn(2048))  # addmm: 4.3 GFLOP, small by the 5 GFLOP line
        x @ lora
        torch.cat([x, x, x]) @ w  # 12.9 GFLOP
    rates = matmul_rates(prof.events(), steps=1)
    assert rates["large"]["calls_per_step"] == 1 and rates["small"]["calls_per_step"] == 2
    assert rates["large"]["tflop_per_step"] == pytest.approx(2 * 1536 * 2048 * 2048 / 1e12)


def test_device_kernels_leave_out_annotations_and_cpu_ops():
    from types import SimpleNamespace as E

    from flux_trainer.metrics.profile import device_kernels

    def ev(name, device="DeviceType.CUDA", annotation=False):
        return E(name=name, device_type=device, is_user_annotation=annotation,
                 time_range=E(start=1.0, elapsed_us=lambda: 2.0))  # fmt: skip

    events = [ev("nvjet_gemm"), ev("aten::mm", "DeviceType.CPU"), ev("## Call CompiledFxGraph abc ##"),
              ev("region", annotation=True), ev("triton_poi_fused_add_0")]  # fmt: skip
    assert [k.name for k in device_kernels(events)] == ["nvjet_gemm", "triton_poi_fused_add_0"]


def test_idle_gaps_are_charged_to_the_outermost_cpu_op_overlapping_them_most():
    from types import SimpleNamespace as E

    from flux_trainer.metrics.profile import CpuTimeline, idle_by_cpu_op

    def op(name, start, end, thread=1, parent=None):
        return E(name=name, device_type="DeviceType.CPU", cpu_parent=parent, is_async=False, thread=thread,
                 time_range=E(start=start, end=end))  # fmt: skip

    step = op("Optimizer.step#AdamW.step", 150, 205)
    inner = op("aten::_foreach_add_", 160, 200, parent=step)
    norms = op("flux_kernels::lora_grad_norms", 100, 148)
    backward = op("autograd::engine::evaluate_function: MmBackward0", 95, 130, thread=2)
    gpu = E(name="gemm", device_type="DeviceType.CUDA", cpu_parent=None, is_async=False, thread=7,
            time_range=E(start=0, end=300))  # fmt: skip
    ks = [Kernel("gemm", 0, 100), Kernel("bmm", 140, 5), Kernel("adam", 210, 5), Kernel("x", 230, 5),
          Kernel("inside", 90, 5)]  # fmt: skip
    rows = idle_by_cpu_op(ks, CpuTimeline([step, inner, norms, backward, gpu]), steps=2)
    assert rows == [  # gaps: 100-140 (norms 40 > backward 30), 145-210 (the step 55 > norms 3), 215-230 (none)
        {"cpu_op": "Optimizer.step#AdamW.step", "ms_per_step": pytest.approx(0.0325), "gaps_per_step": 0.5},
        {"cpu_op": "flux_kernels::lora_grad_norms", "ms_per_step": pytest.approx(0.020), "gaps_per_step": 0.5},
        {"cpu_op": "(no recorded op)", "ms_per_step": pytest.approx(0.0075), "gaps_per_step": 0.5},
    ]
    text = format_summary({**summarize(ks, 0.001, 2), "idle_by_cpu_op": rows})
    assert "Optimizer.step#AdamW.step" in text and "outermost CPU op" in text


def test_idle_attribution_reads_real_profiler_events():
    """torch.profiler's own CPU events (times, threads, parents) against kernels placed around a recorded phase."""
    import time as _time

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from flux_trainer.metrics.profile import CpuTimeline, idle_by_cpu_op

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("phase_a"):
            torch.ones(4).add_(1)
            _time.sleep(0.02)
    events = prof.events()
    (phase,) = [e for e in events if e.name == "phase_a"]
    r = phase.time_range
    ks = [Kernel("before", r.start - 50, 40), Kernel("after", r.end + 10, 5)]  # a gap covering the whole phase
    (row, *rest) = idle_by_cpu_op(ks, CpuTimeline(events), steps=1)
    assert row["cpu_op"] == "phase_a" and row["gaps_per_step"] == 1
    assert row["ms_per_step"] == pytest.approx((r.end + 10 - (r.start - 10)) / 1e3) and not rest


def test_host_copies_are_named_by_the_ops_that_ran_them():
    """A device-to-host copy placed where torch.profiler recorded an `.item()` inside an annotated region is charged
    to "region > the innermost op"; copies elsewhere to "(no recorded op)"; other kernels are not copies."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from flux_trainer.metrics.profile import CpuTimeline, host_copies_by_cpu_op

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("lora_step"):
            torch.ones(3).sum().item()
    events = prof.events()
    (item,) = [e for e in events if e.name == "aten::_local_scalar_dense"]
    r = item.time_range
    copy = "Memcpy DtoH (Device -> Pageable)"
    ks = [Kernel(copy, r.start, max(r.elapsed_us() / 2, 0.001)), Kernel(copy, r.end + 1e6, 2.0),
          Kernel("gemm", r.start, 1.0)]  # fmt: skip
    rows = host_copies_by_cpu_op(ks, CpuTimeline(events), steps=1)
    assert rows == [
        {"cpu_op": "lora_step > aten::_local_scalar_dense", "copies_per_step": 1.0},
        {"cpu_op": "(no recorded op)", "copies_per_step": 1.0},
    ]
    text = format_summary({**summarize(ks, 0.01, 1), "host_copies_by_cpu_op": rows})
    assert "lora_step > aten::_local_scalar_dense" in text


def _fake_sync():
    import warnings

    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # torch's sync debug mode


def test_sync_trace_counts_synchronising_calls_by_python_stack_and_passes_other_warnings_on():
    import warnings

    from flux_trainer.metrics.profile import SyncTrace

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shown_before = warnings.showwarning
        trace = SyncTrace()
        trace.start(cuda=False)
        for _ in range(3):
            _fake_sync()
        warnings.warn("something else", UserWarning, stacklevel=1)
        trace.stop()
        assert warnings.showwarning is shown_before  # restored
        _fake_sync()  # after the window: not counted, shown as usual
    ((where, n),) = trace.counts.items()
    assert n == 3 and where.startswith("unit/test_metrics_profile.py:") and " _fake_sync < " in where
    caller = where.split(" < ")[1]
    assert caller.endswith(" test_sync_trace_counts_synchronising_calls_by_python_stack_and_passes_other_warnings_on")
    assert [str(w.message) for w in seen] == ["something else", "called a synchronizing CUDA operation"]
    assert trace.rows(steps=2) == [{"where": where, "per_step": 1.5}]
    text = format_summary({**summarize([Kernel("gemm", 0, 5)], 0.01, 2), "syncs": trace.rows(steps=2)})
    assert "synchronising calls" in text and "1.5" in text and " _fake_sync < " in text


def test_profile_window_records_syncs_in_the_summary(tmp_path):
    prof = StepProfiler(tmp_path, at=1, steps=1)
    prof.on_batch(1, torch.device("cpu"))
    _fake_sync()
    assert prof.on_batch(2, torch.device("cpu"))
    (row,) = json.loads((tmp_path / "profile" / "summary.json").read_text())["syncs"]
    assert row["per_step"] == 1.0 and "_fake_sync" in row["where"]


def test_a_failing_profile_is_logged_not_raised_into_training(tmp_path, monkeypatch, caplog):
    import warnings

    def broken(self, prof, wall):
        raise UnicodeDecodeError("utf-8", b"\xdb", 0, 1, "invalid continuation byte")  # as torch 2.13 did once

    monkeypatch.setattr(StepProfiler, "_write", broken)
    shown_before = warnings.showwarning
    prof = StepProfiler(tmp_path, at=1, steps=1)
    prof.on_batch(1, torch.device("cpu"))
    with caplog.at_level("WARNING"):
        assert prof.on_batch(2, torch.device("cpu")) is False
    assert "profile not written: UnicodeDecodeError" in caplog.text
    assert warnings.showwarning is shown_before and prof._prof is None


def test_matmul_rates_say_when_graph_replays_hide_most_matmuls():
    """Kernels replayed from CUDA graphs belong to no op, so the large/small split sees only a few: the summary must
    say what it covers instead of printing a rate for 2 matmuls as if it were the model's."""
    ks = [Kernel("nvjet_gemm", 0, 6000), Kernel("triton_poi_x", 6000, 2000)]
    s = summarize(ks, wall_s=0.010, steps=1)
    s["matmuls"] = {"large": {"calls_per_step": 2, "ms_per_step": 0.5, "tflop_per_step": 0.1, "tflops": 200.0}}
    assert "the rest were replayed from CUDA graphs" in format_summary(s)
    assert "cover 0.5 of the 6.0 ms/step" in format_summary(s)
    s["matmuls"]["large"]["ms_per_step"] = 5.9  # op by op: the rates cover the matmul time
    assert "CUDA graphs" not in format_summary(s)
