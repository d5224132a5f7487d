"""Datasets of several folders (`subsets:`) and several resolutions (issue 59): composition, refusals, staging."""

from __future__ import annotations

import json

import pytest
import tomli
from omegaconf import OmegaConf

from flux_trainer.cli import main
from flux_trainer.config import ConfigError
from flux_trainer.config.compose import compose_run
from flux_trainer.data.stage import ready_all
from flux_trainer.data.subsets import subsets_of
from tests.conftest import make_images
from tests.unit.test_cli import run_dirs


def write_multi(workdir, name="multi", **fields):
    """configs/dataset/<name>.yaml listing folders under workdir: two of the character, one of reg images."""
    pics = workdir / "pics"
    close = make_images(pics / "closeups", n=3)
    full = make_images(pics / "full_body", n=2, captions=False)
    reg = make_images(pics / "reg", n=2)
    body = {
        "name": name,
        "resolution": [512, 768],
        "subsets": [
            {"images": str(close), "trigger": "ohwx", "repeats": 10},
            {"images": str(full), "trigger": "ohwx", "repeats": 5},
            {"images": str(reg), "is_reg": True, "repeats": 1},
        ],
        **fields,
    }
    path = workdir / "configs" / "dataset" / f"{name}.yaml"
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in body.items()) + "\n")
    return close, full, reg


def snapshot(*folders):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for f in folders for p in sorted(f.iterdir())}


def test_several_folders_and_resolutions_dry_run_to_one_sd_scripts_dataset_per_resolution(workdir, capsys):
    close, full, reg = write_multi(workdir)
    before = snapshot(close, full, reg)
    assert main(["+dataset=multi", "dry_run=true", "train.prior_loss_weight=0.5"]) == 0, capsys.readouterr().err
    (run,) = run_dirs(workdir)
    doc = tomli.loads((run / "dataset.toml").read_text())
    assert [d["resolution"] for d in doc["datasets"]] == [512, 768]
    for d in doc["datasets"]:
        subs = d["subsets"]
        assert [s["num_repeats"] for s in subs] == [10, 5, 1]
        assert [s.get("is_reg") for s in subs] == [None, None, True]
        assert [s.get("caption_prefix") for s in subs] == ["ohwx,", "ohwx,", None]  # reg never inherits a trigger
        staged = [s["image_dir"] for s in subs]
        assert len(set(staged)) == 3 and all(p.startswith(str(workdir / "cache" / "datasets")) for p in staged)
    assert tomli.loads((run / "sd_scripts.toml").read_text())["training"]["prior_loss_weight"] == 0.5
    assert snapshot(close, full, reg) == before  # the user's folders are read, never written


def test_the_single_folder_form_writes_no_prior_loss_weight(workdir):
    assert main(["+dataset=mychar", "dry_run=true"]) == 0
    (run,) = run_dirs(workdir)
    assert "prior_loss_weight" not in (run / "sd_scripts.toml").read_text()
    assert len(tomli.loads((run / "dataset.toml").read_text())["datasets"]) == 1


