"""The ComfyUI copy of a FLUX.2 / Kontext LoRA (flux_trainer/musubi/lora_format.py), checked key by key against the
format's spec as docs/models.md ("The LoRA file") writes it down, not against the converter's own tables:

- ComfyUI (comfy/lora.py `model_lora_keys_unet`, comfy/weight_adapter/lora.py `LoRAAdapter.load`): for every weight
  `diffusion_model.M.weight` of the loaded DiT, a LoRA key `diffusion_model.M` with `.lora_B.weight` (up) and
  `.lora_A.weight` (down) patches it; so does kohya's `lora_unet_<M, dots as underscores>` (musubi-tuner's own file).
  Any other key is "lora key not loaded".
- diffusers for FLUX.2 (loaders/lora_conversion_utils.py `_convert_non_diffusers_flux2_lora_to_diffusers`): the
  `diffusion_model.` keys must be a block layer's lora_A/lora_B; anything left over (an `.alpha` too) is a ValueError.

The trained state dicts are made like the trainer's: the module names and shapes read from the LoRAs of two real
tiny runs (`flux-train +dataset=tiny model=random_flux2_klein_tiny train.max_steps=2`, and random_kontext_tiny with
control_images), and, with the checkout, musubi-tuner's own networks.lora_flux_2 / networks.lora_flux built over
its own DiT classes.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flux_trainer.config import ConfigError
from flux_trainer.musubi.lora_format import (
    COMFY_SUFFIX,
    FORMAT_KEY,
    LoraFormatError,
    comfy_path,
    summary_lines,
    to_comfy,
    write_comfy_copy,
)

# --------------------------------------------------------------------------------------------------- the spec
COMFY_KEY = re.compile(r"^diffusion_model\.(?P<module>[\w.]+)\.lora_(?P<ab>[AB])\.weight$")
DIFFUSERS_FLUX2_MODULE = re.compile(
    r"^(double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])|single_blocks\.\d+\.linear[12])$"
)

# ------------------------------------------------------------------------- what the tiny runs trained (rank 16)
# module (kohya name, block 0) -> (lora_down shape, lora_up shape), as read from each run's tiny.safetensors
KLEIN_TINY = {
    "double_blocks_0_img_attn_proj": ((16, 256), (256, 16)),
    "double_blocks_0_img_attn_qkv": ((16, 256), (768, 16)),
    "double_blocks_0_img_mlp_0": ((16, 256), (1536, 16)),
    "double_blocks_0_img_mlp_2": ((16, 768), (256, 16)),
    "double_blocks_0_txt_attn_proj": ((16, 256), (256, 16)),
    "double_blocks_0_txt_attn_qkv": ((16, 256), (768, 16)),
    "double_blocks_0_txt_mlp_0": ((16, 256), (1536, 16)),
    "double_blocks_0_txt_mlp_2": ((16, 768), (256, 16)),
    "single_blocks_0_linear1": ((16, 256), (2304, 16)),
    "single_blocks_0_linear2": ((16, 1024), (256, 16)),
}
KONTEXT_TINY = {
    **{k: v for k, v in KLEIN_TINY.items() if "attn" in k},
    "double_blocks_0_img_mlp_0": ((16, 256), (1024, 16)),
    "double_blocks_0_img_mlp_2": ((16, 1024), (256, 16)),
    "double_blocks_0_txt_mlp_0": ((16, 256), (1024, 16)),
    "double_blocks_0_txt_mlp_2": ((16, 1024), (256, 16)),
    "single_blocks_0_linear1": ((16, 256), (1792, 16)),
    "single_blocks_0_linear2": ((16, 1280), (256, 16)),
}
# the DiT weights those modules patch, as the model's state dict names them (what ComfyUI maps from)
TINY_DIT_WEIGHTS = {
    *(f"double_blocks.0.{s}_{m}.weight" for s in ("img", "txt") for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")),
    "single_blocks.0.linear1.weight",
    "single_blocks.0.linear2.weight",
    "img_in.weight",
    "txt_in.weight",
    "final_layer.linear.weight",
}


def blocks(tiny: dict, double: int, single: int) -> dict:
    """The tiny run's modules for a DiT of `double` and `single` blocks (the names repeat per block)."""
    out = {}
    for name, shapes in tiny.items():
        kind = "double_blocks_0_" if name.startswith("double") else "single_blocks_0_"
        for i in range(double if kind.startswith("double") else single):
            out[name.replace(kind, kind.replace("_0_", f"_{i}_"))] = shapes
    return out


