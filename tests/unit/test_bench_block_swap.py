"""scripts/bench_block_swap.py on the CPU: without CUDA it stops with a line saying so, and `--tiny` runs its whole
path (sd-scripts' swap, block_swap, none; the table and the JSON it promises) on a small model."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import load_script


def test_without_cuda_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the script would run at full size")
    assert load_script("bench_block_swap").main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.sd_scripts
def test_tiny_run_writes_every_way_and_the_json(fm, tmp_path, capsys):
    out = tmp_path / "swap.json"
    assert load_script("bench_block_swap").main(["--tiny", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["way"], r["swap"]) for r in result["rows"]] == [
        ("none", 0), ("sd-scripts", 2), ("block_swap", 2), ("sd-scripts", 8), ("block_swap", 8)]  # fmt: skip
    assert all(r["s_per_step"] > 0 for r in result["rows"])
    ours = [r for r in result["rows"] if r["way"] == "block_swap"]
    assert ours[0]["h2d_gib_per_step"] < ours[1]["h2d_gib_per_step"]  # more blocks swapped, more copied
    assert "block_swap: 4 of 6 double and 8 of 10 single blocks" in capsys.readouterr().out
