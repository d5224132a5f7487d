"""The synthetic demo dataset: captions match pixels, files are complete, a second call rewrites nothing."""

from __future__ import annotations

import re

import pytest
from PIL import Image

from flux_trainer.commands.demo import COLOURS, MANIFEST, SHAPES, caption, demo_items, make_demo_dataset

CAPTION = re.compile(r"^a (small|large) (\w+) (\w+) on a (\w+) background$")


def _pairs(folder):
    return sorted(folder.glob("demo_*.png")), sorted(folder.glob("demo_*.txt"))


def test_images_and_captions_agree(tmp_path):
    folder = make_demo_dataset(tmp_path / "demo", n=6, size=64, seed=3)
    pngs, txts = _pairs(folder)
    assert [p.stem for p in pngs] == [t.stem for t in txts] == [f"demo_{i:03d}" for i in range(6)]
    for png, txt in zip(pngs, txts, strict=True):
        match = CAPTION.match(txt.read_text().strip())
        assert match, txt.read_text()
        _, colour, shape, background = match.groups()
        assert shape in SHAPES and colour != background
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size == (64, 64) and image.mode == "RGB"
            counts = {rgb: count for count, rgb in image.getcolors(64 * 64)}
            corners = {image.getpixel(xy) for xy in ((0, 0), (63, 0), (0, 63), (63, 63))}
        assert corners == {COLOURS[background]}  # the shape keeps off the edges
        shape_share = counts.get(COLOURS[colour], 0) / (64 * 64)
        assert shape_share > 0.02, f"{png.name}: {colour} covers only {shape_share:.1%}"


def test_varied_and_deterministic(tmp_path):
    items = demo_items(8, seed=0)
    assert {i["shape"] for i in items} == set(SHAPES)
    assert len({caption(i) for i in items}) == 8
    assert demo_items(8, seed=0) == items
    assert demo_items(8, seed=1) != items
    a = make_demo_dataset(tmp_path / "a", n=2, size=32, seed=5)
    b = make_demo_dataset(tmp_path / "b", n=2, size=32, seed=5)
    assert (a / "demo_001.png").read_bytes() == (b / "demo_001.png").read_bytes()


def test_second_call_rewrites_nothing(tmp_path):
    folder = make_demo_dataset(tmp_path, n=3, size=32)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert make_demo_dataset(tmp_path, n=3, size=32) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert not list(folder.glob("*.tmp"))


def test_incomplete_or_changed_folder_is_redone(tmp_path):
    folder = make_demo_dataset(tmp_path, n=4, size=32)
    (folder / "demo_002.txt").unlink()
    make_demo_dataset(tmp_path, n=4, size=32)
    assert (folder / "demo_002.txt").is_file()

    (folder / "mine.png").write_bytes(b"user file")
    make_demo_dataset(tmp_path, n=2, size=48)
    pngs, txts = _pairs(folder)
    assert len(pngs) == len(txts) == 2  # our stale demo_002/003 are gone
    assert (folder / "mine.png").read_bytes() == b"user file"  # a file we did not make stays
    with Image.open(pngs[0]) as image:
        assert image.size == (48, 48)
    assert (folder / MANIFEST).is_file()


def test_rejects_nonsense(tmp_path):
    with pytest.raises(ValueError, match="n >= 1"):
        make_demo_dataset(tmp_path, n=0)
