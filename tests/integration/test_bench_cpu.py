"""`flux-train bench` end to end on CPU with the tiny random model: real sd-scripts steps, table and JSON."""

from __future__ import annotations

import json

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.sdscripts.checkout import locate

pytestmark = pytest.mark.sd_scripts


def test_bench_runs_cases_and_writes_json(tmp_path, monkeypatch, capsys):
    try:
        locate()
    except ConfigError as exc:
        pytest.skip(f"needs an sd-scripts checkout: {exc}")
    from flux_trainer.bench import bench_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "bench.json"
    code = bench_main(
        [
            "--model",
            "random_tiny",
            "--cases",
            "memory=cpu",
            "network.rank=4+memory=cpu",
            "--resolution",
            "256",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--root",
            str(tmp_path / "b"),
            "--json",
            str(out),
            "train.data_loader_workers=0",
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == ["cpu_k-off_256", "4_cpu_k-off_256"]
    for r in results:
        assert r["exit_code"] == 0 and r["steps"] == 3
        assert r["s_per_step"] > 0 and r["s_min"] <= r["s_per_step"] <= r["s_max"]
        assert r["first_step_s"] > 0
    text = capsys.readouterr().out
    assert "cpu_k-off_256" in text and "s/step" in text


def test_cases_expand_the_product():
    from flux_trainer.bench import cases

    got = cases(["memory=vram24+precision=fp8_base", "memory=vram80"], ["off", "auto"], [512, 1024])
    assert len(got) == 8
    name, overrides, res = got[0]
    assert overrides == ["memory=vram24", "precision=fp8_base", "kernels=off"] and res == 512
    assert name == "vram24_fp8_base_k-off_512"


def test_case_cap():
    from flux_trainer.bench import case_cap

    assert case_cap("tier", ["memory=vram24", "precision=fp8_base"]) == 24.0
    assert case_cap("30", ["memory=vram24"]) == 30.0
    assert case_cap(None, ["memory=vram24"]) is None and case_cap("tier", ["memory=cpu"]) is None
