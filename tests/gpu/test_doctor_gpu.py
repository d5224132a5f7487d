"""`flux-train doctor --speed` on a real GPU: every check runs, the GPU / attention / kernel / speed rows hold up,
and a simulated broken attention backend is caught on CUDA as well. Skipped without CUDA.

Every assertion message carries the doctor's own table, so a failure here reads like the doctor's output:
run with `pytest tests/gpu/test_doctor_gpu.py -s` to see the table of a passing run too.
"""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest
import torch

from flux_trainer import doctor
from flux_trainer.doctor import attention as doctor_attention
from flux_trainer.doctor.core import CheckResult
from flux_trainer.launch.device import detect_device
from flux_trainer.metrics.flops import peak_bf16_tflops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the doctor's GPU path)"),
]
GPU_GROUPS = ("gpu", "attention", "kernels", "speed")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The whole doctor with --speed, as JSON, once for the module (random_tiny: model files need not exist)."""
    cache = tmp_path_factory.mktemp("model_cache")
    argv = ["--json", "--speed", "model=random_tiny", f"model_cache={cache}"]
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = doctor.doctor_main(argv)
    elapsed = time.perf_counter() - start
    doc = json.loads(out.getvalue())
    info = detect_device()
    rows = [CheckResult(**r) for r in doc["checks"]]
    table = doctor.render_table(rows, info, speed=True, width=160)
    print(f"\n{table}\n(doctor --speed took {elapsed:.1f} s)")
    return {"code": code, "doc": doc, "rows": {r.check: r for r in rows}, "table": table, "info": info}


def test_exit_code_matches_the_rows(report):
    failed = [r.check for r in report["rows"].values() if r.status == "fail"]
    assert report["code"] == (1 if failed else 0), report["table"]
    assert report["doc"]["exit_code"] == report["code"]


def test_the_card_and_its_torch_build_pass(report):
    rows, table = report["rows"], report["table"]
    for check in ("gpu", "torch build", "bf16 matmul"):
        assert rows[check].status == "pass", f"{check}: {rows[check].evidence}\n{table}"
    info = report["info"]
    fp8 = rows["fp8 matmul"]
    assert fp8.status == ("pass" if info.fp8 else "skip"), f"fp8 matmul: {fp8.evidence}\n{table}"
    assert info.name in rows["gpu"].evidence


def test_nothing_on_the_gpu_side_fails(report):
    bad = [f"{r.check}: {r.evidence}" for r in report["rows"].values() if r.group in GPU_GROUPS and r.status == "fail"]
    assert not bad, "\n".join(bad) + "\n" + report["table"]


def test_pytorch_sdpa_runs_at_the_flux_shape_and_matches(report):
    row = report["rows"]["attention: sdpa"]
    assert row.status == "pass", f"{row.evidence}\n{report['table']}"
    assert "4608" in row.evidence or "1536" in row.evidence  # 1024^2 (or 512^2 on cards under 20 GiB)
    assert row.data["max_rel_err"] is not None and row.data["ms_fwd_bwd"] > 0


def test_every_attention_backend_and_kernel_has_a_row(report):
    from flux_kernels.patches.attention.backends import BACKENDS
    from flux_kernels.runtime.registry import REGISTRY

    names = set(report["rows"])
    missing = [f"attention: {n}" for n in BACKENDS if n != "sdpa_math" and f"attention: {n}" not in names]
    missing += [f"kernel: {n}" for n in REGISTRY if n != "attention" and f"kernel: {n}" not in names]
    assert not missing, f"{missing}\n{report['table']}"


def test_speed_rows_measure_this_card(report):
    rows, table = report["rows"], report["table"]
    matmul, block = rows["bf16 matmul speed"], rows["flux block speed"]
    assert matmul.data.get("tflops", 0) > 0 and block.data.get("tflops", 0) > 0, table
    peak = peak_bf16_tflops(report["info"].name)
    if peak is not None:  # a card in the peak table must reach at least half of it on a plain 8192^3 matmul
        assert matmul.status == "pass", f"{matmul.evidence}\n{table}"
        assert block.status in ("pass", "warn"), table


def test_a_broken_backend_is_a_fail_on_cuda_too():
    from flux_kernels.patches.attention.backends import BACKENDS, AttentionBackend

    def broken(q, k, v, mask):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    def wrong(q, k, v, mask):
        return BACKENDS["sdpa"].run(q, k, v, mask) * 1.5

    candidates = {
        "sdpa": BACKENDS["sdpa"],
        "broken": AttentionBackend("broken", broken),
        "wrong": AttentionBackend("wrong", wrong),
    }
    rows = {
        r.check: r for r in doctor_attention.attention_checks("cuda", shape=(1, 24, 1536, 128), backends=candidates)
    }
    summary = "\n".join(f"{k}: {r.status} {r.evidence}" for k, r in rows.items())
    assert rows["attention: sdpa"].status == "pass", summary
    assert rows["attention: broken"].status == "fail", summary
    assert rows["attention: wrong"].status == "fail" and "wrong" in rows["attention: wrong"].evidence, summary


def test_fast_checks_need_no_gpu_kernels_and_take_about_a_second(tmp_path):
    from flux_trainer.config.compose import compose_run

    cfg = compose_run(["model=random_tiny", f"model_cache={tmp_path}"], [])
    info = detect_device()
    start = time.perf_counter()
    rows = doctor.fast_checks(cfg, info)
    elapsed = time.perf_counter() - start
    by = {r.check: r for r in rows}
    assert by["torch build"].status == "pass", by["torch build"].evidence
    assert not {r.group for r in rows} & {"attention", "kernels", "speed"}
    assert elapsed < 5, f"fast_checks took {elapsed:.1f} s"


def test_the_gradient_layout_row_reports_its_measurement(report):
    """The cuDNN gradient-layout row (flux_kernels.patches.attention.backends.heads_to_tokens works around the fault it
    looks for): a verdict that follows its own number."""
    row = report["rows"]["attention: sdpa_cudnn gradient layout"]
    assert row.status in ("pass", "warn", "skip"), f"{row.evidence}\n{report['table']}"
    if row.status != "skip":
        err = row.data["max_rel_err"]
        assert (row.status == "warn") == (not err <= doctor_attention.LAYOUT_TOLERANCE), row.evidence
        print(f"\nsdpa_cudnn gradient layout: {row.status}, max rel. error {err:.3g}")


@pytest.mark.parametrize("name", ["sdpa_flash", "sdpa_efficient"])
def test_backends_without_the_fault_pass_the_layout_measurement(name):
    """The measurement itself on CUDA: backends that keep no per-shape gradient layout (measured on the H200)
    give bf16-rounding errors, at a shape of their own."""
    from flux_kernels.patches.attention.probe import gradient_layout_error

    err = gradient_layout_error(name, "cuda", shape=(1, 3, 301, 64))
    assert err <= doctor_attention.LAYOUT_TOLERANCE, err
