"""FLUX.2 klein and Kontext through musubi-tuner, end to end on the CPU: `flux-train +dataset=tiny
model=random_flux2_klein_tiny train.max_steps=2` (and the Kontext one, whose dataset names reference images) caches
latents and text-encoder outputs with musubi-tuner's scripts, trains 2 steps in one run dir with one progress
display, and writes a LoRA of musubi-tuner's module with our TensorBoard tags beside its loss, and its copy in the
keys ComfyUI loads beside it (issue 61)."""

from __future__ import annotations

import re

import pytest
from safetensors import safe_open

from flux_trainer.metrics.tensorboard import read_images, read_scalars, read_texts
from tests.integration.tiny_run import CHECKOUT, flux_train, fresh_env, newest_run, tiny_dataset
from tests.musubi_checkout import MUSUBI, need_musubi

pytestmark = [pytest.mark.musubi, pytest.mark.sd_scripts]
COMFY_KEY = re.compile(r"^diffusion_model\.(double|single)_blocks\.\d+\.[a-z0-9_.]+\.lora_[AB]\.weight$")
OUR_TAGS = ("vram/peak_gib", "vram/allocated_gib", "time/step_s", "time/data_s", "throughput/images_per_s")


def need_checkouts() -> None:
    need_musubi()
    if CHECKOUT is None:  # the Kontext preset's files are sd-scripts' random set, written with its code
        pytest.skip("needs an sd-scripts checkout (the random sets are written with its code)")


def musubi_env(work):
    env = fresh_env(work)
    env["FLUX_TRAIN_MUSUBI_TUNER"] = str(MUSUBI.path)
    return env


def references(work, n=4):
    from PIL import Image

    refs = work / "refs"
    refs.mkdir()
    for i in range(n):
        Image.new("RGB", (128, 128), (200, 40 * i % 256, 30)).save(refs / f"im{i}.jpg")
    return refs


