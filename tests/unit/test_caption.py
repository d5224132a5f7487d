"""`flux-train dataset caption` as a user runs it, on random_tiny (a Qwen2.5-VL of random weights built here, the
default captioner's class and code path): captions written, kept, overwritten; the trigger word; the dry run;
every refusal one line with nothing written; Ctrl-C and a full disk mid-write leave no partial or temporary file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from PIL import Image

from flux_trainer.caption import run
from flux_trainer.caption.engine import clean
from flux_trainer.caption.models import CAPTIONERS, DEFAULT, RANDOM_TINY
from flux_trainer.cli import main
from tests.conftest import make_images


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One folder of captioners for the session: random_tiny is built once (a second or two), then reused."""
    return tmp_path_factory.mktemp("captioners")


@pytest.fixture
def env(tmp_path, monkeypatch, model_cache):
    monkeypatch.setenv("FLUX_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FLUX_TRAIN_MODEL_CACHE", str(model_cache))
    monkeypatch.delenv("FLUX_TRAIN_VERBOSE", raising=False)
    return tmp_path


@pytest.fixture
def pics(env):
    """img0..img4.png; img0 and img1 have captions of their own."""
    folder = make_images(env / "pics", n=5, captions=False, size=[(96, 64), (64, 96), (80, 80)])
    (folder / "img0.txt").write_text("my own caption of img0", encoding="utf-8")
    (folder / "img1.txt").write_text("my own caption of img1", encoding="utf-8")
    return folder


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def caption(*args: str) -> int:
    return main(["dataset", "caption", *args])


def test_writes_a_caption_for_every_image_without_one_and_keeps_the_others(pics, capsys):
    assert caption(str(pics), "--model", RANDOM_TINY) == 0

    out = capsys.readouterr().out
    files = listing(pics)
    assert files["img0.txt"] == b"my own caption of img0" and files["img1.txt"] == b"my own caption of img1"
    for i in (2, 3, 4):
        text = files[f"img{i}.txt"].decode("utf-8")
        assert text.strip() and "\n" not in text, text
    # captions and nothing else: no temporary file, no cache in the user's folder
    assert sorted(files) == sorted([f"img{i}.png" for i in range(5)] + [f"img{i}.txt" for i in range(5)])
    assert "captions: 3 written, 2 kept, 0 failed" in out
    assert "nonsense" in out and "images/s" in out


def test_overwrite_rewrites_every_caption(pics, capsys):
    assert caption(str(pics), "--model", RANDOM_TINY, "--overwrite") == 0

    files = listing(pics)
    assert b"my own caption" not in files["img0.txt"] and b"my own caption" not in files["img1.txt"]
    assert all(files[f"img{i}.txt"].strip() for i in range(5))
    assert "captions: 5 written, 0 kept, 0 failed" in capsys.readouterr().out


def test_the_trigger_word_comes_first_once(pics):
    assert caption(str(pics), "--model", RANDOM_TINY, "--trigger", "ohwx") == 0

    for i in (2, 3, 4):
        text = (pics / f"img{i}.txt").read_text(encoding="utf-8")
        assert text.startswith("ohwx, ") and not text.startswith("ohwx, ohwx"), text
    assert (pics / "img0.txt").read_text(encoding="utf-8") == "my own caption of img0"
    assert run.with_trigger("ohwx, a cat", "ohwx") == "ohwx, a cat" and run.with_trigger("", "ohwx") == "ohwx"


def test_a_dry_run_shows_captions_and_writes_nothing(pics, capsys):
    before = listing(pics)

    assert caption(str(pics), "--model", RANDOM_TINY, "--dry-run", "--overwrite") == 0

    out = capsys.readouterr().out
    assert listing(pics) == before
    shown = [line for line in out.splitlines() if line.startswith("img")]
    assert [line.split(":")[0] for line in shown] == ["img0.png", "img1.png", "img2.png"], out
    assert all(len(line) > len("img0.png: ") for line in shown)
    assert "dry run: 0 written" in out


