"""A dataset of two folders, a regularisation folder and two resolutions: its dataset TOML passes sd-scripts' own
validator, and it trains 2 steps on the CPU tiny model through `flux-train` (issue 59)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import tomli

from flux_trainer.sdscripts import live_check
from flux_trainer.sdscripts.checkout import import_sd_scripts
from tests.integration.tiny_run import CHECKOUT, WHY

pytestmark = pytest.mark.sd_scripts


def folder(path, n, size, captions=True, mode="RGB"):
    from PIL import Image

    path.mkdir(parents=True)
    for i in range(n):
        Image.new(mode, size, (40 * i, 120, 200 - 30 * i, 255)[: len(mode)]).save(path / f"{path.name}{i}.png")
        if captions:
            (path / f"{path.name}{i}.txt").write_text(f"a {path.name} square {i}")
    return path


def test_two_folders_a_reg_folder_and_two_resolutions_train_two_steps(tmp_path):
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")
    close = folder(tmp_path / "closeups", 3, (128, 128), mode="RGBA")  # masked loss from the alpha channel
    full = folder(tmp_path / "full_body", 2, (96, 160), captions=False)  # the trigger word is their caption
    reg = folder(tmp_path / "reg", 2, (128, 128))
    subsets = [
        {"images": str(close), "trigger": "ohwx", "repeats": 2, "alpha_mask": True},
        {"images": str(full), "trigger": "ohwx", "repeats": 1},
        {"images": str(reg), "is_reg": True, "repeats": 1},
    ]
    body = {"name": "multi", "resolution": [128, 192], "subsets": subsets, "min_bucket_reso": 64}
    (tmp_path / "configs" / "dataset").mkdir(parents=True)
    (tmp_path / "configs" / "dataset" / "multi.yaml").write_text(
        "\n".join(f"{k}: {json.dumps(v)}" for k, v in body.items()) + "\n"
    )
    before = sorted(p.name for d in (close, full, reg) for p in d.iterdir())
    env = {k: v for k, v in os.environ.items() if k != "FLUX_TRAIN_TOKENIZER_DIR"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    env.update(FLUX_TRAIN_CACHE=str(tmp_path / "cache"), FLUX_TRAIN_SD_SCRIPTS=str(CHECKOUT.path))
    cmd = [sys.executable, "-m", "flux_trainer.cli", "+dataset=multi", "model=random_tiny", "memory=cpu"]
    cmd += ["train.max_steps=2", "train.save_every_n_steps=null", "train.data_loader_workers=0"]
    cmd += ["train.prior_loss_weight=0.5", "sample.prompts=[]"]
    if shutil.which("flux-train"):
        cmd = [shutil.which("flux-train"), *cmd[3:]]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = sorted((tmp_path / "runs" / "multi").glob("*"))
    train, dataset = run / "sd_scripts.toml", run / "dataset.toml"
    assert live_check.live_check(import_sd_scripts(CHECKOUT.path), train, dataset) == []

    doc = tomli.loads(dataset.read_text())
    assert [d["resolution"] for d in doc["datasets"]] == [128, 192]
    for d in doc["datasets"]:
        subs = d["subsets"]
        assert [s["num_repeats"] for s in subs] == [2, 1, 1]
        assert [s.get("is_reg", False) for s in subs] == [False, False, True]
        assert [s.get("alpha_mask", False) for s in subs] == [True, False, False]
        assert [s.get("caption_prefix") for s in subs] == ["ohwx,", "ohwx,", None]
        assert all(s["image_dir"].startswith(str(tmp_path / "cache" / "datasets")) for s in subs)
    assert tomli.loads(train.read_text())["training"]["prior_loss_weight"] == 0.5
    assert (run / "multi.safetensors").is_file()
    log = (run / "train.log").read_text()
    # sd-scripts read every folder at both resolutions: 3 x 2 + 2 x 1 images learned, 2 reg images
    assert log.count("8 train images with repeats") == 2 and log.count("2 reg images with repeats") == 2, log[-3000:]
    assert sorted(p.name for d in (close, full, reg) for p in d.iterdir()) == before  # user folders unwritten


def test_the_multi_folder_golden_passes_sd_scripts_validator():
    """The three-resolution golden (tests/unit/test_translate.py) as sd-scripts itself reads it."""
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")
    from tests.unit.test_translate import GOLDEN

    train, dataset = GOLDEN / "multi_folder.sd_scripts.toml", GOLDEN / "multi_folder.dataset.toml"
    assert live_check.live_check(import_sd_scripts(CHECKOUT.path), train, dataset) == []