@pytest.mark.parametrize(
    ("fields", "args", "needle"),
    [
        ({"resolution": [512, 4000]}, [], "dataset.resolution=4000: must be a multiple of 16 between 64 and 2048"),
        ({"resolution": [512, 520]}, [], "dataset.resolution=520: must be a multiple of 16"),
        ({"resolution": [512, 512]}, [], "listed twice"),
        ({"resolution": []}, [], "give one resolution"),
        ({"resolution": ["big"]}, [], "dataset.resolution=big: a whole number"),
        ({"images": "/somewhere"}, [], "has both images and subsets"),
        ({}, ["dataset.subsets.0.repeats=0"], "dataset.subsets[0].repeats=0: must be at least 1"),
        ({}, ["dataset.subsets.1.caption_dropout_rate=2.0"], "dataset.subsets[1].caption_dropout_rate=2.0"),
        ({}, ["dataset.subsets.1.images=/no/such/folder"], "/no/such/folder does not exist; set dataset.subsets[1]"),
        ({}, ["dataset.subsets.1.images=${dataset.subsets.0.images}"], "listed twice"),
        ({}, ["dataset.subsets.0.is_reg=true", "dataset.subsets.1.is_reg=true"], "every subset has is_reg"),
        ({}, ["train.prior_loss_weight=-1"], "train.prior_loss_weight=-1.0: must be 0 or more"),
        ({}, ["dataset.subsets.0.caption_dropout_rate=0.05"], "needs cache.text_encoder_outputs=false"),
    ],
)
def test_each_bad_key_is_refused_in_one_line_exit_2_nothing_written(fields, args, needle, workdir, capsys):
    write_multi(workdir, **fields)
    assert main(["+dataset=multi", "dry_run=true", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("flux-train: error:") and err.strip().count("\n") == 0, err
    assert run_dirs(workdir) == [] and not (workdir / "cache" / "datasets").exists()


def test_a_dataset_without_images_or_subsets_is_refused(workdir, capsys):
    path = workdir / "configs" / "dataset" / "none.yaml"
    path.write_text("name: none\n")
    assert main(["+dataset=none", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert f"the dataset file is missing images in {path}: add images:" in err and "subsets:" in err
    assert err.strip().count("\n") == 0


def test_every_folder_is_checked_at_launch_and_nothing_is_staged_before_all_pass(workdir, capsys):
    close, full, reg = write_multi(workdir)
    (reg / "broken.png").write_bytes(b"not an image")
    (reg / "img0.txt").write_bytes(b"\x00\xff\xfe\x00 binary")
    for txt in full.glob("*.txt"):
        txt.unlink()
    assert main(["+dataset=multi", "dry_run=true", "dataset.subsets.1.trigger=null"]) == 2
    err = capsys.readouterr().err
    assert f"{reg / 'broken.png'}: not an image" in err  # the reg folder is checked as the others
    assert f"{reg / 'img0.txt'}: caption is not text" in err
    assert "2 of 2 images have no .txt caption" in err  # full_body has neither captions nor a trigger now
    assert run_dirs(workdir) == [] and not (workdir / "cache" / "datasets").exists()


def test_a_batch_larger_than_the_learned_images_is_refused(workdir, capsys):
    write_multi(workdir)
    assert main(["+dataset=multi", "dry_run=true", "train.batch_size=6"]) == 2
    assert "larger than the 5 images dataset 'multi' learns" in capsys.readouterr().err


def test_a_subset_key_left_out_takes_the_datasets_value():
    d = OmegaConf.create(
        {
            "images": None,
            "trigger": "zz",
            "repeats": 7,
            "caption_dropout_rate": 0.1,
            "subsets": [{"images": "/a"}, {"images": "/b", "repeats": 2, "caption_dropout_rate": 0.0, "trigger": "q"}]
            + [{"images": "/r", "is_reg": True}],
        }
    )
    a, b, r = subsets_of(d)
    assert (a.trigger, a.repeats, a.caption_dropout_rate) == ("zz", 7, 0.1)
    assert (b.trigger, b.repeats, b.caption_dropout_rate) == ("q", 2, 0.0)
    assert (r.trigger, r.is_reg) == (None, True)


def test_ready_all_stages_each_folder_apart(workdir):
    close, full, reg = write_multi(workdir)
    cfg = compose_run(["+dataset=multi"], [workdir / "configs"])
    staged, _ = ready_all(cfg.dataset, OmegaConf.create({"clip_l": "c", "t5xxl": "t", "ae": "a"}), workdir / "cache")
    assert len(set(staged)) == 3 and all(s.parent == workdir / "cache" / "datasets" for s in staged)
    assert [sorted(p.name for p in s.glob("*.png")) for s in staged] == [
        sorted(p.name for p in f.glob("*.png")) for f in (close, full, reg)
    ]
    with pytest.raises(ConfigError, match="learns"):
        ready_all(cfg.dataset, OmegaConf.create({"clip_l": "c", "t5xxl": "t", "ae": "a"}), workdir / "cache", 9)


def test_alpha_mask_needs_images_with_an_alpha_channel(workdir, capsys):
    from PIL import Image

    close, full, reg = write_multi(workdir)
    assert main(["+dataset=multi", "dry_run=true", "dataset.subsets.0.alpha_mask=true"]) == 2
    err = capsys.readouterr().err
    assert f"alpha_mask: 3 images of {close} have no alpha channel (img0.png, img1.png, img2.png)" in err
    assert err.strip().count("\n") == 0 and run_dirs(workdir) == []
    for png in close.glob("*.png"):
        Image.new("RGBA", (96, 64), (200, 10, 10, 0)).save(png)
    assert main(["+dataset=multi", "dry_run=true", "dataset.subsets.0.alpha_mask=true"]) == 0, capsys.readouterr()
    (run,) = run_dirs(workdir)
    for d in tomli.loads((run / "dataset.toml").read_text())["datasets"]:
        assert [s.get("alpha_mask") for s in d["subsets"]] == [True, None, None]


def test_dataset_init_with_two_image_folders_a_reg_folder_and_three_resolutions(workdir, capsys):
    a = make_images(workdir / "a", n=2)
    b = make_images(workdir / "b", n=2, captions=False)
    reg = make_images(workdir / "reg", n=3)
    args = ["dataset", "init", "both", "--images", str(a), "--images", str(b), "--reg", str(reg)]
    assert main([*args, "--trigger", "ohwx", "--resolution", "512,768,1024", "--repeats", "4"]) == 0
    out = capsys.readouterr().out
    assert f"{a}: 2 images" in out and f"{reg}: 3 images" in out
    assert main(["+dataset=both", "dry_run=true"]) == 0, capsys.readouterr().err
    (run,) = run_dirs(workdir)
    doc = tomli.loads((run / "dataset.toml").read_text())
    assert [d["resolution"] for d in doc["datasets"]] == [512, 768, 1024]
    subs = doc["datasets"][0]["subsets"]
    assert [(s["num_repeats"], s.get("is_reg"), s.get("caption_prefix")) for s in subs] == [
        (4, None, "ohwx,"),
        (4, None, "ohwx,"),
        (1, True, None),
    ]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--resolution", "512,4096"], "--resolution 4096: must be a multiple of 16 between 64 and 2048"),
        (["--resolution", "512,big"], "--resolution 512,big: a number of pixels"),
        (["--resolution", "512,512"], "listed twice"),
        (["--reg", "/no/such/reg"], "--reg /no/such/reg: no such folder"),
        (["--reg", "UNCAPTIONED"], "images have no .txt caption; caption them (a reg folder takes no trigger word)"),
        (["--images", "FIRST"], "a folder is given twice"),
    ],
)
def test_dataset_init_refuses_in_one_line_and_writes_nothing(extra, needle, workdir, capsys):
    a = make_images(workdir / "a", n=2)
    uncaptioned = make_images(workdir / "plain", n=2, captions=False)
    extra = [{"UNCAPTIONED": str(uncaptioned), "FIRST": str(a)}.get(x, x) for x in extra]
    assert main(["dataset", "init", "bad", "--images", str(a), "--trigger", "ohwx", *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.strip().count("\n") == 0, err
    assert not (workdir / "configs" / "dataset" / "bad.yaml").exists()


def test_the_disk_estimate_counts_latents_at_every_resolution(compose):
    from flux_trainer.doctor import disk as doctor_disk

    row = doctor_disk.disk_check(compose("+dataset=mychar", "model=random_tiny", "dataset.resolution=[512,1024]"))
    latents = doctor_disk.latent_bytes(512) + doctor_disk.latent_bytes(1024)
    assert row.data["need_bytes"] == 3 * (latents + doctor_disk.text_bytes(32)), row.evidence


def _masks_for(images, folder, names=None, size=(96, 64)):
    """A mask per image of `images` (or the given names): the left half white (learned), the right half black."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for name in names or [p.stem + ".png" for p in sorted(images.glob("*.png"))]:
        m = Image.new("L", size, 0)
        m.paste(255, (0, 0, size[0] // 2, size[1]))
        m.save(folder / name)
    return folder


def test_a_mask_folder_trains_its_subset_with_the_masks_as_alpha(workdir, capsys):
    """`masks:` on a subset: the staged images carry the masks as alpha, that subset alone gets alpha_mask, the
    user's folders are untouched; the single-folder form takes `masks:` too."""
    from PIL import Image

    close, full, reg = write_multi(workdir)
    masks = _masks_for(close, workdir / "pics" / "masks")
    before = snapshot(close, full, reg, masks)
    assert main(["+dataset=multi", "dry_run=true", f"dataset.subsets.0.masks={masks}"]) == 0, capsys.readouterr().err
    (run,) = run_dirs(workdir)
    for d in tomli.loads((run / "dataset.toml").read_text())["datasets"]:
        assert [s.get("alpha_mask") for s in d["subsets"]] == [True, None, None]
        staged = d["subsets"][0]["image_dir"]
    from pathlib import Path

    with Image.open(Path(staged) / "img1.png") as im:
        assert im.mode == "RGBA" and im.getchannel("A").getpixel((5, 5)) == 255
        assert im.getchannel("A").getpixel((90, 5)) == 0
    assert snapshot(close, full, reg, masks) == before
    write_dataset_single = workdir / "configs" / "dataset" / "one.yaml"
    write_dataset_single.write_text(f"name: one\nimages: {close}\ntrigger: ohwx\nresolution: 512\nmasks: {masks}\n")
    assert main(["+dataset=one", "dry_run=true"]) == 0, capsys.readouterr().err
    run = max(run_dirs(workdir), key=lambda p: p.stat().st_mtime)
    (d,) = tomli.loads((run / "dataset.toml").read_text())["datasets"]
    assert d["subsets"][0]["alpha_mask"] is True


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (lambda close, m: _masks_for(close, m, ["img0.png", "typo.png"]), "match no image of"),
        (lambda close, m: _masks_for(close, m, ["img0.png"], size=(64, 64)), "make the mask the image's size"),
        (lambda close, m: None, "does not exist; set it to the folder of your mask images"),
    ],
)
def test_bad_mask_folders_are_refused_in_one_line_exit_2_nothing_made(setup, needle, workdir, capsys):
    close, _, _ = write_multi(workdir)
    masks = workdir / "pics" / "masks"
    setup(close, masks)
    assert main(["+dataset=multi", "dry_run=true", f"dataset.subsets.0.masks={masks}"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "dataset.subsets[0].masks" in err and err.strip().count("\n") == 0, err
    assert run_dirs(workdir) == [] and not (workdir / "cache" / "datasets").exists()


def test_masks_on_a_flux2_model_are_refused(workdir, capsys):
    close, _, _ = write_multi(workdir)
    masks = _masks_for(close, workdir / "pics" / "masks")
    args = ["+dataset=multi", "dry_run=true", "model=random_flux2_klein_tiny", f"dataset.subsets.0.masks={masks}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "dataset.subsets[0].masks" in err and "no masked loss" in err


def test_dataset_init_with_masks_writes_them_beside_their_images_and_refuses_bad_ones(workdir, capsys):
    a = make_images(workdir / "a", n=2)
    b = make_images(workdir / "b", n=2)
    masks = _masks_for(a, workdir / "ma")
    assert main(["dataset", "init", "both", "--images", str(a), "--images", str(b), "--masks", str(masks)]) == 0
    assert main(["+dataset=both", "dry_run=true"]) == 0, capsys.readouterr().err
    (run,) = run_dirs(workdir)
    subs = tomli.loads((run / "dataset.toml").read_text())["datasets"][0]["subsets"]
    assert [s.get("alpha_mask") for s in subs] == [True, None]
    assert main(["dataset", "init", "one", "--images", str(a), "--masks", str(masks), "--trigger", "x"]) == 0
    assert f"masks: {json.dumps(str(masks.resolve()))}" in (workdir / "configs" / "dataset" / "one.yaml").read_text()
    _masks_for(a, workdir / "bad", ["nothing.png"])
    capsys.readouterr()
    assert main(["dataset", "init", "bad", "--images", str(a), "--masks", str(workdir / "bad")]) == 2
    err = capsys.readouterr().err
    assert "match no image" in err and err.strip().count("\n") == 0
    assert not (workdir / "configs" / "dataset" / "bad.yaml").exists()
