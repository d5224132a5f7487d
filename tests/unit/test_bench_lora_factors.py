"""scripts/bench_lora_factors.py: its Triton kernels' math on the CPU (Triton's interpreter, odd shapes, against
float64), that a wrong kernel stops it, and that it says so without a GPU (the timing itself needs one)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def factors():
    """The script loaded with Triton's interpreter on: `triton.jit` picks the interpreter when it decorates."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: the script's kernels are Triton's")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        return load_script("bench_lora_factors")


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """...and at every call (Triton reads it again when its first launch imports the rest of itself)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_without_cuda_it_says_so(factors, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run for real")
    assert factors.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize("config", [(32, 32, 1, 4, 2), (16, 64, 3, 4, 2), (64, 16, 8, 4, 2)])
@pytest.mark.parametrize("kind, tokens, wide", [("tokens", 100, 96), ("tokens", 37, 272), ("features", 100, 96),
                                                 ("features", 19, 200)])  # fmt: skip
def test_kernels_match_float64_at_odd_shapes(factors, config, kind, tokens, wide):
    y, other = factors.operands(kind, tokens, wide, "cpu", torch.float32, seed=tokens)
    _, fast, truth = factors.functions(kind, y, other)
    got = fast(config)
    assert got.shape == truth.shape
    assert factors.rel_l2_err(got, truth) < 1e-6


def test_tiny_run_prints_the_table_and_writes_json(factors, tmp_path, capsys):
    assert factors.main(["--tiny", "--out", str(tmp_path / "f.json")]) == 0
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert [r["case"] for r in rows] == [c[0] for c in factors.TINY_CASES]
    assert all(r["triton_err"] < 1e-6 for r in rows)
    assert "odd features" in capsys.readouterr().out


def test_a_wrong_kernel_stops_the_bench(factors, monkeypatch):
    right = factors.yt_h
    monkeypatch.setattr(factors, "yt_h", lambda y, h, c: right(y, h, c) * 1.01)
    with pytest.raises(AssertionError, match="relative error"):
        factors.bench_case("odd", "tokens", 50, 40, torch.device("cpu"), torch.float32, 5, False)
