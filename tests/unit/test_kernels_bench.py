"""scripts/bench_kernels.py: skips cleanly without CUDA, and its code path runs end to end on CPU (tiny shapes,
Triton interpreter) writing the JSON it promises."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_kernels")


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


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tiny_cpu_single_qkv_section(bench, tmp_path, monkeypatch, torch_config):
    """Both forms of the single block's linear1 gradient, compiled, through Triton's interpreter: the same gradient."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch_config(torch._inductor.config, fx_graph_cache=False)
    (row,) = tiny_cpu_section(bench, tmp_path, "--single-qkv")
    assert row["name"] == "9x808" and not [k for k in row if k.endswith("_error")], row
    assert row["kernels_ms"] > 0 and row["inductor_gelu_gbps"] > 0 and row["speedup"] > 0
    assert row["max_rel_err"] < 1e-5


def test_l2_section_says_it_needs_cuda(bench, tmp_path, capsys):
    assert tiny_cpu_section(bench, tmp_path, "--l2") == {"skipped": "L2 persistence windows need a CUDA device"}
    assert "l2 skipped" in capsys.readouterr().out


def test_l2_rows_on_cpu_with_the_runtime_calls_stood_in(bench, fm, monkeypatch):
    """bench_l2's own logic (blocks, the windows it asks for, the ratio to none) at tiny shapes: the CUDA runtime
    calls and compilation stood in, every window row must name what it covered and compare with no window."""
    from contextlib import contextmanager

    from flux_kernels.memory import l2

    asked = []

    @contextmanager
    def window(tensor, ratio):
        asked.append((tuple(tensor.shape), ratio))
        yield tensor.numel() * tensor.element_size()

    monkeypatch.setattr(l2, "l2_info", lambda dev: l2.L2Info(60 << 20, 45 << 20, 128 << 20))
    monkeypatch.setattr(l2, "persisting_window", window)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: None)
    monkeypatch.setattr(bench, "gpu_ms", lambda run, dev, reps: float(run() is not None))
    s = dict(batch=1, heads=2, head_dim=128, txt=3, img=5, hidden=256)
    rows = bench.bench_l2(torch.device("cpu"), torch.float32, s, warmup=0, reps=1)
    assert [r["name"] for r in rows] == [
        "double/none", "double/input x1.0", "double/input x0.5", "double/qkv weight x1.0", "double/mlp weight x1.0",
        "single/none", "single/input x1.0", "single/input x0.5", "single/linear1 weight x1.0",
    ]  # fmt: skip
    assert asked == [((1, 5, 256), 1.0), ((1, 5, 256), 0.5), ((768, 256), 1.0), ((1024, 256), 1.0),
                     ((1, 8, 256), 1.0), ((1, 8, 256), 0.5), ((1792, 256), 1.0)]  # fmt: skip
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and (r["name"].endswith("none") or (r["vs_none"] == 1.0 and r["window_mib"] > 0))


def test_tiny_cpu_prodigy_section(bench, tmp_path):
    (row,) = tiny_cpu_section(bench, tmp_path, "--prodigy")
    assert row["name"] == "6 tensors" and row["prodigyopt_wall_ms"] > 0 and row["flux_kernels_wall_ms"] > 0
    assert row["speedup_wall"] > 0 and row["speedup_wall_vs_multi_tensor"] > 0
    assert row["flux_kernels_max_rel_diff"] < 1e-4 and row["multi_tensor_max_rel_diff"] < 1e-4  # all stepped alike


def test_tiny_cpu_lora_section(bench, tmp_path):
    """The folded LoRA and the hand-written backward compute what sd-scripts' LoRA computes (outputs, input and
    LoRA gradients, float32 here), so their timings compare like with like."""
    row, total = tiny_cpu_section(bench, tmp_path, "--lora")
    assert row["name"] == "tiny" and row["folded_err"] < 1e-5 and row["hand_err"] < 1e-5
    for label in ("frozen", "sd_scripts", "folded", "hand"):
        assert row[f"{label}_ms"] > 0 and total[f"{label}_ms"] == row[f"{label}_ms"] * row["per_step"]
