"""flux_trainer.data: every bad file of a dataset named before anything is made (at launch and at `dataset init`), the
check kept per file in the cache, and the staged copy sd-scripts reads (the user's folder never written)."""

from __future__ import annotations

import io
import os

import pytest
from PIL import Image, ImageOps

from flux_trainer.config import ConfigError
from flux_trainer.data import check as dc
from flux_trainer.data.stage import MANIFEST, stage, staged_dir
from tests.conftest import make_images


def bad_folder(root):
    """Four good captioned images and one of each kind of bad file."""
    folder = make_images(root / "pics", n=4, size=(96, 80))
    buf = io.BytesIO()
    Image.new("RGB", (200, 200), (9, 9, 9)).save(buf, "PNG")
    (folder / "truncated.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "text.png").write_text("not an image")
    Image.new("RGB", (1, 1)).save(folder / "dot.png")
    Image.new("RGB", (300, 40)).save(folder / "strip.webp")
    os.symlink("loop.png", folder / "loop.png")
    os.symlink(root / "nowhere.png", folder / "dangling.jpg")
    return folder


BAD = {
    "truncated.png": "cannot be decoded",
    "empty.jpg": "empty file",
    "text.png": "not an image",
    "dot.png": "1x1 pixels",
    "strip.webp": "300x40 pixels",
    "loop.png": "loops or points nowhere",
    "dangling.jpg": "loops or points nowhere",
}


def test_every_bad_file_is_named_with_why(tmp_path):
    check = dc.check_folder(bad_folder(tmp_path), cache_dir=tmp_path / "cache")
    problems = check.problems()
    assert len(problems) == len(BAD), problems
    for name, why in BAD.items():
        assert any(p.startswith(str(check.folder / name)) and why in p for p in problems), (name, problems)
    assert sorted(check.usable()) == [f"img{i}.png" for i in range(4)]


def rotated_photo(path, orientation=6, size=(160, 96)):
    im = Image.new("RGB", size, (200, 10, 10))
    im.paste((10, 200, 10), (0, 0, size[0] // 2, size[1] // 4))  # a corner that shows which way is up
    exif = im.getexif()
    exif[0x0112] = orientation
    im.save(path, exif=exif, quality=95)


def test_rotated_photos_are_measured_as_shown(tmp_path):
    folder = tmp_path / "pics"
    folder.mkdir()
    rotated_photo(folder / "side.jpg")
    Image.new("RGB", (300, 60)).save(folder / "tall_if_rotated.jpg")
    check = dc.check_folder(folder)
    side = check.images["side.jpg"]
    assert (side.width, side.height, side.orientation) == (96, 160, 6) and side.problem is None
    assert "trained upright" in " ".join(check.notes())


@pytest.mark.parametrize(
    "data, encoding",
    [
        (b"cafe, plain ascii", "utf-8"),
        ("café".encode(), "utf-8"),
        ("\ufeffcafé".encode(), "utf-8-sig"),
        ("café crème".encode("utf-16"), "utf-16"),
        ("café crème".encode("latin-1"), "cp1252"),
    ],
)
def test_captions_are_read_in_the_encoding_they_were_saved_in(data, encoding):
    text, got = dc.read_caption(data)
    assert got == encoding and "caf" in text and "\ufeff" not in text


def test_a_binary_caption_is_a_problem_naming_the_file(tmp_path):
    folder = make_images(tmp_path / "pics", n=2)
    (folder / "img1.txt").write_bytes(bytes(range(0x80, 0x100)) + b"\x81\x8d")
    check = dc.check_folder(folder)
    assert [p for p in check.problems() if "img1.txt" in p and "not text" in p]


def test_the_check_is_cached_by_size_and_time_and_redone_for_a_changed_file(tmp_path, monkeypatch):
    folder = make_images(tmp_path / "pics", n=3)
    cache = tmp_path / "cache"
    first = dc.check_folder(folder, cache_dir=cache)
    decoded = []
    real = dc.check_image
    monkeypatch.setattr(dc, "check_image", lambda p: decoded.append(os.path.basename(p)) or real(p))
    again = dc.check_folder(folder, cache_dir=cache)
    assert decoded == [] and again.images == first.images  # nothing decoded twice
    Image.new("RGB", (10, 10)).save(folder / "img1.png")  # edited in place: smaller now
    third = dc.check_folder(folder, cache_dir=cache)
    assert decoded == ["img1.png"] and "10x10 pixels" in third.images["img1.png"].problem


def dataset_and_model(name, folder):
    """The dataset and model sections data.stage.ready reads, for a folder without a trigger word."""
    from omegaconf import OmegaConf

    dataset = {"name": name, "images": str(folder), "caption_extension": ".txt", "trigger": None}
    dataset.update(keep_tokens=0, flip_aug=False, validation_split=0.0)
    return OmegaConf.create(dataset), OmegaConf.create({"clip_l": "c", "t5xxl": "t", "ae": "a"})


def test_launch_refuses_bad_files_before_anything_is_made(tmp_path):
    from flux_trainer.data.stage import ready

    folder = bad_folder(tmp_path)
    dataset, model = dataset_and_model("bad", folder)
    with pytest.raises(ConfigError) as info:
        ready(dataset, model, tmp_path / "cache")
    text = str(info.value)
    assert all(name in text for name in BAD) and "nothing was started" in text
    assert not (tmp_path / "cache" / "datasets").exists()  # not even the staged copy


def test_a_batch_larger_than_the_dataset_is_refused(tmp_path):
    from flux_trainer.data.stage import ready

    folder = make_images(tmp_path / "pics", n=3)
    dataset, model = dataset_and_model("d", folder)
    with pytest.raises(ConfigError, match=r"train.batch_size=100000 is larger than dataset 'd' \(3 images\)"):
        ready(dataset, model, tmp_path / "cache", batch_size=100000)
    staged, _ = ready(dataset, model, tmp_path / "cache", batch_size=3)
    assert sorted(p.name for p in staged.glob("*.png")) == ["img0.png", "img1.png", "img2.png"]


def snapshot(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_staging_links_images_copies_what_sd_scripts_would_misread_and_leaves_the_folder_alone(tmp_path):
    folder = make_images(tmp_path / "pics", n=2)
    rotated_photo(folder / "side.jpg")
    (folder / "side.txt").write_bytes("une légende".encode("utf-16"))
    before = snapshot(folder)
    check = dc.check_folder(folder)
    staged = stage(check, "mine", tmp_path / "cache")
    assert staged == staged_dir(tmp_path / "cache", "mine", folder)
    assert (staged / "img0.png").is_symlink() and (staged / "img0.txt").is_symlink()
    assert not (staged / "side.jpg").is_symlink() and not (staged / "side.txt").is_symlink()
    assert (staged / "side.txt").read_text(encoding="utf-8") == "une légende"
    with Image.open(staged / "side.jpg") as up, Image.open(folder / "side.jpg") as original:
        want = ImageOps.exif_transpose(original)
        assert up.size == want.size == (96, 160)
        diff = max(abs(a - b) for a, b in zip(up.convert("RGB").tobytes(), want.convert("RGB").tobytes(), strict=True))
        assert diff <= 8  # re-encoded as JPEG at quality 100
    (staged / "img0_0096x0064_flux.npz").write_bytes(b"latents")  # as sd-scripts writes them
    assert snapshot(folder) == before


def test_caches_are_dropped_where_what_they_were_made_from_changed(tmp_path):
    folder = make_images(tmp_path / "pics", n=3)
    cache = tmp_path / "cache"
    staged = stage(dc.check_folder(folder), "d", cache, te_key="trigger=a")
    for i in range(3):
        (staged / f"img{i}_0096x0064_flux.npz").write_bytes(b"l")
        (staged / f"img{i}_flux_te.npz").write_bytes(b"t")
    Image.new("RGB", (96, 64), (1, 1, 1)).save(folder / "img0.png")  # edited image: both its caches
    (folder / "img1.txt").write_text("a new caption")  # edited caption: its text-encoder outputs
    (folder / "img2.png").unlink()  # gone: gone from the stage with its caches
    (folder / "img2.txt").unlink()
    stage(dc.check_folder(folder), "d", cache, te_key="trigger=a")
    names = {p.name for p in staged.iterdir()}
    assert "img0_0096x0064_flux.npz" not in names and "img0_flux_te.npz" not in names
    assert "img1_0096x0064_flux.npz" in names and "img1_flux_te.npz" not in names
    assert not {n for n in names if n.startswith("img2")}
    (staged / "img1_flux_te.npz").write_bytes(b"t")
    stage(dc.check_folder(folder), "d", cache, te_key="trigger=b")  # another trigger word: every caption changed
    assert not list(staged.glob("*_flux_te.npz")) and (staged / "img1_0096x0064_flux.npz").exists()
    assert (staged / MANIFEST).is_file()


def test_dataset_init_refuses_the_same_files_a_launch_refuses(tmp_path, monkeypatch):
    from flux_trainer.commands.dataset import describe_folder, write_dataset_config

    monkeypatch.setenv("FLUX_TRAIN_CACHE", str(tmp_path / "cache"))
    folder = bad_folder(tmp_path)
    report = describe_folder(folder)
    assert sorted(report.unreadable) == sorted(BAD)
    with pytest.raises(ConfigError) as info:
        write_dataset_config(tmp_path / "configs", "bad", folder, trigger="ohwx", report=report)
    assert all(name in str(info.value) for name in BAD)
    assert not (tmp_path / "configs").exists()


def test_a_hand_written_dataset_names_bad_files_and_missing_captions_together(workdir, capsys):
    """Missing captions do not hide the files that would stop training: one refusal lists both, exit 2, no run dir;
    uncaptioned images alone are one line; a trigger word makes them trainable."""
    from flux_trainer.cli import main
    from tests.conftest import write_dataset

    folder = bad_folder(workdir)
    make_images(folder, n=2, captions=False, size=(90, 90))  # overwrites img0/img1's pixels; their captions stay
    for n in ("img0", "img1"):
        (folder / f"{n}.txt").unlink()
    write_dataset(workdir / "configs", "bad", folder)
    args = ["model=random_tiny", "train.max_steps=1", "train.data_loader_workers=0"]
    assert main(["+dataset=bad", *args]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in BAD), err
    assert "2 of 4 images have no .txt caption (img0.png, img1.png)" in err and "dataset.trigger=WORD" in err
    assert not (workdir / "runs").exists()
    for name in BAD:
        (folder / name).unlink()
    assert main(["+dataset=bad", *args]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "2 of 4 images have no .txt caption" in lines[0], lines
    assert main(["+dataset=bad", *args, "dataset.trigger=ohwx", "dry_run=true"]) == 0