def check_run(work, module: str, arch: str) -> dict:
    run = newest_run(work)
    assert run is not None
    lora = run / "tiny.safetensors"
    assert lora.is_file(), sorted(p.name for p in run.iterdir())
    with safe_open(str(lora), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert meta["ss_network_module"] == module and meta["ss_base_model_version"] == arch
    assert any(k.startswith("lora_unet_double_blocks_0_") and k.endswith("lora_down.weight") for k in keys)
    copy = run / "tiny.comfy.safetensors"  # the copy ComfyUI loads (flux_trainer/musubi/lora_format.py)
    assert copy.is_file(), sorted(p.name for p in run.iterdir())
    with safe_open(str(copy), "pt") as f:
        copied, copy_meta = set(f.keys()), f.metadata()
    trained = {k.split(".", 1)[0] for k in keys}
    assert len(copied) == 2 * len(trained) and all(COMFY_KEY.match(k) for k in copied), sorted(copied)
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight" in copied
    assert copy_meta["ss_network_module"] == module and copy_meta["sshs_model_hash"] != meta["sshs_model_hash"]
    for name in ("musubi_tuner.toml", "dataset.toml", "command.txt", "runner.json", "train.log", "env.json"):
        assert (run / name).is_file(), name
    (events,) = {p.parent for p in (run / "tb").rglob("events.out.tfevents.*")}
    scalars = read_scalars(events)
    assert [s for s, _ in scalars["loss/current"]] == [1, 2]
    for tag in OUR_TAGS:
        assert [s for s, _ in scalars[tag]] == [1, 2], tag
    assert all(v > 0 for _, v in scalars["time/step_s"])
    assert {"run/config", "run/command"} <= set(read_texts(events))
    return scalars


def test_flux2_klein_tiny_trains_two_steps_through_musubi_tuner(tmp_path):
    need_checkouts()
    tiny_dataset(tmp_path, extra="trigger: ohwx\n")
    samples = ["sample.prompts=[a red square]", "sample.every_n_steps=2", "sample.steps=2", "sample.width=64",
               "sample.height=96"]  # fmt: skip
    got = flux_train(tmp_path, "+dataset=tiny", "model=random_flux2_klein_tiny", "train.max_steps=2", *samples,
                     env=musubi_env(tmp_path))  # fmt: skip
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    out = got.stdout
    # the sample prompt rendered by musubi-tuner at step 2, in the run dir and as a TensorBoard image at its step
    run = newest_run(tmp_path)
    assert (run / "sample_prompts.txt").read_text() == "a red square --w 64 --h 96 --s 2 --g 3.5 --d 42\n"
    assert sorted(run.glob("sample/tiny_000002_00_*.png"))
    (events,) = {p.parent for p in (run / "tb").rglob("events.out.tfevents.*")}
    assert (2, 64, 96) in read_images(events)["samples/00"]
    assert "compile_blocks (regional torch.compile of the double and single blocks, checked against the eager " in out
    assert "block, on a CUDA GPU)" in out
    log = (newest_run(tmp_path) / "train.log").read_text()  # auto on the CPU: skipped with its reason, one line
    assert "kernel compile_blocks skipped: auto compiles on a CUDA GPU only (device is cpu)" in log
    assert "kernels: prodigy_step\n" in log and "installing compile_blocks" not in log
    # the optimizer (Prodigy, the default) gets flux_kernels' step, probed first, as on sd-scripts' side
    assert "flux_kernels installed prodigy_step" in log and "kernel adamw_step skipped" in log
    (events,) = {p.parent for p in (newest_run(tmp_path) / "tb").rglob("events.out.tfevents.*")}
    assert read_texts(events)["run/kernels"] == "prodigy_step"
    assert "caching latents" in out and "caching the text encoder's outputs" in out and "step 2/2" in out
    check_run(tmp_path, "networks.lora_flux_2", "flux_2_klein_4b")
    assert "LoRA for ComfyUI: " in out and "tiny.comfy.safetensors (diffusion_model lora_A/B keys" in out
    captions = list((tmp_path / "cache" / "musubi").glob("tiny-*/images/im0.txt"))
    assert captions and captions[0].read_text() == "ohwx, a flat colour square number 0"


def test_kontext_tiny_trains_two_steps_with_its_references(tmp_path):
    need_checkouts()
    refs = references(tmp_path)
    tiny_dataset(tmp_path, extra=f"control_images: {refs}\n")
    samples = ["sample.prompts=[make it blue]", f"sample.references=[{refs / 'im1.jpg'}]", "sample.every_n_steps=2",
               "sample.steps=2", "sample.width=64", "sample.height=64"]  # fmt: skip
    # the attention kernel named (auto installs it on a CUDA GPU only): checked against musubi-tuner's attention,
    # then the backend decided at the first training forward (flux_trainer/musubi/attention.py)
    got = flux_train(tmp_path, "+dataset=tiny", "model=random_kontext_tiny", "train.max_steps=2", *samples,
                     "kernels.set='auto,attention'", env=musubi_env(tmp_path))  # fmt: skip
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert "attention (the attention backend measured at the run's shape, checked against musubi-tuner's" in got.stdout
    check_run(tmp_path, "networks.lora_flux", "flux_kontext")
    log = (newest_run(tmp_path) / "train.log").read_text()
    assert "kernels: installing attention: musubi_tuner.flux.flux_models.attention in its plain self-attention" in log
    assert "calls; matches musubi-tuner's attention, fwd+bwd (bfloat16" in log
    assert "kernels: prodigy_step, attention\n" in log
    (decided,) = re.findall(r"kernels: attention: (.+)", log)  # once, at the first training forward
    assert decided.startswith("sdpa") and " bfloat16 mask=False" in decided, decided
    (events,) = {p.parent for p in (newest_run(tmp_path) / "tb").rglob("events.out.tfevents.*")}
    texts = read_texts(events)
    assert texts["run/kernels"] == "prodigy_step, attention" and texts["run/attention"] == decided
    # the sample edits its reference image (musubi-tuner's --ci), rendered at step 2 and shown in TensorBoard
    run = newest_run(tmp_path)
    assert (run / "sample_prompts.txt").read_text().endswith(f"--d 42 --ci {refs / 'im1.jpg'}\n")
    assert sorted(run.glob("sample/tiny_000002_00_*.png"))
    (events,) = {p.parent for p in (run / "tb").rglob("events.out.tfevents.*")}
    assert (2, 64, 64) in read_images(events)["samples/00"]
    assert "4 images have 1 control images" in log  # musubi-tuner paired every image with its reference
    (cache,) = (tmp_path / "cache" / "musubi").glob("tiny-*/cache-*")
    latents = [p for p in cache.glob("im0_*.safetensors") if not p.name.endswith("_te.safetensors")]
    with safe_open(str(latents[0]), "pt") as f:
        assert any(k.startswith("latents_control_") for k in f.keys())


def test_a_kontext_dataset_whose_references_match_no_image_is_refused_before_anything_is_made(tmp_path):
    need_checkouts()
    refs = references(tmp_path)
    (refs / "im3.jpg").rename(refs / "im9.jpg")
    tiny_dataset(tmp_path, extra=f"control_images: {refs}\n")
    got = flux_train(tmp_path, "+dataset=tiny", "model=random_kontext_tiny", "train.max_steps=2",
                     env=musubi_env(tmp_path))  # fmt: skip
    assert got.returncode == 2
    assert "match no image" in got.stderr + got.stdout and "im9.jpg" in got.stderr + got.stdout
    assert "Traceback" not in got.stderr
    assert newest_run(tmp_path) is None
