"""A real Chroma training run on CPU through sd-scripts' own trainer (`--model_type chroma`): the tiny random Chroma
(no CLIP-L), 2 steps, through the same path as `flux-train model=random_chroma_tiny`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.sdscripts.checkout import locate

pytestmark = pytest.mark.sd_scripts

try:
    CHECKOUT = locate()
except ConfigError as exc:  # pragma: no cover - depends on the machine
    CHECKOUT, WHY = None, str(exc)
else:
    WHY = ""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")
    from PIL import Image

    work = tmp_path_factory.mktemp("e2e_chroma")
    images = work / "pics"
    images.mkdir()
    for i in range(2):
        Image.new("RGB", (128, 128), (60 * i, 90, 160)).save(images / f"im{i}.png")
        (images / f"im{i}.txt").write_text(f"a flat colour square number {i}")
    (work / "configs" / "dataset").mkdir(parents=True)
    (work / "configs" / "dataset" / "tinyc.yaml").write_text(
        f"name: tinyc\nimages: {images}\nresolution: 128\nrepeats: 1\nmin_bucket_reso: 64\nmax_bucket_reso: 256\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("FLUX_TRAIN_TOKENIZER_DIR", "FLUX_TRAIN_MODEL_CACHE")}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    env.update(FLUX_TRAIN_CACHE=str(work / "cache"), FLUX_TRAIN_SD_SCRIPTS=str(CHECKOUT.path))
    args = ["+dataset=tinyc", "model=random_chroma_tiny", "train.max_steps=2", "train.data_loader_workers=0"]
    args.append("memory=cpu")
    exe = shutil.which("flux-train")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "flux_trainer.cli", *args]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    runs = sorted((work / "runs" / "tinyc").glob("*"))
    return SimpleNamespace(proc=proc, run_dir=runs[-1] if runs else None, cache=work / "cache")


def test_chroma_trains_two_steps_and_writes_a_lora(trained):
    from safetensors import safe_open

    proc, run_dir = trained.proc, trained.run_dir
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = run_dir / "tinyc.safetensors"
    assert final.is_file(), sorted(p.name for p in run_dir.iterdir())
    with safe_open(str(final), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert keys and all(k.startswith("lora_unet_") for k in keys)
    assert any("double_blocks_0" in k for k in keys) and any("single_blocks_0" in k for k in keys)
    assert meta["ss_max_train_steps"] == "2"
    assert meta["modelspec.architecture"].startswith("chroma")  # sd-scripts trained it as Chroma


def test_the_toml_asks_sd_scripts_for_chroma_and_no_clip_l_is_made(trained):
    import tomli

    model = tomli.loads((trained.run_dir / "sd_scripts.toml").read_text())["model"]
    assert model["model_type"] == "chroma" and model["apply_t5_attn_mask"] is True and "clip_l" not in model
    (folder,) = (trained.cache / "models").glob("random-chroma_tiny-*")
    made = sorted(p.name for p in folder.glob("*.safetensors"))
    assert made == ["ae.safetensors", "flux.safetensors", "t5xxl.safetensors"]
