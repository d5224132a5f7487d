"""Model files recognised from their safetensors header alone: crafted files with the key names and dtypes of each
kind (tiny tensors: what a file is must come from names and dtypes, never sizes)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from flux_trainer.doctor import models as doctor_models
from flux_trainer.doctor.models import HeaderError, classify, model_part_check, read_header

BF16, F16, F32, E4M3, E5M2 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2


def t(dtype=BF16, *shape):
    return torch.ones(*(shape or (2, 2)), dtype=torch.float32).to(dtype)


def flux_bfl(dev=True, weights=BF16, prefix=""):
    sd = {}
    for i in range(2):
        sd[f"double_blocks.{i}.img_attn.qkv.weight"] = t(weights)
        sd[f"double_blocks.{i}.img_attn.proj.bias"] = t(BF16, 2)
        sd[f"double_blocks.{i}.img_attn.norm.query_norm.scale"] = t(BF16, 2)
    for i in range(3):
        sd[f"single_blocks.{i}.linear1.weight"] = t(weights)
        sd[f"single_blocks.{i}.modulation.lin.bias"] = t(BF16, 2)
    for k in ("img_in.weight", "txt_in.weight", "time_in.in_layer.weight", "vector_in.in_layer.weight"):
        sd[k] = t(BF16)
    if dev:
        sd["guidance_in.in_layer.weight"], sd["guidance_in.in_layer.bias"] = t(BF16), t(BF16, 2)
    return {prefix + k: v for k, v in sd.items()}


def flux_diffusers(dev=True):
    sd = {
        "transformer_blocks.0.attn.to_q.weight": t(),
        "transformer_blocks.0.attn.add_k_proj.bias": t(BF16, 2),
        "single_transformer_blocks.0.attn.to_k.bias": t(BF16, 2),
        "x_embedder.weight": t(),
    }
    if dev:
        sd["time_text_embed.guidance_embedder.linear_1.weight"] = t()
    return sd


def ae_bfl(dtype=F32):
    return {
        "encoder.conv_in.weight": t(dtype, 2, 3, 3, 3),
        "encoder.down.0.block.0.conv1.weight": t(dtype, 2, 2, 3, 3),
        "encoder.conv_out.weight": t(dtype, 2, 2, 3, 3),
        "decoder.conv_in.weight": t(dtype, 2, 2, 3, 3),
        "decoder.up.0.block.0.conv1.weight": t(dtype, 2, 2, 3, 3),
    }


def ae_diffusers():
    return {
        "encoder.conv_in.weight": t(F32, 2, 3, 3, 3),
        "encoder.down_blocks.0.resnets.0.conv1.weight": t(F32, 2, 2, 3, 3),
        "decoder.conv_in.weight": t(F32, 2, 2, 3, 3),
        "decoder.up_blocks.0.resnets.0.conv1.weight": t(F32, 2, 2, 3, 3),
    }


def sd_vae():
    return {**ae_bfl(), "quant_conv.weight": t(F32, 8, 8, 1, 1), "post_quant_conv.weight": t(F32, 4, 4, 1, 1)}


def clip_l(layers=12, prefix="", dtype=F16):
    sd = {"text_model.embeddings.token_embedding.weight": t(dtype), "text_model.final_layer_norm.weight": t(dtype, 2)}
    for i in range(layers):
        sd[f"text_model.encoder.layers.{i}.self_attn.q_proj.weight"] = t(dtype)
    return {prefix + k: v for k, v in sd.items()}


def t5(dtype=F16, blocks=24, prefix=""):
    sd = {"shared.weight": t(F16 if dtype in (E4M3, E5M2) else dtype)}  # fp8 files keep the embedding in fp16
    for i in range(blocks):
        sd[f"encoder.block.{i}.layer.0.SelfAttention.q.weight"] = t(dtype)
        sd[f"encoder.block.{i}.layer.0.layer_norm.weight"] = t(F16, 2)
    sd["encoder.final_layer_norm.weight"] = t(F16, 2)
    return {prefix + k: v for k, v in sd.items()}


@pytest.fixture
def write(tmp_path):
    def _write(name, sd, metadata=None):
        path = tmp_path / f"{name}.safetensors"
        save_file(sd, str(path), metadata=metadata)
        return path

    return _write


def kind_of(path):
    return classify(read_header(path))


@pytest.mark.parametrize(
    ("sd", "kind", "layout", "variant", "dtype"),
    [
        (flux_bfl(dev=True), "flux", "bfl", "dev", "bf16"),
        (flux_bfl(dev=False), "flux", "bfl", "schnell", "bf16"),
        (flux_bfl(weights=E4M3), "flux", "bfl", "dev", "fp8_e4m3fn"),
        (flux_bfl(weights=F16), "flux", "bfl", "dev", "fp16"),
        (flux_bfl(prefix="model.diffusion_model."), "flux", "bfl", "dev", "bf16"),
        (flux_diffusers(dev=True), "flux", "diffusers", "dev", "bf16"),
        (flux_diffusers(dev=False), "flux", "diffusers", "schnell", "bf16"),
        (ae_bfl(), "ae", "bfl", "", "fp32"),
        (ae_bfl(BF16), "ae", "bfl", "", "bf16"),
        (ae_diffusers(), "ae", "diffusers", "", "fp32"),
        (sd_vae(), "ae", "sd_vae", "", "fp32"),
        (clip_l(), "clip_l", "transformers", "", "fp16"),
        (clip_l(prefix="text_encoders.clip_l.transformer."), "clip_l", "prefixed", "", "fp16"),
        (t5(F16), "t5xxl", "transformers", "", "fp16"),
        (t5(E4M3), "t5xxl", "transformers", "", "fp8_e4m3fn"),
        (t5(BF16), "t5xxl", "transformers", "", "bf16"),
    ],
    ids=[
        "flux-dev", "flux-schnell", "flux-dev-fp8", "flux-dev-fp16", "flux-comfy-prefix", "flux-diffusers-dev",
        "flux-diffusers-schnell", "ae", "ae-bf16", "ae-diffusers", "sd-vae", "clip-l", "clip-l-prefixed",
        "t5-fp16", "t5-fp8", "t5-bf16",
    ],
)  # fmt: skip
def test_every_kind_is_recognised_from_the_header(write, sd, kind, layout, variant, dtype):
    info = kind_of(write("m", sd))
    assert (info.kind, info.layout, info.variant, info.dtype) == (kind, layout, variant, dtype)
    assert info.tensors == len(sd)


def test_block_counts_come_from_key_names(write):
    assert kind_of(write("f", flux_bfl())).blocks == "2 double + 3 single blocks"
    assert kind_of(write("t", t5(blocks=24))).blocks == "24 blocks"
    assert kind_of(write("c", clip_l(layers=12))).blocks == "12 layers"


def test_a_large_file_is_judged_from_its_header_without_reading_its_data(tmp_path):
    """A (sparse) 4 GiB 'checkpoint' whose data is all zeros: only the header can have been read."""
    n = 2**31
    header = {
        "double_blocks.0.img_attn.qkv.weight": {"dtype": "BF16", "shape": [n // 2], "data_offsets": [0, n]},
        "single_blocks.0.linear1.weight": {"dtype": "BF16", "shape": [n // 2], "data_offsets": [n, 2 * n]},
        "guidance_in.in_layer.bias": {"dtype": "BF16", "shape": [0], "data_offsets": [2 * n, 2 * n]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 2 * n)
    info = kind_of(path)
    assert (info.kind, info.variant, info.dtype) == ("flux", "dev", "bf16")


def test_a_truncated_download_fails(write):
    path = write("f", flux_bfl())
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(HeaderError, match="truncated"):
        read_header(path)
    row = model_part_check("flux", path)
    assert row.status == "fail" and "truncated" in row.evidence and "download" in row.fix


def test_a_file_that_is_not_safetensors_fails(tmp_path):
    path = tmp_path / "flux1-dev.safetensors"
    path.write_bytes(b"<html>404 Not Found</html> and more text to fill the eight byte length")
    row = model_part_check("flux", path)
    assert row.status == "fail" and "not a safetensors file" in row.evidence


def test_a_missing_file_fails_unless_it_is_a_random_preset_generated_at_first_run(tmp_path):
    missing = tmp_path / "nope.safetensors"
    row = model_part_check("t5xxl", missing)
    assert row.status == "fail" and "does not exist" in row.evidence and "model.t5xxl" in row.fix
    assert model_part_check("t5xxl", missing, random_preset=True).status == "pass"


def test_the_wrong_kind_of_file_for_a_part_fails_and_says_what_it_is(write):
    row = model_part_check("t5xxl", write("c", clip_l()))
    assert row.status == "fail" and "CLIP" in row.evidence and "model.t5xxl" in row.fix


@pytest.mark.parametrize(("part", "sd"), [("ae", ae_diffusers()), ("ae", sd_vae()), ("clip_l", clip_l(prefix="x."))])
def test_layouts_sd_scripts_cannot_load_fail(write, part, sd):
    row = model_part_check(part, write("m", sd))
    assert row.status == "fail", row.evidence


@pytest.mark.parametrize(
    ("part", "sd", "kwargs", "status"),
    [
        ("flux", flux_bfl(dev=True), {"model_name": "flux_dev"}, "pass"),
        ("flux", flux_bfl(dev=False), {"model_name": "flux_dev"}, "warn"),  # trains, but not what the config says
        ("flux", flux_bfl(dev=True), {"model_name": "flux_schnell"}, "warn"),
        ("flux", flux_diffusers(), {"model_name": "flux_dev"}, "pass"),  # sd-scripts converts it
        ("flux", flux_bfl(weights=E4M3), {"model_name": "flux_dev", "fp8_base": True}, "pass"),
        ("flux", flux_bfl(weights=E4M3), {"model_name": "flux_dev"}, "warn"),  # upcast at load
        ("flux", flux_bfl(weights=E5M2), {"model_name": "flux_dev", "fp8_base": True}, "fail"),  # sd-scripts refuses
        ("t5xxl", t5(E4M3), {"fp8_base": True}, "pass"),
        ("t5xxl", t5(E5M2), {"fp8_base": True}, "fail"),
        ("clip_l", clip_l(layers=32), {}, "warn"),  # CLIP-G, not CLIP-L
        ("ae", ae_bfl(), {}, "pass"),
    ],
)
def test_what_the_file_is_against_what_the_config_asks(write, part, sd, kwargs, status):
    row = model_part_check(part, write("m", sd), **kwargs)
    assert row.status == status, row.evidence
    assert row.data["kind"] == part


def test_random_weights_are_flagged_when_the_config_names_a_real_model(write):
    path = write("f", flux_bfl(), metadata={"flux_trainer.random_weights": "true"})
    assert "RANDOM WEIGHTS" in model_part_check("flux", path, model_name="random_tiny").evidence
    assert model_part_check("flux", path, model_name="random_tiny").status == "pass"
    assert model_part_check("flux", path, model_name="flux_dev").status == "warn"


def test_a_diffusers_folder_is_read_from_its_transformer_shards(tmp_path):
    folder = tmp_path / "FLUX.1-dev" / "transformer"
    folder.mkdir(parents=True)
    sd = flux_diffusers()
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:2]}, str(folder / "diffusion_pytorch_model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[2:]}, str(folder / "diffusion_pytorch_model-00002-of-00002.safetensors"))
    row = model_part_check("flux", folder.parent, model_name="flux_dev")
    assert row.status == "pass" and row.data["layout"] == "diffusers" and row.data["variant"] == "dev"


def test_model_checks_follow_the_composed_config(compose, write):
    paths = {"flux": write("f", flux_bfl()), "ae": write("a", ae_bfl()), "clip_l": write("c", clip_l())}
    paths["t5xxl"] = write("t", t5())
    cfg = compose(*(f"model.{p}={v}" for p, v in paths.items()))
    rows = doctor_models.model_checks(cfg)
    assert [r.check for r in rows] == ["model: flux", "model: ae", "model: clip_l", "model: t5xxl"]
    assert all(r.status == "pass" for r in rows), [r.evidence for r in rows]
    cfg = compose(f"model.flux={paths['ae']}")
    assert doctor_models.model_checks(cfg)[0].status == "fail"


def test_fp8_base_follows_the_memory_tier_auto_picks_for_the_card(compose):
    from flux_trainer.launch.device import DeviceInfo

    def card(vram):
        return DeviceInfo("NVIDIA GPU", 0, (8, 9), "ada", vram, 1, True, True)

    cfg = compose()  # memory=auto, precision=bf16
    assert doctor_models.effective_fp8_base(cfg, card(15.6)) is True  # vram16: fp8 base
    assert doctor_models.effective_fp8_base(cfg, card(139.8)) is False  # vram80: the precision decides
    assert doctor_models.effective_fp8_base(compose("precision=fp8_base"), card(139.8)) is True
    assert doctor_models.effective_fp8_base(compose("memory=vram48"), card(15.6)) is True  # an explicit tier stays
    assert doctor_models.effective_fp8_base(compose("memory=vram48", "memory.fp8_base=false"), card(15.6)) is False


def chroma_bfl():
    """Chroma's layout: FLUX.1 blocks without their modulation weights, and the distilled guidance layer."""
    flux = flux_bfl(dev=False).items()
    sd = {k: v for k, v in flux if "modulation" not in k and not k.startswith(("time_in", "vector_in"))}
    sd["distilled_guidance_layer.in_proj.weight"] = t()
    sd["distilled_guidance_layer.layers.0.in_layer.weight"] = t()
    return sd


