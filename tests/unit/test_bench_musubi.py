"""`flux-train bench` for models trained on musubi-tuner (FLUX.2 klein, Kontext), without a checkout: plain
musubi-tuner's command, the LoRA each side is compared by, the tiers and targets of these models' tier rows."""

from __future__ import annotations

import json
import os
import time

import pytest

from flux_trainer.commands import bench
from flux_trainer.commands.bench import BenchResult, lora_file, tier_rows, tier_table
from flux_trainer.commands.bench_models import bench_model, default_tiers, plain_base, tier_target


def _musubi_run_dir(tmp_path, random_dit="/m/random-x/dit.safetensors"):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    spec = {"musubi_tuner": "/co/musubi-tuner", "backend": "musubi", "random_dit": random_dit,
            "scripts": ["flux_2_cache_latents", "flux_2_cache_text_encoder_outputs", "flux_2_train_network"],
            "cache_latents": ["--vae", "v"], "cache_text_encoder": ["--text_encoder", "t"],
            "train_toml": str(run / "musubi_tuner.toml"), "dataset_toml": str(run / "dataset.toml")}  # fmt: skip
    (run / "runner.json").write_text(json.dumps(spec))
    (run / "env.json").write_text(json.dumps({"env": {"SOME_PROFILE_VAR": "1"}}))
    return run


def test_plain_musubi_tuner_is_its_training_script_on_our_tomls_and_none_of_our_runner(tmp_path):
    from flux_trainer.musubi.baseline import plain_command

    run = _musubi_run_dir(tmp_path)
    cmd = plain_command(run, run / "baseline")
    at = cmd.index("-m", cmd.index("--quiet"))
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"] and cmd[4] == str(run / "accelerate.yaml")
    assert cmd[at + 1 :] == [
        "flux_trainer.musubi.script", "--random-model", "/m/random-x/dit.safetensors", "/co/musubi-tuner",
        "flux_2_train_network", "--config_file", str(run / "musubi_tuner.toml"), "--dataset_config",
        str(run / "dataset.toml"), "--output_dir", str(run / "baseline"), "--logging_dir", str(run / "baseline" / "tb"),
    ]  # fmt: skip
    assert not any("runner" in c or "cache" in c for c in cmd)  # not our runner, and no caching step again
    bare = plain_command(_musubi_run_dir(tmp_path / "real", random_dit=None), tmp_path / "out")
    assert "--random-model" not in bare  # a real model: musubi-tuner's own loaders as they are


def test_run_baseline_runs_plain_musubi_tuner_for_a_musubi_run_and_names_its_row(tmp_path, monkeypatch):
    from flux_trainer.launch import supervise

    run = _musubi_run_dir(tmp_path)
    seen = {}

    def fake_supervised(cmd, env, log_path, **kw):
        seen.update(cmd=cmd, env=env)
        return 0

    monkeypatch.setattr(supervise, "run_supervised", fake_supervised)
    monkeypatch.setenv(bench.VRAM_CAP_ENV, "7.5")
    ours = BenchResult(case="vram8_k-auto_1024", overrides=["memory=vram8"], exit_code=0, run_dir=str(run),
                       model_type="flux2", model_version="klein-base-4b")  # fmt: skip
    plain = bench.run_baseline(ours, type("NS", (), {"warmup": 1})())
    assert plain.case == "vram8_k-auto_1024 (plain musubi-tuner)" and plain_base(plain.case) == ours.case
    assert "flux_2_train_network" in seen["cmd"] and plain.run_dir == str(run / "baseline")
    assert bench.VRAM_CAP_ENV not in seen["env"] and seen["env"]["SOME_PROFILE_VAR"] == "1"  # plain is never capped
    assert (plain.model_type, plain.model_version) == ("flux2", "klein-base-4b")


def test_the_lora_compared_is_the_trainers_own_file_not_the_comfy_copy_nor_the_baselines(tmp_path):
    """Our musubi run writes NAME.safetensors, then NAME.comfy.safetensors (newer); plain musubi-tuner's
    NAME.safetensors in baseline/ is newest of all. Each side is its own musubi-tuner-format file."""
    run = tmp_path / "run"
    (run / "baseline").mkdir(parents=True)
    now = time.time()
    for i, path in enumerate([run / "x.safetensors", run / "x.comfy.safetensors", run / "baseline" / "x.safetensors"]):
        path.write_bytes(b"")
        os.utime(path, (now + i, now + i))
    assert lora_file(run) == run / "x.safetensors"
    assert lora_file(run / "baseline") == run / "baseline" / "x.safetensors"


def test_bench_model_reads_the_preset_and_the_klein_tiers_are_issue_61s():
    klein4, klein9, kontext = bench_model("random_flux2_klein_4b"), bench_model("random_flux2_klein_9b"), None
    kontext = bench_model("random_kontext")
    assert (klein4.model_type, klein4.model_version, klein4.plain_suffix) == ("flux2", "klein-base-4b",
                                                                            "(plain musubi-tuner)")  # fmt: skip
    assert klein9.model_version == "klein-base-9b" and kontext.model_type == "kontext"
    assert bench_model("random").plain_suffix == "(plain sd-scripts)"
    assert default_tiers(klein4) == ("vram8", "vram12", "vram16")
    assert default_tiers(klein9) == ("vram12", "vram16", "vram24")
    assert default_tiers(kontext) is None and default_tiers(bench_model("random")) is None  # every tier
    assert tier_target("flux", None, (0.5, None)) == (0.5, None) and tier_target(None, None, (0.8, 1.8)) == (0.8, 1.8)
    assert tier_target("flux2", "klein-base-4b", (0.5, None)) == (None, 1.5)
    assert tier_target("kontext", None, (0.5, None)) == (None, 1.5)
    assert tier_target("flux2", "klein-base-9b", (0.5, None)) == (None, None)


