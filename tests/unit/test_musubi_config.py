"""The backend seam in the config: FLUX.2 / Kontext presets choose musubi-tuner, keys the chosen trainer would not
use are refused with one line, a Kontext dataset names its references, and those are checked and matched."""

from __future__ import annotations

import pytest
from PIL import Image

from flux_trainer.backend import MUSUBI, SDSCRIPTS, backend_for
from flux_trainer.config import ConfigError
from flux_trainer.config.validate import validate
from flux_trainer.data.check import check_folder
from flux_trainer.data.control import check_references, match
from tests.conftest import make_images, write_dataset

MUSUBI_MODELS = [
    "flux2_klein_base_4b", "flux2_klein_base_9b", "flux2_klein_4b", "flux2_klein_9b", "flux2_dev", "flux_kontext",
    "random_flux2_klein_tiny", "random_flux2_klein_4b", "random_flux2_klein_9b", "random_kontext_tiny",
    "random_kontext",
]  # fmt: skip


def problems_of(cfg) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    return info.value.problems


@pytest.fixture
def kontext_set(workdir):
    refs = make_images(workdir / "pics" / "refs", captions=False)
    write_dataset(workdir / "configs", "edits", workdir / "pics" / "mychar", control_images=str(refs), resolution=256)
    return refs


def test_model_type_names_the_backend():
    assert [backend_for(t) for t in ("flux", "chroma", "flux2", "kontext")] == [SDSCRIPTS, SDSCRIPTS, MUSUBI, MUSUBI]
    with pytest.raises(KeyError, match="flux2"):
        backend_for("flux3")


@pytest.mark.parametrize("model", MUSUBI_MODELS)
def test_flux2_and_kontext_presets_plan_for_musubi(model, compose, kontext_set):
    from omegaconf import OmegaConf

    cfg = compose("+dataset=edits", f"model={model}", "dry_run=true")
    OmegaConf.to_container(cfg, resolve=True)
    assert backend_for(cfg.model.model_type) == MUSUBI
    if cfg.model.model_type == "flux2":
        assert cfg.train.timestep_sampling == "flux2_shift" and cfg.model.model_version
        assert cfg.model.clip_l is None and cfg.model.t5xxl is None and cfg.model.text_encoder
    validate(cfg)  # dry run: missing files are warnings


def test_the_flux2_default_is_the_base_4b():
    from flux_trainer.config.paths import shipped_config_dir

    text = (shipped_config_dir() / "model" / "flux2_klein_base_4b.yaml").read_text()
    assert "model_version: klein-base-4b" in text and "the default FLUX.2 preset" in text


@pytest.mark.parametrize(
    ("model", "override", "needle"),
    [
        ("random_flux2_klein_tiny", "network.train_blocks=single", "network.train_blocks=single: model="),
        ("random_flux2_klein_tiny", "train.loss_type=huber", "train.loss_type=huber"),
        ("random_flux2_klein_tiny", "dataset.validation_split=0.1", "dataset.validation_split=0.1"),
        ("random_flux2_klein_tiny", "kernels=fused", "do not apply to musubi-tuner's FLUX.2 / Kontext"),
        ("random_flux2_klein_tiny", "network=lokr", "network.algo=lokr"),
        ("random_tiny", "train.timestep_sampling=flux2_shift", "which has no flux2_shift"),
        ("random_tiny", "+model.model_version=klein-4b", "model.model_version=klein-4b"),
        ("random_tiny", "model.text_encoder=/x/qwen.safetensors", "model.text_encoder=/x/qwen.safetensors"),
    ],
)
def test_a_key_the_chosen_trainer_would_not_use_is_one_line(model, override, needle, compose):
    problems = problems_of(compose("+dataset=mychar", f"model={model}", override.lstrip("+")))
    (line,) = [p for p in problems if needle in p]
    assert "\n" not in line and ("remove it" in line or "use " in line or "choose" in line)


@pytest.mark.parametrize("kernel_set", ["attention", "auto,attention", "auto,-attention", "attention,compile_blocks"])
def test_the_attention_kernel_is_taken_on_musubi_tuners_models(kernel_set, compose, kontext_set):
    """flux_trainer/musubi/attention.py puts the measured backend in FLUX.2's and Kontext's blocks: naming it is no
    longer a key the trainer would not use."""
    for model, dataset in (("random_flux2_klein_tiny", "mychar"), ("random_kontext_tiny", "edits")):
        validate(compose(f"+dataset={dataset}", f"model={model}", f"kernels.set='{kernel_set}'", "dry_run=true"))


def test_control_images_on_a_flux1_model_is_refused(compose, kontext_set):
    problems = problems_of(compose("+dataset=edits", "model=random_tiny"))
    assert any(p.startswith("dataset.control_images=") and "sd-scripts" in p for p in problems), problems


def test_a_kontext_dataset_without_references_is_refused(compose):
    problems = problems_of(compose("+dataset=mychar", "model=random_kontext_tiny"))
    (line,) = [p for p in problems if "control_images" in p]
    assert "dataset 'mychar'" in line and "add `control_images:" in line


def test_an_unknown_flux2_version_is_refused(compose):
    problems = problems_of(compose("+dataset=mychar", "model=random_flux2_klein_tiny", "model.model_version=klein-2b"))
    assert any("model.model_version=klein-2b" in p and "klein-base-4b" in p for p in problems)