def dit_weights(double: int, single: int) -> set[str]:
    out = set()
    for key in TINY_DIT_WEIGHTS:
        if key.startswith(("double_blocks.0.", "single_blocks.0.")):
            n = double if key.startswith("double") else single
            out |= {key.replace(".0.", f".{i}.", 1) for i in range(n)}
        else:
            out.add(key)
    return out


def trained(modules: dict, alpha: float = 16.0, dtype=torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A LoRA state dict as musubi-tuner saves it: lora_down, lora_up and a scalar alpha per module."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (down, up) in modules.items():
        sd[f"lora_unet_{name}.lora_down.weight"] = torch.randn(down, generator=g).to(dtype)
        sd[f"lora_unet_{name}.lora_up.weight"] = torch.randn(up, generator=g).to(dtype)
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(alpha).to(dtype)
    return sd


def spec_problems(original: dict, converted: dict, weights: set[str], flux2: bool) -> list[str]:
    """Every way `converted` breaks the spec, or loses or changes something of `original` (empty: none)."""
    problems = []
    comfy_map = {"lora_unet_" + w[: -len(".weight")].replace(".", "_"): w[: -len(".weight")] for w in weights}
    got: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in converted.items():
        m = COMFY_KEY.match(key)
        if m is None:
            problems.append(f"{key}: not diffusion_model.<module>.lora_A/B.weight (ComfyUI: lora key not loaded)")
            continue
        if f"{m['module']}.weight" not in weights:
            problems.append(f"{key}: {m['module']} is no weight of the DiT (ComfyUI: lora key not loaded)")
        if flux2 and not DIFFUSERS_FLUX2_MODULE.match(m["module"]):
            problems.append(f"{key}: not a FLUX.2 block layer diffusers converts (ValueError there)")
        got.setdefault(m["module"], {})[m["ab"]] = tensor
    names = {k.split(".", 1)[0] for k in original}
    for name in sorted(names):
        module = comfy_map.get(name)
        if module is None:
            problems.append(f"{name}: ComfyUI maps this trained module to no layer")
            continue
        pair = got.get(module, {})
        if set(pair) != {"A", "B"}:
            problems.append(f"{name} -> {module}: has {sorted(pair)} of lora_A/lora_B (a key dropped)")
            continue
        down, up = original[f"{name}.lora_down.weight"], original[f"{name}.lora_up.weight"]
        if pair["A"].shape != down.shape or pair["B"].shape != up.shape:
            problems.append(f"{module}: shapes {pair['A'].shape}/{pair['B'].shape}, trained {down.shape}/{up.shape}")
            continue
        alpha = float(original.get(f"{name}.alpha", down.shape[0]))
        want = (alpha / down.shape[0]) * (up.float() @ down.float())
        if not torch.allclose(pair["B"].float() @ pair["A"].float(), want, rtol=2e-2, atol=2e-2 * want.abs().max()):
            problems.append(f"{module}: lora_B @ lora_A is not alpha/rank x up @ down")
    extra = set(got) - {comfy_map.get(n) for n in names}
    problems += [f"{module}: in the copy, not trained" for module in sorted(extra)]
    return problems


# ------------------------------------------------------------------------------------------ without a checkout
@pytest.mark.parametrize(("tiny", "flux2"), [(KLEIN_TINY, True), (KONTEXT_TINY, False)], ids=["klein", "kontext"])
@pytest.mark.parametrize(("double", "single"), [(1, 1), (3, 5)])
def test_every_key_of_a_tiny_runs_lora_meets_the_spec_and_no_module_is_dropped(tiny, flux2, double, single):
    original = trained(blocks(tiny, double, single))
    converted = to_comfy(original)
    assert converted.modules == 8 * double + 2 * single  # a double block trains 8 layers, a single block 2
    assert len(converted.tensors) == 2 * converted.modules  # A and B each, no alpha
    assert spec_problems(original, converted.tensors, dit_weights(double, single), flux2) == []


def test_alpha_is_folded_into_both_matrices_and_the_dtype_kept():
    original = trained(blocks(KLEIN_TINY, 1, 1), alpha=4.0)  # rank 16: scale 0.25, so each side x 0.5
    converted = to_comfy(original).tensors
    assert not any(k.endswith(".alpha") for k in converted)
    a = converted["diffusion_model.single_blocks.0.linear2.lora_A.weight"]
    assert a.dtype == torch.bfloat16
    torch.testing.assert_close(a, original["lora_unet_single_blocks_0_linear2.lora_down.weight"] * 0.5)
    assert spec_problems(original, converted, dit_weights(1, 1), flux2=True) == []
    unfolded = dict(converted, **{"diffusion_model.single_blocks.0.linear2.lora_A.weight": a * 2})
    assert any("alpha/rank" in p for p in spec_problems(original, unfolded, dit_weights(1, 1), flux2=True))


def test_a_lora_without_alpha_keys_is_read_as_kohya_reads_it_alpha_equal_to_rank():
    original = {k: v for k, v in trained(blocks(KONTEXT_TINY, 1, 1)).items() if not k.endswith(".alpha")}
    converted = to_comfy(original).tensors
    name = "double_blocks_0_img_attn_qkv"
    torch.testing.assert_close(
        converted["diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight"],
        original[f"lora_unet_{name}.lora_up.weight"],
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda sd: sd.pop("diffusion_model.double_blocks.0.txt_mlp.2.lora_B.weight"), "a key dropped"),
        (
            lambda sd: sd.__setitem__(
                "diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight",
                sd.pop("diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"),
            ),
            "no weight of the DiT",
        ),
        (lambda sd: sd.__setitem__("diffusion_model.img_in.lora_A.weight", torch.zeros(16, 128)), "not trained"),
        (
            lambda sd: sd.__setitem__("diffusion_model.img_in.alpha", torch.tensor(1.0)),
            "not diffusion_model.<module>",
        ),
    ],
    ids=["dropped", "misnamed-as-in-905", "extra", "alpha-key"],
)
def test_the_spec_check_fails_a_copy_that_drops_misnames_or_adds_a_key(change, says):
    original = trained(blocks(KLEIN_TINY, 1, 1))
    converted = dict(to_comfy(original).tensors)
    change(converted)
    problems = spec_problems(original, converted, dit_weights(1, 1), flux2=True)
    assert problems and any(says in p for p in problems), problems


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"lora_unet_final_layer_linear.lora_down.weight": torch.zeros(16, 256)}, "not a layer of a FLUX"),
        ({"lora_unet_double_blocks_0_img_attn_qkv.dora_scale": torch.zeros(1, 256)}, "not a LoRA down/up/alpha"),
        ({"lora_unet_double_blocks_0_img_attn_qkv_x.lora_down.weight": torch.zeros(16, 256)}, "not a layer"),
    ],
    ids=["outside-the-blocks", "dora", "unknown-layer"],
)
def test_a_key_the_format_has_no_place_for_stops_the_copy_rather_than_being_dropped(extra, says):
    original = {**trained(blocks(KLEIN_TINY, 1, 1)), **extra}
    with pytest.raises(LoraFormatError, match=says):
        to_comfy(original)