def test_a_chroma_checkpoint_given_to_a_flux_model_names_the_chroma_preset(write):
    path = write("chroma", chroma_bfl())
    assert kind_of(path).variant == "chroma"
    row = model_part_check("flux", path, model_name="flux_dev")
    assert row.status == "fail" and "a Chroma checkpoint" in row.evidence and row.fix == "use model=chroma"
    assert model_part_check("flux", path, model_name="chroma", model_type="chroma").status == "pass"
    row = model_part_check("flux", write("dev", flux_bfl()), model_name="chroma", model_type="chroma")
    assert row.status == "fail" and "model=flux_dev" in row.fix


def test_model_checks_of_chroma_skip_clip_l(compose, write):
    paths = {"flux": write("f", chroma_bfl()), "ae": write("a", ae_bfl()), "t5xxl": write("t", t5())}
    rows = doctor_models.model_checks(compose("model=chroma", *(f"model.{p}={v}" for p, v in paths.items())))
    assert [r.check for r in rows] == ["model: flux", "model: ae", "model: t5xxl"]
    assert all(r.status == "pass" for r in rows), [r.evidence for r in rows]


def ae_with_latents(channels):
    return {**ae_bfl(BF16), "decoder.conv_in.weight": t(BF16, 4, channels, 3, 3)}


