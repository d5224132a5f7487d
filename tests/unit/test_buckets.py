"""Images sd-scripts' buckets cannot place (flux_trainer.data.buckets): the same verdict as sd-scripts' own
BucketManager for a grid of sizes and resolutions, and the launch's one-line refusal."""

from __future__ import annotations

import itertools
import sys

import pytest

from flux_trainer.data.buckets import bucket_problem, zero_side


def _sd_scripts_verdict(bm_class, width: int, height: int, resolution: int) -> bool:
    """sd-scripts' own answer: its bucket selection divides by zero, or hands out a bucket with a 0-pixel side."""
    bm = bm_class(True, (resolution, resolution), 64, 4096, 64)  # no upscale, as flux-train's datasets
    try:
        reso, _, _ = bm.select_bucket(width, height)
    except ZeroDivisionError:
        return True
    return 0 in reso


def test_the_verdict_is_sd_scripts_own_on_a_grid_of_sizes():
    from tests.integration.tiny_run import CHECKOUT, need_checkout

    need_checkout()
    sys.path.insert(0, str(CHECKOUT.path)) if str(CHECKOUT.path) not in sys.path else None
    from flux_trainer.sdscripts.checkout import install_torchvision_shim

    install_torchvision_shim()
    from library.train_util import BucketManager

    sides = [64, 65, 96, 127, 128, 150, 200, 255, 300, 511, 640, 1000, 1500, 3000, 5000]
    both = failing = 0
    for (w, h), res in itertools.product(itertools.product(sides, sides), [64, 128, 256, 512]):
        ours, theirs = zero_side(w, h, res), _sd_scripts_verdict(BucketManager, w, h, res)
        assert ours == theirs, (w, h, res, ours, theirs)
        both += 1
        failing += ours
    assert failing > 20 and both - failing > 20  # the grid has both kinds


def test_refusal_names_the_images_and_the_resolution_that_fits():
    sizes = {"wide.png": (400, 100), "square.png": (300, 300), "tall.jpg": (90, 270)}
    line = bucket_problem(sizes, 64, "dataset 'd'")
    assert line and "2 image(s)" in line and "wide.png (400x100)" in line and "tall.jpg (90x270)" in line
    assert "square.png" not in line and "at resolution 64" in line
    fits = int(line.split("use a resolution of ")[1].split()[0])
    assert not any(zero_side(*sizes[n], fits) for n in sizes) and any(zero_side(*sizes["wide.png"], fits - 64)
                                                                      for _ in [0])  # fmt: skip
    assert bucket_problem(sizes, 512, "dataset 'd'") is None


@pytest.mark.parametrize(("w", "h"), [(128, 64), (64, 128), (1000, 800)])
def test_at_64_images_larger_than_the_area_and_not_near_square_fail(w, h):
    assert zero_side(w, h, 64)
    assert not zero_side(64, 64, 64) and not zero_side(w, h, 1024)


def test_a_launch_refuses_before_staging_naming_the_images(tmp_path):
    """The data layer's refusal at launch (data.stage.ready_all), before anything is staged or a run dir made."""
    from PIL import Image

    from flux_trainer.config.errors import ConfigError
    from flux_trainer.data.stage import ready_all

    pics = tmp_path / "pics"
    pics.mkdir()
    Image.new("RGB", (256, 128), "red").save(pics / "wide.png")
    Image.new("RGB", (128, 128), "blue").save(pics / "square.png")
    dataset = {"name": "d", "images": str(pics), "trigger": "ohwx", "resolution": [64, 512],
               "caption_extension": ".txt", "keep_tokens": 0, "flip_aug": False, "validation_split": 0.0,
               "enable_bucket": True, "bucket_no_upscale": True, "subsets": []}  # fmt: skip
    from omegaconf import OmegaConf

    model = OmegaConf.create({"clip_l": "c", "t5xxl": "t", "ae": "a"})
    with pytest.raises(ConfigError) as refused:
        ready_all(OmegaConf.create(dataset), model, tmp_path / "cache")
    (line,) = refused.value.problems
    assert "at resolution 64" in line and "wide.png (256x128)" in line and "square.png" not in line
    assert not (tmp_path / "cache" / "datasets").exists()
    dataset["resolution"] = [128, 512]
    staged, _ = ready_all(OmegaConf.create(dataset), model, tmp_path / "cache")
    assert (staged[0] / "wide.png").is_symlink()
