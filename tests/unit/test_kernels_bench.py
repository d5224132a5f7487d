"""scripts/bench_kernels.py: skips cleanly without CUDA, and its code path runs end to end on CPU (tiny shapes,
Triton interpreter) writing the JSON it promises."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_it_says_so_and_exits_zero(bench, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run for real")
    assert bench.main(["--out", str(tmp_path / "b.json")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert json.loads((tmp_path / "b.json").read_text()) == {"skipped": "no CUDA device"}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tiny_cpu_run_writes_the_table_and_json(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: tests/gpu runs the real benchmark path")
    out = tmp_path / "b.json"
    argv = ["--device", "cpu", "--tiny", "--reps", "1", "--warmup", "0", "--no-compiled", "--no-attention",
            "--kernels", "modulate,gated_residual", "--dtype", "fp32", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["ops"]] == ["modulate", "gated_residual"]
    for row in data["ops"]:
        assert row["ref_ms"] > 0 and row["fast_ms"] > 0 and row["speedup"] > 0 and row["bytes"] > 0
    assert "speedup" in capsys.readouterr().out


def tiny_cpu_section(bench, tmp_path, flag: str) -> list[dict]:
    """The rows one optional section (--fp8, --lora-norms) writes, run alone at tiny shapes on the CPU."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run for real")
    out = tmp_path / "b.json"
    argv = ["--device", "cpu", "--tiny", "--reps", "1", "--warmup", "0", "--no-compiled", "--no-attention",
            "--kernels", "", flag, "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    return json.loads(out.read_text())[flag.removeprefix("--").replace("-", "_")]


def test_tiny_cpu_fp8_section(bench, tmp_path):
    (row,) = tiny_cpu_section(bench, tmp_path, "--fp8")
    assert row["shape"] == "64x256x512" and not [k for k in row if k.endswith("_error")], row
    for label in ("bf16", "upcast", "fp8"):
        assert row[f"{label}_ms"] > 0 and row[f"{label}_tflops"] > 0
    assert row["vs_bf16"] > 0 and row["vs_upcast"] > 0
    assert row["transpose_exact"] is True and row["transpose_triton_us"] > 0 and row["transpose_torch_tbps"] > 0


def test_tiny_cpu_lora_norms_section(bench, tmp_path):
    row, total = tiny_cpu_section(bench, tmp_path, "--lora-norms")
    assert row["name"] == "40x72" and total["modules"] == 3 and total["speedup"] > 0
    assert row["gram_max_rel_err"] < 1e-5 and row["sd_scripts_max_rel_err"] < 5e-2  # CPU autocast: bf16
    assert all(total[f"{label}_wall_ms"] > 0 for label in ("sd_scripts", "gram", "batched"))