def test_references_match_by_name_and_numbered():
    found, missing, unmatched = match(
        ["a.jpg", "b.png", "c.png"], ["a.png", "b_0.png", "b_1.webp", "x.png", "c_final.png"]
    )
    assert found == {"a.jpg": ["a.png"], "b.png": ["b_0.png", "b_1.webp"], "c.png": []}
    assert missing == ["c.png"] and unmatched == ["c_final.png", "x.png"]


def test_references_are_checked_like_images(tmp_path):
    images = check_folder(make_images(tmp_path / "img"))
    refs = make_images(tmp_path / "refs", captions=False)
    assert check_references("d", str(refs), images, None).by_image["img1.png"] == ["img1.png"]
    (refs / "img2.png").write_bytes(b"not a png")
    Image.new("RGB", (80, 80)).save(refs / "typo1.png")
    with pytest.raises(ConfigError) as info:
        check_references("d", str(refs), images, None)
    text = "\n".join(info.value.problems)
    assert "img2.png" in text and "typo1.png" in text and "match no image" in text and "have no reference" in text
    with pytest.raises(ConfigError, match="is not a folder"):
        check_references("d", str(tmp_path / "none"), images, None)


def test_the_doctor_tells_a_flux2_file_from_a_flux1_one(tmp_path):
    """A FLUX.2 transformer given to a FLUX.1 preset (and the reverse) fails the doctor's model row, which every launch
    runs (app.preflight_doctor: one line, exit 2); FLUX.2's Qwen3 text encoder is recognised as such."""
    import torch
    from safetensors.torch import save_file

    from flux_trainer.doctor.core import FAIL, PASS
    from flux_trainer.doctor.models import model_part_check

    t = torch.zeros(2, 2)
    flux2 = {"double_blocks.0.img_attn.qkv.weight": t, "single_blocks.0.linear1.weight": t,
             "double_stream_modulation_img.lin.weight": t, "single_stream_modulation.lin.weight": t}  # fmt: skip
    flux1 = {"double_blocks.0.img_attn.qkv.weight": t, "single_blocks.0.linear1.weight": t,
             "guidance_in.in_layer.weight": t, "guidance_in.in_layer.bias": t}  # fmt: skip
    qwen = {
        "model.embed_tokens.weight": t,
        "model.layers.0.self_attn.q_proj.weight": t,
        "model.layers.1.mlp.up_proj.weight": t,
    }
    for name, sd in (("f2", flux2), ("f1", flux1), ("qwen", qwen)):
        save_file({k: v.clone() for k, v in sd.items()}, str(tmp_path / f"{name}.safetensors"))
    row = model_part_check("flux", tmp_path / "f2.safetensors", model_name="flux_dev", model_type="flux")
    assert row.status == FAIL and "a FLUX.2 checkpoint" in row.evidence and "model=flux2_" in row.fix
    row = model_part_check("flux", tmp_path / "f1.safetensors", model_name="flux2_klein_base_4b", model_type="flux2")
    assert row.status == FAIL and "trains FLUX.2" in row.evidence
    row = model_part_check("flux", tmp_path / "f2.safetensors", model_name="flux2_klein_base_4b", model_type="flux2")
    assert row.status == PASS, row
    row = model_part_check(
        "text_encoder", tmp_path / "qwen.safetensors", model_name="flux2_klein_base_4b", model_type="flux2"
    )
    assert row.status == PASS and "Qwen3" in row.evidence, row
    row = model_part_check(
        "text_encoder", tmp_path / "f1.safetensors", model_name="flux2_klein_base_4b", model_type="flux2"
    )
    assert row.status == FAIL and "must be FLUX.2's text encoder" in row.evidence


def test_sample_prompts_on_flux2_and_kontext_and_what_kontexts_references_must_be(compose, kontext_set, workdir):
    """musubi-tuner renders FLUX.2 samples from the prompts file; a Kontext sample edits a reference image: one for
    every prompt or one per prompt, each an image that opens (checked before anything is made: a bad one would stop
    the run at its first sample); another model given references is told they do nothing there."""
    from PIL import Image

    prompts = ["sample.prompts=[a red square,a cat]", "sample.every_n_steps=100"]
    validate(compose("+dataset=mychar", "model=random_flux2_klein_tiny", *prompts))  # no ConfigError
    ref = workdir / "ref.png"
    Image.new("RGB", (32, 32)).save(ref)
    (workdir / "broken.png").write_bytes(b"\x89PNG not really")
    (workdir / "notes.txt").write_text("x")
    kontext = ("+dataset=edits", "model=random_kontext_tiny", *prompts)
    validate(compose(*kontext, f"sample.references=[{ref}]"))
    validate(compose(*kontext, f"sample.references=[{ref},{ref}]"))
    cases = {
        "": "add sample.references=[/path/to/reference.png]",
        f"{ref},{ref},{ref}": "3 images for 2 prompts; give one for every prompt or one per prompt",
        f"{workdir / 'missing.png'}": "missing.png is not a file",
        f"{workdir / 'notes.txt'}": "notes.txt is not an image",
        f"{workdir / 'broken.png'}": "broken.png does not open as an image",
    }
    for refs, needle in cases.items():
        extra = [f"sample.references=[{refs}]"] if refs else []
        problems = problems_of(compose(*kontext, *extra))
        (line,) = [p for p in problems if p.startswith("sample.")]
        assert needle in line and "\n" not in line, (refs, line)
    problems = problems_of(compose("+dataset=mychar", "model=random_flux2_klein_tiny", *prompts,
                                   f"sample.references=[{ref}]"))  # fmt: skip
    (line,) = [p for p in problems if p.startswith("sample.references")]
    assert "only Kontext edits a reference image; remove sample.references" in line
