"""A real Chroma training run on CPU through sd-scripts' own trainer (`--model_type chroma`): the tiny random Chroma
(no CLIP-L), 2 steps, through the same path as `flux-train model=random_chroma_tiny`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integration.tiny_run import flux_train, need_checkout, newest_run, tiny_dataset

pytestmark = pytest.mark.sd_scripts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    need_checkout()
    work = tmp_path_factory.mktemp("e2e_chroma")
    tiny_dataset(work, name="tinyc", n=2)
    proc = flux_train(work, "+dataset=tinyc", "model=random_chroma_tiny", "train.max_steps=2",
                      "train.data_loader_workers=0", "memory=cpu")  # fmt: skip
    return SimpleNamespace(proc=proc, run_dir=newest_run(work, "tinyc"), cache=work / "cache")


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