@pytest.mark.parametrize(
    "args, words",
    [
        (["{pics}/nope"], ["nope: no such folder"]),
        (["{empty}"], ["no images (.png .jpg", "at its top level"]),
        (["{pics}", "--model", "qwen9"], ["--model qwen9: no such captioner", ", ".join(CAPTIONERS)]),
        (["{pics}", "--model", "florence-2-large"], ["not offered", "trust_remote_code", DEFAULT]),
        (["{pics}"], [f"captioner {DEFAULT} is not downloaded", f"flux-train setup --models --captioner {DEFAULT}"]),
        (["{pics}", "--model", "qwen2.5-vl-7b"], ["flux-train setup --models --captioner qwen2.5-vl-7b"]),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(pics, env, capsys, args, words):
    empty = env / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not an image")
    before, before_empty = listing(pics), listing(empty)

    code = caption(*(a.format(pics=pics, empty=empty) for a in args))

    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flux-train: error: "), err
    for w in words:
        assert w in lines[0], lines[0]
    assert listing(pics) == before and listing(empty) == before_empty


def test_a_partly_downloaded_captioner_names_the_missing_file(pics, env, monkeypatch, capsys):
    models = env / "models"
    (models / "captioners" / DEFAULT).mkdir(parents=True)
    (models / "captioners" / DEFAULT / "config.json").write_text("{}")
    monkeypatch.setenv("FLUX_TRAIN_MODEL_CACHE", str(models))

    assert caption(str(pics)) == 2

    err = capsys.readouterr().err
    assert "is not completely downloaded" in err and "lacks generation_config.json" in err
    assert f"flux-train setup --models --captioner {DEFAULT}" in err


def test_ctrl_c_mid_write_leaves_no_partial_or_temporary_file(pics, monkeypatch, capsys):
    """The second caption's file is written and about to be synced when Ctrl-C comes: the first caption is there
    whole, the second is not there at all, no temporary file is left, and the summary says what was written."""
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    assert caption(str(pics), "--model", RANDOM_TINY) == 130

    out = capsys.readouterr().out
    names = sorted(p.name for p in pics.iterdir())
    assert names == sorted([f"img{i}.png" for i in range(5)] + ["img0.txt", "img1.txt", "img2.txt"]), names
    assert (pics / "img2.txt").read_text(encoding="utf-8").strip()
    assert "interrupted: 1 written, 2 kept, 0 failed" in out


def test_ctrl_c_during_a_batch_stops_after_it_even_where_the_model_would_swallow_it(pics, monkeypatch, capsys):
    """SIGINT while the model works on the first batch (here from the captioner itself, as a user's Ctrl-C lands):
    that batch's captions are written, the next batch is not started, exit 130. The request is a flag, so an
    exception the model's code would have dropped (raised in a finaliser: only printed) cannot lose it."""
    import signal

    from flux_trainer.caption import engine

    real = engine.Engine.caption
    calls = []

    def caption_then_ctrl_c(self, images, *args, **kwargs):
        calls.append(len(images))
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, images, *args, **kwargs)

    monkeypatch.setattr(engine.Engine, "caption", caption_then_ctrl_c)
    assert caption(str(pics), "--model", RANDOM_TINY, "--batch-size", "2") == 130
    assert calls == [2]  # the second batch never started
    texts = sorted(p.name for p in pics.glob("*.txt"))
    assert texts == ["img0.txt", "img1.txt", "img2.txt", "img3.txt"]  # 2 kept, the first batch's 2 written
    assert "interrupted: 2 written, 2 kept" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back


def test_a_full_disk_names_the_image_and_the_others_are_still_written(pics, monkeypatch, capsys):
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    assert caption(str(pics), "--model", RANDOM_TINY) == 1

    out = capsys.readouterr().out
    assert "2 written, 2 kept, 1 failed: img2.png (cannot write img2.txt: No space left on device)" in out
    assert not (pics / "img2.txt").exists() and (pics / "img3.txt").is_file() and (pics / "img4.txt").is_file()
    assert not [p for p in pics.iterdir() if p.suffix == ".tmp" or p.name.startswith(".")]


def test_images_that_cannot_be_captioned_are_named_and_the_rest_captioned(env, capsys):
    folder = make_images(env / "mixed", n=2, captions=False)
    (folder / "broken.png").write_bytes((folder / "img0.png").read_bytes()[:40])  # truncated
    Image.new("RGB", (96, 64)).save(folder / "img1.jpg")  # img1.png and img1.jpg would share img1.txt

    assert caption(str(folder), "--model", RANDOM_TINY) == 1

    out = capsys.readouterr().out
    summary = next(line for line in out.splitlines() if line.startswith("captions: "))
    assert summary.startswith("captions: 1 written, 0 kept, 3 failed: broken.png (not an image PIL can read"), summary
    assert "img1.jpg (shares img1.txt with img1.png; rename one)" in summary
    assert "img1.png (shares img1.txt with img1.jpg; rename one)" in summary
    assert sorted(p.name for p in folder.glob("*.txt")) == ["img0.txt"]


def test_a_failing_batch_is_tried_image_by_image(env):
    """A batch too large for the GPU still captions its images; an image that fails alone is named with why."""
    folder = make_images(env / "batch", n=5, captions=False)
    plan = run.plan_folder(folder)
    seen = []

    def caption_fn(images):
        seen.append(len(images))
        if len(images) > 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if images[0].size == (96, 64) and len(seen) == 4:  # the third image of the first batch
            raise RuntimeError("bad image")
        return ["a caption"]

    outcome = run.caption_folder(plan, caption_fn, batch_size=3, progress=False)

    assert seen[:4] == [3, 1, 1, 1]
    assert outcome.written == ["img0.png", "img1.png", "img3.png", "img4.png"]
    assert outcome.failed == {"img2.png": "the captioner failed: RuntimeError: bad image"}
    assert not (folder / "img2.txt").exists() and (folder / "img3.txt").read_text() == "a caption"


def test_dataset_init_caption_writes_captions_then_the_config_without_doubling_the_trigger(pics, env, capsys):
    config_dir = env / "configs"
    args = ["dataset", "init", "mychar", "--images", str(pics), "--trigger", "ohwx", "--config-dir", str(config_dir)]

    assert main([*args, "--caption", RANDOM_TINY]) == 0

    out = capsys.readouterr().out
    assert "captions: 3 written, 2 kept, 0 failed" in out
    config = (config_dir / "dataset" / "mychar.yaml").read_text()
    assert "5 images, 5 with captions" in config and 'trigger: "ohwx"' in config
    # the config's trigger starts every caption at training: written into the files too, it would come twice
    assert not (pics / "img2.txt").read_text(encoding="utf-8").startswith("ohwx")


def test_dataset_init_caption_refuses_a_bad_name_before_captioning(pics, env, capsys):
    before = listing(pics)

    code = main(
        ["dataset", "init", "my char", "--images", str(pics), "--config-dir", str(env), "--caption", RANDOM_TINY]
    )

    assert code == 2
    assert "dataset name 'my char'" in capsys.readouterr().err
    assert listing(pics) == before


def test_setup_captioner_builds_random_tiny_and_refuses_an_unknown_name(env, capsys):
    assert main(["setup", "--models", "--captioner", RANDOM_TINY]) == 0
    assert "nothing to download" in capsys.readouterr().out

    assert main(["setup", "--models", "--captioner", "qwen9"]) == 2
    assert "--model qwen9: no such captioner" in capsys.readouterr().err


def test_clean_makes_one_printable_line():
    assert clean("  A cat\non a\tmat.\x00\ufffd ") == "A cat on a mat."
    assert clean("\n\x07\ufffd") == ""


def test_help_lists_the_subcommand(capsys):
    assert main(["--help"]) == 0
    assert "dataset caption DIR" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["dataset", "caption", "--help"])
    out = capsys.readouterr().out
    for option in ("--model", "--overwrite", "--trigger", "--prompt", "--batch-size", "--dry-run"):
        assert option in out


def test_random_tiny_writes_visible_nonsense_not_an_empty_caption(pics):
    """Its generation may only pick word pieces, at least six: each caption is text a user can see is not real."""
    assert caption(str(pics), "--model", RANDOM_TINY) == 0
    for i in (2, 3, 4):
        text = (pics / f"img{i}.txt").read_text(encoding="utf-8")
        assert sum(c.isalpha() for c in text) >= 6 and "decoded to no printable text" not in text, text
