"""scripts/bench_model_copy.py: its code path end to end on the CPU (host-to-host copies, no page-locked buffers),
on a small safetensors file: every way timed, every staged copy checked bit for bit, the JSON it promises."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from tests.conftest import load_script


def test_cpu_run_writes_the_table_and_json(tmp_path, capsys, monkeypatch):
    bench = load_script("bench_model_copy")
    from flux_trainer.sdscripts import model_copy

    monkeypatch.setattr(model_copy, "MIN_TENSOR_BYTES", 1 << 16)
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(300, 700, generator=gen).to(torch.bfloat16), "b": torch.randn(129, 1001, generator=gen)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    out = tmp_path / "copy.json"
    argv = [str(tmp_path / "m.safetensors"), "--device", "cpu", "--repeat", "1", "--threads", "1", "2",
            "--chunk-mib", "1", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    ways = {(r["source"], r["way"]) for r in result["rows"]}
    assert ways == {
        (s, w) for s in ("mmap", "memory") for w in ("Module.to", "staged 1 threads, 1 MiB", "staged 2 threads, 1 MiB")
    }
    assert all(r["same_bits"] and r["median_s"] > 0 for r in result["rows"])
    assert result["bytes"] == 300 * 700 * 2 + 129 * 1001 * 4
    assert "speed-up" in capsys.readouterr().out