def _row(tier, s, peak, version="klein-base-4b", model_type="flux2"):
    ours = BenchResult(case=f"{tier}_k-auto_1024", overrides=[f"memory={tier}", "kernels=auto"], exit_code=0,
                       s_per_step=s, card_peak_gib=peak, model_type=model_type, model_version=version)  # fmt: skip
    return ours


def _plain(ours, s, peak):
    return BenchResult(case=f"{ours.case} (plain musubi-tuner)", overrides=[], exit_code=0, s_per_step=s,
                       card_peak_gib=peak, model_type=ours.model_type, model_version=ours.model_version)  # fmt: skip


def test_klein_tier_rows_have_no_flux1_seconds_target_but_the_ratio_and_the_cap():
    """0.9 s/step would miss FLUX.1's vram8 target (0.80) and vram16's (0.50): a klein row is held to the 1.5x
    ratio over plain musubi-tuner and to the card's peak under the tier, not to FLUX.1-dev's seconds."""
    v8, v12, v16 = _row("vram8", 0.9, 7.0), _row("vram12", 0.85, 11.6), _row("vram16", 0.8, 14.0)
    rows = {r["tier"]: r for r in tier_rows([v8, _plain(v8, 1.8, 6.0), v12, _plain(v12, 1.7, 9.0), v16,
                                             _plain(v16, 1.0, 12.0)])}  # fmt: skip
    assert [rows[t]["target_s_per_step"] for t in rows] == [None, None, None]
    assert rows["vram8"]["met"] and rows["vram8"]["ratio"] == pytest.approx(2.0)
    assert not rows["vram12"]["met"]  # 11.6 GiB on the card: over 12 - 0.5
    assert not rows["vram16"]["met"] and rows["vram16"]["ratio"] == pytest.approx(1.25)  # under 1.5x
    text = tier_table(list(rows.values()))
    assert "plain musubi-tuner" in text.splitlines()[0]
    assert text.count("| >= 1.5x |") == 3 and "| 0.80 |" not in text and "| 0.50 |" not in text  # no s/step target
    nine = _row("vram24", 0.9, 20.0, version="klein-base-9b")
    (row,) = tier_rows([nine, _plain(nine, 1.0, 18.0)])
    assert row["met"] and row["target_ratio"] is None and row["target_s_per_step"] is None  # no target named for 9B
    flux1 = _row("vram16", 0.6, 14.0, version=None, model_type="flux")
    (row,) = tier_rows([flux1])
    assert row["target_s_per_step"] == 0.50 and not row["met"]  # FLUX.1 keeps its own targets


def test_tiers_of_a_klein_model_are_its_own_and_plain_musubi_tuner_runs_beside_each(tmp_path, monkeypatch, capsys):
    ran = []

    def run_case(name, overrides, res, ns, root):
        ran.append((name, ns.model))
        tier = overrides[0].removeprefix("memory=")
        r = _row(tier, 0.5, 1.0, version=bench_model(ns.model).model_version)
        r.run_dir = str(tmp_path)
        return r

    monkeypatch.setattr(bench, "run_case", run_case)
    monkeypatch.setattr(bench, "run_baseline", lambda r, ns: _plain(r, 1.0, 1.0))
    monkeypatch.setattr(bench, "compare_to_plain", lambda ours, plain: None)
    out = tmp_path / "b.json"
    argv = ["--tiers", "--json", str(out), "--root", str(tmp_path)]
    assert bench.bench_main(["--model", "random_flux2_klein_9b", *argv]) == 0
    assert [n for n, _ in ran] == ["vram12_k-auto_1024", "vram16_k-auto_1024", "vram24_k-auto_1024"]
    saved = json.loads(out.read_text())
    assert [t["tier"] for t in saved["tiers"]] == ["vram12", "vram16", "vram24"]
    assert all(t["ratio"] == pytest.approx(2.0) and t["plain_trainer"] == "musubi-tuner" for t in saved["tiers"])
    printed = capsys.readouterr().out
    assert "2.00x  musubi-tuner" in printed  # the ratio table of --baseline
    ran.clear()
    assert bench.bench_main(["--model", "random_flux2_klein_4b", *argv]) == 0
    assert [n for n, _ in ran] == ["vram8_k-auto_1024", "vram12_k-auto_1024", "vram16_k-auto_1024"]


def test_musubi_tuners_warmup_steps_are_numbers_in_the_schema():
    """musubi-tuner's --lr_warmup_steps is `_int_or_float` (steps, or a fraction of them): any optimizer preset's
    warm-up (optimizer=adamw: 100 steps) must pass the committed schema, and a word must not."""
    from flux_trainer.musubi.parser_schema import check_script_keys

    for script in ("flux_2_train_network", "flux_kontext_train_network"):
        assert check_script_keys(script, {"lr_warmup_steps": 100, "lr_decay_steps": 0.1}) == []
        (problem,) = check_script_keys(script, {"lr_warmup_steps": "ten"})
        assert "lr_warmup_steps" in problem and "number" in problem
