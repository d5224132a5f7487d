"""network=lokr | network=loha train the tiny random FLUX for 2 steps on CPU through sd-scripts' own trainer, wrapped
by LyCORIS' lycoris.kohya, and the file written says which algorithm it holds."""

from __future__ import annotations

import importlib.util
import json

import pytest

from flux_trainer.config.validate import LYCORIS
from tests.integration.tiny_run import flux_train, need_checkout, tiny_dataset

pytestmark = pytest.mark.sd_scripts

# what each algorithm's modules save (lycoris/modules/lokr.py, loha.py; LoKr's w2 is `lokr_w2` or the pair
# `lokr_w2_a`/`_b` by layer size); lora_flux's are lora_up / lora_down
KEYS = {"lokr": (".lokr_w1", ".lokr_w2"), "loha": (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b")}
# the factors LyCORIS initialises to zero, so that the adapter starts as a no-op: non-zero once trained
ZERO_AT_START = {"lokr": (".lokr_w2", ".lokr_w2_b"), "loha": (".hada_w2_a",)}


@pytest.mark.parametrize("algo", ["lokr", "loha"])
def test_lycoris_network_trains_tiny_flux_and_names_its_algorithm(algo, tmp_path):
    need_checkout()
    if importlib.util.find_spec("lycoris") is None:
        pytest.skip(f"needs LyCORIS: pip install {LYCORIS}")
    from safetensors import safe_open

    tiny_dataset(tmp_path, n=2)
    proc = flux_train(tmp_path, "+dataset=tiny", "model=random_tiny", "memory=cpu", f"network={algo}",
                      "train.max_steps=2", "train.data_loader_workers=0")  # fmt: skip
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
