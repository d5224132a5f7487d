import gzip
import json

import pytest

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
