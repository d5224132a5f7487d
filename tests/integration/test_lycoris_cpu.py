"""network=lokr | network=loha train the tiny random FLUX for 2 steps on CPU through sd-scripts' own trainer, wrapped
by LyCORIS' lycoris.kohya, and the file written says which algorithm it holds."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.config.validate import LYCORIS
from flux_trainer.sdscripts.checkout import locate

pytestmark = pytest.mark.sd_scripts

try:
    CHECKOUT = locate()
except ConfigError as exc:  # pragma: no cover - depends on the machine
    CHECKOUT, WHY = None, str(exc)
else:
    WHY = ""

# what each algorithm's modules save (lycoris/modules/lokr.py, loha.py; LoKr's w2 is `lokr_w2` or the pair
# `lokr_w2_a`/`_b` by layer size); lora_flux's are lora_up / lora_down
KEYS = {"lokr": (".lokr_w1", ".lokr_w2"), "loha": (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b")}
# the factors LyCORIS initialises to zero, so that the adapter starts as a no-op: non-zero once trained
ZERO_AT_START = {"lokr": (".lokr_w2", ".lokr_w2_b"), "loha": (".hada_w2_a",)}


@pytest.mark.parametrize("algo", ["lokr", "loha"])
def test_lycoris_network_trains_tiny_flux_and_names_its_algorithm(algo, tmp_path):
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")
    if importlib.util.find_spec("lycoris") is None:
        pytest.skip(f"needs LyCORIS: pip install {LYCORIS}")
    from PIL import Image
    from safetensors import safe_open

    images = tmp_path / "pics"
    images.mkdir()
    for i in range(2):
        Image.new("RGB", (128, 128), (90 * i, 90, 160)).save(images / f"im{i}.png")
        (images / f"im{i}.txt").write_text(f"a flat colour square number {i}")
    (tmp_path / "configs" / "dataset").mkdir(parents=True)
    (tmp_path / "configs" / "dataset" / "tiny.yaml").write_text(
        f"name: tiny\nimages: {images}\nresolution: 128\nrepeats: 1\nmin_bucket_reso: 64\nmax_bucket_reso: 256\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FLUX_TRAIN_TOKENIZER_DIR"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    env.update(FLUX_TRAIN_CACHE=str(tmp_path / "cache"), FLUX_TRAIN_SD_SCRIPTS=str(CHECKOUT.path))
    args = ["+dataset=tiny", "model=random_tiny", "memory=cpu", f"network={algo}", "train.max_steps=2"]
    args += ["train.data_loader_workers=0"]
    cli = shutil.which("flux-train")
    cmd = [cli, *args] if cli else [sys.executable, "-m", "flux_trainer.cli", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    (lora,) = (tmp_path / "runs" / "tiny").glob("*/tiny.safetensors")
    with safe_open(str(lora), "pt") as f:
        meta, keys = f.metadata(), list(f.keys())
        assert meta["ss_network_module"] == "lycoris.kohya"
        assert json.loads(meta["ss_network_args"])["algo"] == algo
        assert not [k for k in keys if "lora_up" in k or "lora_down" in k]
        for part in KEYS[algo]:  # FLUX's double and single blocks both got adapters
            found = [k for k in keys if part in k]
            assert any("double_blocks" in k for k in found) and any("single_blocks" in k for k in found), keys
        started_at_zero = [k for k in keys if k.endswith(ZERO_AT_START[algo])]
        assert started_at_zero and all(f.get_tensor(k).abs().max() > 0 for k in started_at_zero)
    (log,) = (tmp_path / "runs" / "tiny").glob("*/train.log")
    assert "kernel lora_grad_norms skipped" in log.read_text()