def test_a_module_with_only_one_matrix_stops_the_copy():
    original = trained(blocks(KLEIN_TINY, 1, 1))
    del original["lora_unet_single_blocks_0_linear1.lora_up.weight"]
    with pytest.raises(LoraFormatError, match="not both lora_down and lora_up"):
        to_comfy(original)


def test_the_copy_is_written_beside_the_lora_with_its_metadata_and_nothing_half_made(tmp_path):
    lora = tmp_path / "mychar.safetensors"
    original = trained(blocks(KONTEXT_TINY, 2, 2))
    meta = {"ss_network_module": "networks.lora_flux", "ss_network_dim": "16", "sshs_model_hash": "stale"}
    save_file(original, str(lora), metadata=meta)
    copy, converted = write_comfy_copy(lora, hashes=lambda tensors, metadata: (f"h{len(tensors)}", "legacy"))
    assert copy == tmp_path / f"mychar{COMFY_SUFFIX}" == comfy_path(lora)
    with safe_open(str(copy), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        got = f.metadata()
    assert spec_problems(original, tensors, dit_weights(2, 2), flux2=False) == []
    assert got["ss_network_module"] == "networks.lora_flux" and got["ss_network_dim"] == "16"
    assert got["sshs_model_hash"] == f"h{len(tensors)}" and got["sshs_legacy_hash"] == "legacy"
    assert "mychar.safetensors" in got[FORMAT_KEY]
    copy.unlink()
    write_comfy_copy(lora)  # without musubi-tuner's hash function: no stale hash is kept
    with safe_open(str(copy), "pt") as f:
        assert "sshs_model_hash" not in f.metadata()
    bad = tmp_path / "bad.safetensors"
    save_file({**original, "lora_unet_img_in.lora_down.weight": torch.zeros(16, 64)}, str(bad))
    with pytest.raises(LoraFormatError):
        write_comfy_copy(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors", "mychar.comfy.safetensors", lora.name]


def test_the_closing_lines_say_which_file_is_for_what(tmp_path):
    lora = tmp_path / "mychar.safetensors"
    lora.write_bytes(b"x")
    assert summary_lines(lora, "flux2") == [
        f"LoRA: {lora} (kohya keys, as musubi-tuner saves them: musubi-tuner, ComfyUI, diffusers from 0.38)"
    ]
    comfy_path(lora).write_bytes(b"x")
    lines = summary_lines(lora, "kontext")
    assert lines[1] == f"LoRA for ComfyUI: {comfy_path(lora)} (diffusion_model lora_A/B keys, alpha folded in: ComfyUI)"


# ------------------------------------------------------------------------------------------ with the checkout
@pytest.fixture(scope="module")
def musubi():
    from flux_trainer.backend.tv_shim import install_torchvision_shim
    from flux_trainer.musubi.checkout import import_module, locate

    try:
        checkout = locate()
    except ConfigError as exc:
        pytest.skip(f"needs a musubi-tuner checkout: {exc}")
    install_torchvision_shim()
    return lambda name: import_module(checkout.path, name)


def musubi_network(musubi, family: str, double: int, single: int, **kwargs) -> tuple[dict, set[str]]:
    """musubi-tuner's own LoRA network over its own DiT class (meta device, tiny widths): its state dict as the
    trainer saves it, and the DiT's weight names."""
    from accelerate import init_empty_weights

    if family == "flux2":
        models, network = musubi("flux_2.flux2_models"), musubi("networks.lora_flux_2")
        params = dataclasses.replace(
            models.Klein4BParams(), hidden_size=256, num_heads=2, depth=double, depth_single_blocks=single,
            axes_dim=[32, 32, 32, 32], context_in_dim=192, in_channels=128,
        )  # fmt: skip
        build = models.Flux2
    else:
        models, network = musubi("flux.flux_models"), musubi("networks.lora_flux")
        params = dataclasses.replace(
            models.configs_flux_dev_context.params, hidden_size=256, num_heads=2, depth=double,
            depth_single_blocks=single, axes_dim=[16, 56, 56], context_in_dim=64, vec_in_dim=64,
        )  # fmt: skip
        build = models.Flux
    with init_empty_weights():
        dit = build(params)
    net = network.create_arch_network(1.0, 8, 4.0, None, [], dit, **kwargs)
    net.apply_to([], dit, apply_text_encoder=False, apply_unet=True)
    for p in net.parameters():  # lora_up starts at zero: give it values so the product check means something
        torch.nn.init.normal_(p)
    weights = {k for k in dit.state_dict() if k.endswith(".weight")}
    return {k: v.detach().to(torch.bfloat16) for k, v in net.state_dict().items()}, weights


@pytest.mark.musubi
@pytest.mark.parametrize("family", ["flux2", "kontext"])
def test_the_copy_of_musubi_tuners_own_network_meets_the_spec(musubi, family):
    original, weights = musubi_network(musubi, family, double=2, single=3)
    converted = to_comfy(original)
    assert converted.modules == 2 * 8 + 3 * 2
    assert spec_problems(original, converted.tensors, weights, flux2=family == "flux2") == []


@pytest.mark.musubi
def test_kontext_modulation_layers_trained_on_request_are_named_too(musubi):
    original, weights = musubi_network(musubi, "kontext", double=1, single=1, exclude_patterns="[]")
    assert any("_img_mod_lin." in k for k in original) and any("_modulation_lin." in k for k in original)
    assert spec_problems(original, to_comfy(original).tensors, weights, flux2=False) == []


@pytest.mark.musubi
def test_musubi_tuners_converter_still_misnames_flux_attention_which_is_why_we_map_it(musubi):
    """musubi-tuner#905: its `convert_lora.py --target other` writes `img_attn_qkv` for `img_attn.qkv`, so ComfyUI
    loads none of the attention. The day this fails, the pinned converter does the job: call it instead."""
    original, weights = musubi_network(musubi, "flux2", double=1, single=1)
    theirs = musubi("convert_lora").convert_to_diffusers("lora_unet_", None, dict(original))
    problems = spec_problems(original, theirs, weights, flux2=True)
    assert any("img_attn_qkv" in p for p in problems) and any("txt_attn_proj" in p for p in problems), problems
    ours = to_comfy(original).tensors
    for key in ("double_blocks.0.img_mlp.0", "single_blocks.0.linear1"):  # the names it gets right: same tensors
        for ab in "AB":
            name = f"diffusion_model.{key}.lora_{ab}.weight"
            torch.testing.assert_close(ours[name].float(), theirs[name].float(), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------------------------- the run's key
def test_train_comfy_copy_reaches_the_runner_and_is_refused_where_sd_scripts_trains(workdir, compose):
    from flux_trainer.cli import main
    from flux_trainer.config.validate import validate
    from flux_trainer.musubi.runner import RunnerSpec

    assert main(["+dataset=mychar", "model=random_flux2_klein_tiny", "dry_run=true"]) == 0
    assert main(["+dataset=mychar", "model=random_flux2_klein_tiny", "dry_run=true", "train.comfy_copy=false"]) == 0
    on, off = (RunnerSpec.read(p) for p in sorted((workdir / "runs" / "mychar").iterdir()))
    assert on.comfy_copy is True and off.comfy_copy is False
    assert on.lora and on.lora.endswith("/mychar.safetensors")
    with pytest.raises(ConfigError) as info:
        validate(compose("+dataset=mychar", "model=random_tiny", "train.comfy_copy=false"))
    (line,) = [p for p in info.value.problems if p.startswith("train.comfy_copy=False")]
    assert "sd-scripts" in line and "remove it" in line


def test_the_torchvision_shims_make_grid_tiles_images_as_documented():
    """musubi-tuner saves its sample images through torchvision.utils.make_grid; where torchvision is absent the shim
    has it: one image as it is, several in rows of `nrow` with `padding` pixels of `pad_value` around each."""
    import torch

    from flux_trainer.backend.tv_shim import make_grid

    one = torch.rand(3, 4, 5)
    assert torch.equal(make_grid(one[None], nrow=1), one)
    images = torch.stack([torch.full((3, 4, 5), float(i + 1)) for i in range(3)])
    grid = make_grid(images, nrow=2, padding=1, pad_value=0.5)
    assert grid.shape == (3, 2 * (4 + 1) + 1, 2 * (5 + 1) + 1)
    assert grid[0, 1, 1] == 1 and grid[0, 1, 7] == 2 and grid[0, 6, 1] == 3  # row-major, each after the padding
    assert grid[0, 0, 0] == 0.5 and grid[0, 6, 7] == 0.5  # padding, and the empty fourth cell
    assert make_grid(torch.rand(2, 1, 4, 4)).shape[0] == 3  # one channel becomes three
