"""`flux-train bench --baseline` for FLUX.2 klein and Kontext on the CPU (issue 61): our run through musubi-tuner, then
plain musubi-tuner's own training script on our run's TOMLs and caches (flux_trainer.musubi.baseline), both rows, the
ratio and the numerics. On the CPU nothing of ours changes the numbers, so the two runs must agree exactly; and the
plain run must be plain: none of our tags in its TensorBoard, none of our runner's lines in its log, its own LoRA in
`baseline/`, the caches our run made left as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.metrics.tensorboard import read_scalars
from tests.musubi_checkout import MUSUBI, need_musubi

pytestmark = [pytest.mark.musubi, pytest.mark.sd_scripts]
OUR_TAGS = ("vram/peak_gib", "time/step_s", "throughput/images_per_s")
CASE = "cpu_k-off_128"


def bench(tmp_path, monkeypatch, capsys, model: str) -> tuple[dict, dict, Path, str]:
    from flux_trainer.commands.bench import bench_main
    from flux_trainer.sdscripts.checkout import locate as locate_sd_scripts

    need_musubi()
    try:
        sd_scripts = locate_sd_scripts()
    except ConfigError as exc:  # the random sets are written with sd-scripts' code
        pytest.skip(f"needs an sd-scripts checkout: {exc}")
    monkeypatch.chdir(tmp_path)
    for key, value in {
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "FLUX_TRAIN_CACHE": str(tmp_path / "cache"),
        "FLUX_TRAIN_MUSUBI_TUNER": str(MUSUBI.path),
        "FLUX_TRAIN_SD_SCRIPTS": str(sd_scripts.path),
    }.items():
        monkeypatch.setenv(key, value)  # fmt: skip
    out = tmp_path / "bench.json"
    argv = ["--model", model, "--baseline", "--warmup", "1", "--steps", "3", "--cases", "memory=cpu",
            "--resolution", "128", "--root", str(tmp_path / "b"), "--json", str(out),
            "train.data_loader_workers=0", "dataset.min_bucket_reso=64"]  # fmt: skip
    assert bench_main(argv) == 0, capsys.readouterr().out[-3000:]
    results = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == [CASE, f"{CASE} (plain musubi-tuner)"]
    ours, plain = results.values()
    return ours, plain, Path(ours["run_dir"]), capsys.readouterr().out


def check_both(ours: dict, plain: dict, run: Path, printed: str, training_script: str) -> None:
    for r in (ours, plain):
        assert r["exit_code"] == 0 and r["steps"] == 4 and r["s_per_step"] > 0, r
    # both rows, the ratio, the numerics
    assert f"{CASE} (plain musubi-tuner)" in printed and "numerics against plain musubi-tuner" in printed
    assert ours["plain_ratio"] == pytest.approx(plain["s_per_step"] / ours["s_per_step"])
    assert f"{ours['plain_ratio']:.2f}x  musubi-tuner" in printed
    assert ours["compared_to"] == plain["case"]
    assert ours["loss_rel_diff"] == pytest.approx(0.0, abs=1e-6)  # same seed, data, caches; no kernels on a CPU
    assert ours["lora_cosine"] == pytest.approx(1.0, abs=1e-6)
    # each side's own musubi-tuner-format LoRA: ours (not its ComfyUI copy) against the plain run's, in baseline/
    assert (run / f"{CASE}.comfy.safetensors").is_file()
    assert f"lora compared: {run / CASE}.safetensors against {run / 'baseline' / CASE}.safetensors" in ours["notes"]
    # plain musubi-tuner: its training script, not our runner, and no caching step again
    cmd = plain["overrides"]
    assert training_script in cmd and "flux_trainer.musubi.runner" not in cmd
    assert not any("cache" in c and c.endswith(("latents", "outputs")) for c in cmd)
    (events,) = {p.parent for p in (run / "baseline" / "tb").rglob("events.out.tfevents.*")}
    theirs = read_scalars(events)
    assert [s for s, _ in theirs["loss/current"]] == [1, 2, 3, 4]
    assert not set(OUR_TAGS) & set(theirs), sorted(theirs)  # our hooks would have written these
    (mine,) = {p.parent for p in (run / "tb").rglob("events.out.tfevents.*")}
    assert set(OUR_TAGS) <= set(read_scalars(mine))  # (and ours did)
    log = (run / "baseline" / "train.log").read_text()
    assert "flux_trainer.musubi.runner" in (run / "train.log").read_text()
    assert "flux_trainer.musubi.runner" not in log and f"saving checkpoint: {run / 'baseline' / CASE}" in log
    # the caches our run made were read, not made again: none was written after our LoRA
    lora_time = (run / f"{CASE}.safetensors").stat().st_mtime
    caches = [p for p in Path(run.parents[2] / "cache" / "musubi").rglob("*.safetensors")]
    assert caches and all(p.stat().st_mtime <= lora_time for p in caches)


def test_bench_klein_tiny_beside_plain_musubi_tuner(tmp_path, monkeypatch, capsys):
    ours, plain, run, printed = bench(tmp_path, monkeypatch, capsys, "random_flux2_klein_tiny")
    check_both(ours, plain, run, printed, "flux_2_train_network")
    assert ours["model_type"] == "flux2" and ours["model_version"] == "klein-base-4b"


def test_bench_kontext_tiny_with_its_references_beside_plain_musubi_tuner(tmp_path, monkeypatch, capsys):
    ours, plain, run, printed = bench(tmp_path, monkeypatch, capsys, "random_kontext_tiny")
    check_both(ours, plain, run, printed, "flux_kontext_train_network")
    assert "control_images" in (run / "config.yaml").read_text()
    for log in (run / "train.log", run / "baseline" / "train.log"):  # each paired every image with its reference
        assert "4 images have 1 control images" in log.read_text(), log
