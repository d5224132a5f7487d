"""Random model sets for musubi-tuner: each tiny preset is generated, read by musubi-tuner's OWN loaders (strict:
a missing or extra key fails) and run forward on CPU; each full preset is compared with the modules musubi-tuner
builds for klein base 4B / FLUX.1 Kontext dev, on the meta device only (full files are made on a GPU machine).
The stand-in Qwen3 tokenizer is checked against what musubi-tuner does with it."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from flux_trainer.config.errors import ConfigError
from flux_trainer.musubi import random_model as rm
from flux_trainer.musubi import random_specs as specs
from flux_trainer.sdscripts.random_model import plan_part


def _musubi_checkout() -> Path | None:
    """$FLUX_TRAIN_MUSUBI_TUNER or the cache folder (until the backend's checkout module finds it for us)."""
    env = os.environ.get("FLUX_TRAIN_MUSUBI_TUNER")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "flux-trainer" / "musubi-tuner"
    return path if (path / "src" / "musubi_tuner").is_dir() else None


CHECKOUT = _musubi_checkout()
need_musubi = pytest.mark.skipif(
    CHECKOUT is None, reason="needs a musubi-tuner checkout ($FLUX_TRAIN_MUSUBI_TUNER or ~/.cache/flux-trainer)"
)


@pytest.fixture(scope="module")
def musubi():
    """musubi-tuner's src on sys.path for this module's tests; every run-time patch undone at the end."""
    src = str(CHECKOUT / "src")
    added = src not in sys.path
    if added:
        sys.path.insert(0, src)
    yield lambda name: importlib.import_module(f"musubi_tuner.{name}")
    rm.uninstall_random_model()
    if added:
        sys.path.remove(src)


@pytest.fixture(autouse=True)
def _undo_patches():
    """No test sees another's run-time patches of musubi-tuner."""
    yield
    rm.uninstall_random_model()


def _shapes(plans) -> dict[str, tuple[int, ...]]:
    return {p.name: p.shape for p in plans}


# ------------------------------------------------------------------------------------------ specs and tokenizer


def test_tiny_shapes_fit_together_and_full_needs_no_patch():
    tiny, full = specs.FLUX2_PRESETS["random_flux2_klein_tiny"], specs.FLUX2_PRESETS["random_flux2_klein_4b"]
    full_9b = specs.FLUX2_PRESETS["random_flux2_klein_9b"]
    for preset in (tiny, full, full_9b):
        dit, te = preset["dit"], preset["text_encoder"]
        assert dit["context_in_dim"] == 3 * te["hidden_size"]  # three Qwen3 layers stacked per token
        assert sum(dit["axes_dim"]) == dit["hidden_size"] // dit["num_heads"]
        assert dit["in_channels"] == 4 * preset["vae"]["z_channels"]  # 2x2 patches of the AE latent
        assert te["num_hidden_layers"] >= specs.QWEN3_MIN_LAYERS
    assert specs.flux2_needs_patch(tiny) and not specs.flux2_needs_patch(full)
    assert not specs.flux2_needs_patch(full_9b)  # musubi-tuner hard-codes 9B's shapes too, by --model_version
    assert specs.flux2_needs_patch({**full_9b, "model_version": "klein-base-4b"})  # 9B shapes as 4B: taught
    assert specs.flux2_needs_patch({**full, "model_version": "klein-9b"})
    assert specs.preset_family("random_kontext_tiny") == "kontext"
    assert specs.preset_family("random_flux2_klein_9b") == "flux2"
    with pytest.raises(KeyError, match="random_flux2_klein_tiny"):
        specs.preset_family("random_flux2_klein_12b")


def test_standin_qwen3_tokenizer_is_what_the_builder_writes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    builder = importlib.import_module("build_standin_qwen3_tokenizer")
    builder.build(tmp_path)
    shipped = rm.STANDIN_DIR / specs.STANDIN_QWEN3
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_text() == (shipped / name).read_text(), name


def test_standin_qwen3_tokenizer_works_as_musubi_tuner_uses_it():
    from transformers import Qwen2Tokenizer, Qwen2TokenizerFast

    folder = rm.STANDIN_DIR / specs.STANDIN_QWEN3
    want = "<|im_start|>user\na red car<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids = []
    for cls in (Qwen2Tokenizer, Qwen2TokenizerFast):  # musubi-tuner calls the slow class
        tok = cls.from_pretrained(str(folder))
        msg = [{"role": "user", "content": "a red car"}]
        text = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert text == want
        enc = tok(text, return_tensors="pt", padding="max_length", truncation=True, max_length=512)
        assert enc["input_ids"].shape == (1, 512)
        assert enc["input_ids"][0, -1].item() == tok.convert_tokens_to_ids("<|endoftext|>")
        assert 0 < int(enc["attention_mask"].sum()) < 40
        ids.append(enc["input_ids"])
    assert torch.equal(ids[0], ids[1])
    assert int(ids[0].max()) < specs.FLUX2_PRESETS["random_flux2_klein_tiny"]["text_encoder"]["vocab_size"]


# --------------------------------------------------------------------------------------------- FLUX.2 klein tiny


@pytest.fixture(scope="module")
def klein_tiny(musubi, tmp_path_factory):
    lines: list[str] = []
    cache = tmp_path_factory.mktemp("models")
    paths = rm.ensure_random_musubi_model(cache, "random_flux2_klein_tiny", log=lines.append)
    return paths, lines


@need_musubi
def test_klein_tiny_files_are_complete_and_reused(klein_tiny):
    paths, lines = klein_tiny
    folder = paths["dit"].parent
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["dit.safetensors", "spec.json", "text_encoder.safetensors", "vae.safetensors"]
    spec = json.loads((folder / "spec.json").read_text())
    assert spec["family"] == "flux2" and spec["random_weights"] and spec["model_version"] == "klein-base-4b"
    assert any("generating" in line for line in lines)
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    again: list[str] = []
    assert rm.ensure_random_musubi_model(folder.parent, "random_flux2_klein_tiny", log=again.append) == paths
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes
    assert any("using" in line for line in again)


@need_musubi
def test_klein_tiny_loads_in_musubi_tuners_loaders_and_runs_forward(klein_tiny, musubi):
    paths, _ = klein_tiny
    done = rm.install_random_model(paths["dit"])
    assert len(done) == 2
    flux2_utils = musubi("flux_2.flux2_utils")
    info = flux2_utils.FLUX2_MODEL_INFO["klein-base-4b"]
    dit = flux2_utils.load_flow_model("cpu", info, str(paths["dit"]), "torch", False, "cpu", torch.bfloat16)
    ae = flux2_utils.load_ae(str(paths["vae"]), torch.float32, "cpu", disable_mmap=True)
    te = flux2_utils.load_text_embedder(info, str(paths["text_encoder"]), torch.bfloat16, "cpu", disable_mmap=True)
    assert dit.hidden_size == 256 and len(dit.double_blocks) == 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ctx = te(["a photo of a cat"])
        assert ctx.shape == (1, 512, 192)
        z = ae.encode(torch.rand(1, 3, 64, 48) * 2 - 1)
        assert z.shape == (1, 128, 4, 3)
        x, x_ids = flux2_utils.prc_img(z.to(torch.bfloat16))
        c, c_ids = flux2_utils.prc_txt(ctx)
        t = torch.tensor([0.5])
        out = dit(x=x, x_ids=x_ids, timesteps=t, ctx=c, ctx_ids=c_ids, guidance=None)
        assert out.shape == (1, 12, 128)
        assert ae.decode(z).shape == (1, 3, 64, 48)
    for tensor in (ctx, z, out):
        assert torch.isfinite(tensor).all() and tensor.float().std() > 0


@need_musubi
def test_install_is_undone_and_ignores_foreign_files(klein_tiny, musubi, tmp_path):
    paths, _ = klein_tiny
    flux2_utils, flux2_models = musubi("flux_2.flux2_utils"), musubi("flux_2.flux2_models")
    rm.install_random_model(paths["dit"])
    rm.install_random_model(paths["dit"])  # twice: still derived from the originals
    assert flux2_utils.FLUX2_MODEL_INFO["klein-base-4b"].params.hidden_size == 256
    rm.uninstall_random_model()
    assert flux2_utils.FLUX2_MODEL_INFO["klein-base-4b"].params == flux2_models.Klein4BParams()
    assert flux2_models.AutoEncoderParams().ch == 128
    assert musubi("zimage.zimage_utils").Qwen2Tokenizer.from_pretrained.__self__.__module__.startswith("transformers")
    assert rm.install_random_model(tmp_path / "someone_elses_dit.safetensors") == []


# ---------------------------------------------------------------------------------- FLUX.2 klein 4B, 9B (meta)


@need_musubi
@pytest.mark.parametrize(
    ("preset", "version", "is_8b", "billions"),
    [
        ("random_flux2_klein_4b", "klein-base-4b", False, (3.5, 4.5)),
        ("random_flux2_klein_9b", "klein-base-9b", True, (8.5, 9.5)),
    ],
)
def test_full_klein_preset_is_what_musubi_tuner_builds_for_its_version(musubi, monkeypatch, preset, version, is_8b,
                                                                        billions):  # fmt: skip
    from accelerate import init_empty_weights
    from transformers import Qwen3ForCausalLM

    flux2_utils, flux2_models = musubi("flux_2.flux2_utils"), musubi("flux_2.flux2_models")
    zimage_utils = musubi("zimage.zimage_utils")
    full = specs.FLUX2_PRESETS[preset]
    assert full["model_version"] == version
    with init_empty_weights():
        theirs_dit = flux2_models.Flux2(flux2_utils.FLUX2_MODEL_INFO[version].params)
        theirs_ae = flux2_models.AutoEncoder(flux2_models.AutoEncoderParams())
    assert _shapes(rm.plan_flux2_part("dit", full["dit"])) == _shapes(plan_part(theirs_dit))
    assert _shapes(rm.plan_flux2_part("vae", full["vae"])) == _shapes(plan_part(theirs_ae))
    n_dit = sum(p.numel() for p in theirs_dit.parameters())
    assert billions[0] * 1e9 < n_dit < billions[1] * 1e9, n_dit

    captured = {}

    def capture(**config):
        captured["config"] = config
        raise LookupError("captured")

    monkeypatch.setattr(zimage_utils, "Qwen3Config", capture)  # musubi-tuner's literal config, before it builds
    with pytest.raises(LookupError, match="captured"):
        zimage_utils.load_qwen3(None, None, "cpu", state_dict={}, is_8b=is_8b)
    config = captured["config"]
    assert {k: config[k] for k in full["text_encoder"]} == full["text_encoder"]
    ours = {**rm.QWEN3_BASE, **full["text_encoder"]}
    assert {k: config[k] for k in ours} == ours
    from transformers import Qwen3Config

    with init_empty_weights():
        theirs_te = Qwen3ForCausalLM._from_config(Qwen3Config(**config))
    want = {k: v for k, v in _shapes(plan_part(theirs_te)).items() if k != "lm_head.weight"}
    assert _shapes(rm.plan_flux2_part("text_encoder", full["text_encoder"])) == want


@need_musubi
def test_klein_4b_refuses_a_disk_too_small_and_writes_nothing(musubi, monkeypatch, tmp_path):
    free = types.SimpleNamespace(disk_usage=lambda _: types.SimpleNamespace(free=10**9))  # 1 GB left
    from flux_trainer.sdscripts import random_model as writer  # the part writer both trainers' presets share

    monkeypatch.setattr(writer, "shutil", free)
    with pytest.raises(ConfigError, match=r"random model 'random_flux2_klein_4b' needs 1[5-7]\.\d GB .* 1\.0 GB free"):
        rm.ensure_random_musubi_model(tmp_path, "random_flux2_klein_4b", device="cpu", log=lambda _: None)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


# ---------------------------------------------------------------------------------------------- FLUX.1 Kontext


def _sd_scripts():
    from flux_trainer.sdscripts.checkout import locate

    try:
        return locate()
    except ConfigError:
        return None


need_sd_scripts = pytest.mark.skipif(
    _sd_scripts() is None, reason="Kontext presets are sd-scripts' random sets: needs an sd-scripts checkout"
)


@need_musubi
@need_sd_scripts
def test_kontext_tiny_loads_in_musubi_tuners_loaders_and_runs_forward(musubi, tmp_path):
    paths = rm.ensure_random_musubi_model(tmp_path, "random_kontext_tiny", log=lambda _: None)
    assert set(paths) == {"dit", "vae", "text_encoder1", "text_encoder2", "tokenizer1", "tokenizer2"}
    assert len(rm.install_random_model(paths["dit"])) == 2
    flux_utils = musubi("flux.flux_utils")
    dit = flux_utils.load_flow_model(str(paths["dit"]), torch.bfloat16, "cpu", disable_mmap=True, attn_mode="torch")
    ae = flux_utils.load_ae(str(paths["vae"]), torch.float32, "cpu", disable_mmap=True)
    tok1, t5 = flux_utils.load_t5xxl(str(paths["text_encoder1"]), torch.bfloat16, "cpu", disable_mmap=True)
    tok2, clip = flux_utils.load_clip_l(str(paths["text_encoder2"]), torch.bfloat16, "cpu", disable_mmap=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        t5_ids = tok1(["a cat"], max_length=512, padding="max_length", truncation=True, return_tensors="pt")
        txt = t5(input_ids=t5_ids["input_ids"])["last_hidden_state"]
        l_ids = tok2(["a cat"], max_length=77, padding="max_length", truncation=True, return_tensors="pt")
        y = clip(l_ids["input_ids"])["pooler_output"]
        z = ae.encode(torch.rand(2, 3, 64, 64) * 2 - 1)  # target and reference
        assert z.shape == (2, 16, 8, 8)
        packed = z.reshape(2, 16, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 64).to(torch.bfloat16)
        img = torch.cat([packed[:1], packed[1:]], dim=1)
        ids = torch.cat([flux_utils.prepare_img_ids(1, 4, 4), flux_utils.prepare_img_ids(1, 4, 4, is_ctrl=True)], 1)
        out = dit(
            img=img, img_ids=ids, txt=txt, txt_ids=torch.zeros(1, 512, 3), timesteps=torch.tensor([0.5]), y=y,
            guidance=torch.tensor([1.0]), control_lengths=[16],
        )  # fmt: skip
    assert out.shape == (1, 32, 64) and torch.isfinite(out).all() and out.float().std() > 0
    assert txt.shape == (1, 512, 64) and y.shape == (1, 64)


@need_musubi
@need_sd_scripts
def test_kontext_full_is_sd_scripts_full_set_as_musubi_tuner_builds_it(musubi, monkeypatch):
    """musubi-tuner's Kontext DiT, AE, CLIP-L and T5 (its literal configs) have exactly the keys and shapes of
    sd-scripts' full random set, so that set's files serve both trainers unpatched."""
    from accelerate import init_empty_weights
    from transformers import CLIPTextModel, T5EncoderModel

    from flux_trainer.sdscripts import random_model as sd_rm
    from flux_trainer.sdscripts.checkout import import_sd_scripts

    flux_utils, flux_models = musubi("flux.flux_utils"), musubi("flux.flux_models")
    ours = sd_rm.plan_preset("full", import_sd_scripts(_sd_scripts().path))
    spec = flux_models.configs_flux_dev_context
    with init_empty_weights():
        assert _shapes(ours["flux"]) == _shapes(plan_part(flux_models.Flux(spec.params)))
        assert _shapes(ours["ae"]) == _shapes(plan_part(flux_models.AutoEncoder(spec.ae_params)))
    captured = {}
    for name in ("CLIPConfig", "T5Config"):
        real = getattr(flux_utils, name)

        def capture(*args, _real=real, _name=name, **kwargs):
            captured[_name] = _real(*args, **kwargs)
            raise LookupError("captured")

        monkeypatch.setattr(flux_utils, name, capture)
    for load in (flux_utils.load_clip_l, flux_utils.load_t5xxl):
        with pytest.raises(LookupError):
            load(None, None, "cpu", state_dict={})
    with init_empty_weights():
        clip = CLIPTextModel._from_config(captured["CLIPConfig"])
        t5 = T5EncoderModel._from_config(captured["T5Config"])
    assert _shapes(ours["clip_l"]) == _shapes(plan_part(clip))
    assert _shapes(ours["t5xxl"]) == _shapes(plan_part(t5))
    assert not dataclasses.is_dataclass(captured["T5Config"])  # a transformers config, as musubi-tuner builds it
