"""Random model sets: the tiny preset is generated, loaded and run through sd-scripts' own text-encoding and FLUX
call path on CPU; the full preset is checked against sd-scripts' real loaders on the meta device only (its files
are ~34 GB and are generated on a GPU, never here)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from flux_trainer.config.errors import ConfigError
from flux_trainer.config.random_specs import PARTS, PRESETS, needs_custom_loader
from flux_trainer.sdscripts import random_model as rm
from flux_trainer.sdscripts.checkout import import_sd_scripts, locate


def _find_checkout():
    try:
        return locate()
    except ConfigError as exc:
        return exc


CHECKOUT = _find_checkout()
pytestmark = [
    pytest.mark.sd_scripts,
    pytest.mark.skipif(
        isinstance(CHECKOUT, ConfigError), reason=f"needs an sd-scripts checkout, none found: {CHECKOUT}"
    ),
]


@pytest.fixture(scope="module")
def mods():
    return import_sd_scripts(CHECKOUT.path)


@pytest.fixture(scope="module")
def tiny(mods, tmp_path_factory):
    lines: list[str] = []
    paths = rm.ensure_random_model(tmp_path_factory.mktemp("models"), "tiny", log=lines.append)
    return paths, lines


def _mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


# --------------------------------------------------------------------------------------------------- tiny preset


def test_tiny_files_are_complete_marked_and_keyed_like_the_modules(tiny, mods):
    paths, lines = tiny
    folder = paths["flux"].parent
    assert sorted(p.name for p in folder.iterdir()) == sorted([*(f"{part}.safetensors" for part in PARTS), "spec.json"])
    assert any("RANDOM WEIGHTS (preset tiny)" in line and "not a real model" in line for line in lines)
    assert sum("random model tiny: wrote" in line for line in lines) == len(PARTS)

    spec = json.loads((folder / "spec.json").read_text())
    assert spec["random_weights"] is True and spec["sd_scripts_commit"] == CHECKOUT.commit
    assert {part: spec[part] for part in PARTS} == PRESETS["tiny"]
    assert rm.is_random_model(paths["flux"])
    assert rm.needs_custom_loader(folder)

    for part in PARTS:
        expected = rm.build_empty(mods, part, PRESETS["tiny"][part]).state_dict()
        with safe_open(str(paths[part]), framework="pt") as f:
            assert f.metadata()["flux_trainer.random_weights"] == "true"
            assert f.metadata()["flux_trainer.part"] == part
            assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == {
                k: tuple(v.shape) for k, v in expected.items()
            }
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_tiny_initialisation(tiny):
    paths, _ = tiny
    with safe_open(str(paths["flux"]), framework="pt") as f:
        assert torch.all(f.get_tensor("double_blocks.0.img_attn.norm.query_norm.scale") == 1)
        assert torch.all(f.get_tensor("img_in.bias") == 0)
        std = f.get_tensor("double_blocks.0.img_mlp.0.weight").float().std().item()
    assert 0.018 < std < 0.022
    with safe_open(str(paths["t5xxl"]), framework="pt") as f:
        assert torch.equal(f.get_tensor("shared.weight"), f.get_tensor("encoder.embed_tokens.weight"))
        assert torch.all(f.get_tensor("encoder.final_layer_norm.weight") == 1)


def test_tiny_runs_through_sd_scripts_encoding_and_flux_call(tiny, mods):
    from library import strategy_flux

    paths, _ = tiny
    clip_l, t5xxl, ae, flux = rm.load_random_models(paths["flux"].parent, torch.bfloat16)
    for model in (clip_l, t5xxl, ae, flux):
        assert not model.training
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}

    gen = torch.Generator().manual_seed(0)
    l_tokens = torch.randint(3, 49000, (1, 77), generator=gen)
    t5_tokens = torch.randint(2, 32000, (1, 16), generator=gen)
    mask = torch.ones_like(t5_tokens)
    with torch.no_grad():
        l_pooled, t5_out, txt_ids, _ = strategy_flux.FluxTextEncodingStrategy(False).encode_tokens(
            None, [clip_l, t5xxl], [l_tokens, t5_tokens, mask]
        )
        latents = ae.encode(torch.rand(1, 3, 64, 64, generator=gen, dtype=torch.bfloat16) * 2 - 1)
        assert latents.shape == (1, 16, 8, 8)
        # as flux_train_network.get_noise_pred_and_target calls the model
        img = mods.flux_utils.pack_latents(latents)
        img_ids = mods.flux_utils.prepare_img_ids(1, 4, 4).to(torch.bfloat16)
        out = flux(
            img=img,
            img_ids=img_ids,
            txt=t5_out,
            txt_ids=txt_ids,
            y=l_pooled,
            timesteps=torch.tensor([0.5], dtype=torch.bfloat16),
            guidance=torch.full((1,), 1.0, dtype=torch.bfloat16),
            txt_attention_mask=None,
        )
        decoded = ae.decode(latents)
    assert l_pooled.shape == (1, PRESETS["tiny"]["flux"]["vec_in_dim"])
    assert t5_out.shape == (1, 16, PRESETS["tiny"]["flux"]["context_in_dim"])
    assert out.shape == img.shape == (1, 16, 64)
    assert torch.isfinite(out).all() and out.float().std() > 0
    assert decoded.shape == (1, 3, 64, 64) and torch.isfinite(decoded).all()


def test_sd_scripts_reads_tiny_block_counts_but_not_its_widths(tiny, mods):
    paths, _ = tiny
    is_diffusers, is_schnell, blocks, _ = mods.flux_utils.analyze_checkpoint_state(str(paths["flux"]))
    assert (is_diffusers, is_schnell, blocks) == (False, False, (1, 1))
    # why load_random_models exists: sd-scripts keeps FLUX.1-dev's widths and cannot take the tiny tensors
    with pytest.raises(RuntimeError, match="size mismatch"):
        mods.flux_utils.load_flow_model(str(paths["flux"]), torch.bfloat16, "cpu")


def test_second_call_rewrites_nothing_and_an_interrupted_set_is_finished(tiny, tmp_path):
    paths, _ = tiny
    cache = tmp_path / "cache"
    shutil.copytree(paths["flux"].parent, cache / paths["flux"].parent.name, copy_function=shutil.copy2)
    folder = cache / paths["flux"].parent.name
    before = _mtimes(folder)
    lines: list[str] = []
    assert rm.ensure_random_model(cache, "tiny", log=lines.append) == {p: folder / f"{p}.safetensors" for p in PARTS}
    assert _mtimes(folder) == before
    assert not any("wrote" in line for line in lines)

    # interrupted: t5 never renamed into place, spec.json never written
    t5_bytes = (folder / "t5xxl.safetensors").read_bytes()
    (folder / "t5xxl.safetensors").unlink()
    (folder / "spec.json").unlink()
    rm.ensure_random_model(cache, "tiny", log=lines.append)
    after = _mtimes(folder)
    assert {p: after[p] for p in ("flux.safetensors", "ae.safetensors")} == {
        p: before[p] for p in ("flux.safetensors", "ae.safetensors")
    }
    assert (folder / "t5xxl.safetensors").read_bytes() == t5_bytes  # same seed, same weights
    assert (folder / "spec.json").is_file()


def test_failed_write_leaves_no_file(mods, tmp_path, monkeypatch):
    plans = rm.plan_part(rm.build_empty(mods, "ae", PRESETS["tiny"]["ae"]))
    calls = iter(range(10**6))

    def failing(plan, device, gen):
        if next(calls) == 5:
            raise OSError("disk full")
        return torch.zeros(plan.shape, dtype=rm.DTYPE)

    monkeypatch.setattr(rm, "_make_tensor", failing)
    with pytest.raises(OSError, match="disk full"):
        rm.write_part(tmp_path / "ae.safetensors", plans, torch.device("cpu"), 0, {"format": "pt"})
    assert list(tmp_path.iterdir()) == []


def test_is_random_model_needs_the_spec(tmp_path):
    (tmp_path / "flux.safetensors").write_bytes(b"")
    assert not rm.is_random_model(tmp_path / "flux.safetensors")
    with pytest.raises(ConfigError, match="spec.json"):
        rm.needs_custom_loader(tmp_path)


# --------------------------------------------------------------------------------------------------- full preset


def _meta(plans):
    """What the generator would write, as meta tensors in a dtype no loader uses, so we can tell afterwards that
    every parameter of the loaded module came from our file."""
    return {p.name: torch.empty(p.shape, dtype=torch.float16, device="meta") for p in plans}


def _assert_loaded_from(model, plans):
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {p.name: p.shape for p in plans}
    assert {p.dtype for p in model.parameters()} == {torch.float16}  # nothing left from the loader's own init


def test_full_preset_is_what_sd_scripts_loaders_expect(mods, monkeypatch):
    plans = rm.plan_preset("full", mods)
    fu = mods.flux_utils
    flux_keys = [p.name for p in plans["flux"]]

    @contextlib.contextmanager
    def fake_safe_open(path, framework):
        yield type("F", (), {"keys": lambda self: list(flux_keys)})()

    sources = {"flux.safetensors": _meta(plans["flux"]), "ae.safetensors": _meta(plans["ae"])}
    monkeypatch.setattr(fu, "safe_open", fake_safe_open)
    monkeypatch.setattr(fu, "load_safetensors", lambda path, **kw: dict(sources[path]))

    assert fu.analyze_checkpoint_state("flux.safetensors")[:3] == (False, False, (19, 38))
    is_schnell, flux = fu.load_flow_model("flux.safetensors", None, "cpu")
    assert not is_schnell
    _assert_loaded_from(flux, plans["flux"])
    _assert_loaded_from(fu.load_ae("ae.safetensors", torch.float32, "cpu"), plans["ae"])
    clip = fu.load_clip_l(None, torch.float32, "cpu", state_dict=_meta(plans["clip_l"]))
    _assert_loaded_from(clip, plans["clip_l"])
    t5 = fu.load_t5xxl(None, torch.float32, "cpu", state_dict=_meta(plans["t5xxl"]))
    _assert_loaded_from(t5, plans["t5xxl"])
    assert sum(p.numel() for p in flux.parameters()) > 11.9e9


def test_full_preset_builds_the_same_models_as_sd_scripts(mods, tmp_path):
    dev = mods.flux_models.configs["dev"]
    assert dataclasses.replace(dev.params, **PRESETS["full"]["flux"]) == dev.params
    assert dataclasses.replace(dev.ae_params, **PRESETS["full"]["ae"]) == dev.ae_params
    # the effective CLIP/T5 configs of our modules must equal those sd-scripts' loaders build (all on meta)
    theirs_clip = mods.flux_utils.load_clip_l(None, torch.float32, "cpu", state_dict={}).config
    ours_clip = rm.build_empty(mods, "clip_l", PRESETS["full"]["clip_l"]).config
    for key in [*rm.CLIP_BASE, *PRESETS["full"]["clip_l"]]:
        assert getattr(ours_clip, key) == getattr(theirs_clip, key), key
    theirs_t5 = mods.flux_utils.load_t5xxl(None, torch.float32, "cpu", state_dict={}).config
    ours_t5 = rm.build_empty(mods, "t5xxl", PRESETS["full"]["t5xxl"]).config
    for key in [*rm.T5_BASE, *PRESETS["full"]["t5xxl"], "dense_act_fn", "is_gated_act"]:
        assert getattr(ours_t5, key) == getattr(theirs_t5, key), key

    (tmp_path / "spec.json").write_text(json.dumps(rm.spec_for("full", 0, CHECKOUT.commit)))
    assert not rm.needs_custom_loader(tmp_path)


def test_full_chroma_preset_is_what_sd_scripts_chroma_loader_expects(mods, monkeypatch):
    """model=random_chroma (the GPU bench's) goes through sd-scripts' own loader, which builds chroma_params and
    reads nothing from the file: every tensor it builds must be in ours, at its shape. No CLIP-L part at all."""
    import importlib

    chroma = importlib.import_module("library.chroma_models")
    assert dataclasses.replace(chroma.chroma_params, **PRESETS["chroma"]["flux"]) == chroma.chroma_params
    assert (PRESETS["chroma"]["ae"], PRESETS["chroma"]["t5xxl"]) == (PRESETS["full"]["ae"], PRESETS["full"]["t5xxl"])
    plans = rm.plan_preset("chroma", mods)
    assert sorted(plans) == ["ae", "flux", "t5xxl"]
    fu = mods.flux_utils
    monkeypatch.setattr(fu, "load_safetensors", lambda path, **kw: dict(_meta(plans["flux"])))
    is_schnell, flux = fu.load_flow_model("flux.safetensors", None, "cpu", model_type="chroma")
    assert not is_schnell and type(flux).__name__ == "Chroma"
    _assert_loaded_from(flux, plans["flux"])
    assert not needs_custom_loader(PRESETS["chroma"]) and needs_custom_loader(PRESETS["chroma_tiny"])
    assert not needs_custom_loader(PRESETS["full"]) and needs_custom_loader(PRESETS["tiny"])