@pytest.mark.parametrize(
    ("channels", "model_type", "status", "needle"),
    [
        (16, "flux", "pass", "FLUX.1 autoencoder (16 latent channels)"),
        (32, "flux2", "pass", "FLUX.2 autoencoder (32 latent channels)"),
        (16, "flux2", "fail", "encodes its images with FLUX.2's (32 latent channels) autoencoder"),
        (32, "flux", "fail", "encodes its images with FLUX.1's (16 latent channels) autoencoder"),
        (32, "kontext", "fail", "FLUX.1's (16 latent channels)"),
        (32, "chroma", "fail", "FLUX.1's (16 latent channels)"),
    ],
)
def test_an_autoencoder_of_the_other_flux_is_refused_before_it_would_fail_at_caching(
    write, channels, model_type, status, needle
):
    """FLUX.1's and FLUX.2's autoencoders have the same key names; their latent channels (16 / 32) tell them apart.
    The wrong one would load and then fail at the latent caching, minutes in: the doctor (and so the run's
    preflight) refuses it first."""
    path = write("ae", ae_with_latents(channels))
    row = model_part_check("ae", path, model_name=f"my_{model_type}", model_type=model_type)
    assert row.status == status and needle in row.evidence, row
    if status == "fail":
        assert row.fix.startswith("set model.ae to FLUX.")
