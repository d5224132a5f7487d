"""`masks:`: a folder of loss masks matched to the images by name, checked before anything is made, staged as the
images' alpha channel (flux_trainer.data.masks, data.stage)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from flux_trainer.data.check import check_folder
from flux_trainer.data.masks import match_masks, same_shape
from flux_trainer.data.stage import stage


def _folder(tmp_path: Path, n: int = 3, size=(96, 64)) -> Path:
    images = tmp_path / "pics"
    images.mkdir()
    for i in range(n):
        ext = "jpg" if i % 2 else "png"
        Image.new("RGB", size, (40 * i, 100, 200)).save(images / f"im{i}.{ext}")
        (images / f"im{i}.txt").write_text(f"picture {i}")
    return images


def _mask(folder: Path, name: str, size=(96, 64), left: int = 255, right: int = 0) -> Path:
    folder.mkdir(exist_ok=True)
    m = Image.new("L", size, right)
    m.paste(left, (0, 0, size[0] // 2, size[1]))
    m.save(folder / name)
    return folder / name


def test_masks_match_images_by_name_whatever_the_extension(tmp_path):
    images = _folder(tmp_path)
    masks = tmp_path / "masks"
    _mask(masks, "im0.png")
    _mask(masks, "im1.png")  # the image is im1.jpg
    got = match_masks(check_folder(images), masks)
    assert got.problems == []
    assert sorted(got.masks) == ["im0.png", "im1.jpg"]
    assert got.notes and "1 of 3 images have no mask" in got.notes[0]


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda m: _mask(m, "img7.png"), "match no image"),
        (lambda m: (_mask(m, "im0.png"), _mask(m, "im0.jpg")), "are all masks of im0.png"),
        (lambda m: _mask(m, "im0.png", size=(64, 64)), "make the mask the image's size"),
        (lambda m: (m.mkdir(), (m / "im0.png").write_bytes(b"not a png")), "not a readable image"),
        (lambda m: m.mkdir(), "has no mask images"),
        (lambda m: None, "does not exist"),
    ],
)
def test_bad_masks_are_refused_naming_the_file(tmp_path, make, says):
    images = _folder(tmp_path)
    masks = tmp_path / "masks"
    make(masks)
    got = match_masks(check_folder(images), masks, key="dataset.subsets[0].masks")
    assert len(got.problems) == 1 and says in got.problems[0], got.problems
    assert "dataset.subsets[0].masks" in got.problems[0] or str(masks) in got.problems[0]


def test_a_mask_of_the_same_shape_scaled_is_accepted_another_shape_is_not():
    assert same_shape((192, 128), (96, 64)) and same_shape((96, 64), (96, 64))
    assert not same_shape((128, 128), (96, 64)) and not same_shape((0, 10), (96, 64))


def test_staged_masked_image_carries_the_mask_as_alpha_and_follows_its_changes(tmp_path):
    images = _folder(tmp_path, n=2)
    masks = tmp_path / "masks"
    _mask(masks, "im1.png", size=(192, 128))  # twice the size: resized to the image's
    check = check_folder(images)
    matched = match_masks(check, masks)
    assert matched.problems == []
    staged = stage(check, "ds", tmp_path / "cache", masks=matched.masks)
    assert sorted(p.name for p in staged.iterdir() if not p.name.startswith(".")) == [
        "im0.png", "im0.txt", "im1.png", "im1.txt"]  # fmt: skip  # im1.jpg staged as a PNG with alpha
    with Image.open(staged / "im1.png") as im:
        assert im.mode == "RGBA" and im.size == (96, 64)
        alpha = im.getchannel("A")
        assert alpha.getpixel((10, 30)) == 255 and alpha.getpixel((90, 30)) == 0  # white learned, black not
        assert im.convert("RGB").getpixel((10, 30)) == Image.open(images / "im1.jpg").convert("RGB").getpixel((10, 30))
    assert (staged / "im0.png").is_symlink()  # unmasked: linked as before
    assert not (images / "im1.png").exists()  # the user's folder untouched
    # sd-scripts' latents of the masked image are dropped when its mask changes, kept otherwise
    (staged / "im1_0096x0064_flux.npz").write_bytes(b"x")
    (staged / "im0_0096x0064_flux.npz").write_bytes(b"x")
    _mask(masks, "im1.png", size=(192, 128), left=0, right=255)
    stage(check, "ds", tmp_path / "cache", masks=match_masks(check, masks).masks)
    assert not (staged / "im1_0096x0064_flux.npz").exists() and (staged / "im0_0096x0064_flux.npz").exists()
    with Image.open(staged / "im1.png") as im:
        assert im.getchannel("A").getpixel((10, 30)) == 0
    # the mask taken away: the image is linked again under its own name, the PNG gone
    stage(check, "ds", tmp_path / "cache", masks={})
    assert (staged / "im1.jpg").is_symlink() and not (staged / "im1.png").exists()


def test_text_encoder_outputs_made_with_an_fp8_t5_are_not_reused_by_a_bf16_run(tmp_path):
    """memory.t5xxl_fp8 (the 8 GB tier) encodes the captions in fp8: its cached outputs must not serve another tier's
    bf16 run of the same dataset, nor the reverse (sd-scripts checks only the cache files' keys)."""
    from omegaconf import OmegaConf

    from flux_trainer.data.stage import ready

    images = _folder(tmp_path, n=2)
    dataset = OmegaConf.create({"name": "d", "images": str(images), "trigger": None, "caption_extension": ".txt",
                                "keep_tokens": 0, "flip_aug": False, "validation_split": 0.0})  # fmt: skip
    model = OmegaConf.create({"clip_l": "c", "t5xxl": "t", "ae": "a"})
    staged, _ = ready(dataset, model, tmp_path / "cache", te_fp8=True)
    (staged / "im0_flux_te.npz").write_bytes(b"fp8 outputs")
    ready(dataset, model, tmp_path / "cache", te_fp8=True)
    assert (staged / "im0_flux_te.npz").exists()  # same encoder: kept
    ready(dataset, model, tmp_path / "cache", te_fp8=False)
    assert not (staged / "im0_flux_te.npz").exists()  # bf16 now: re-encoded
