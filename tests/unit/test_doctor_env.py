"""sd-scripts checkout and dependency versions, allocator settings and other environment variables, cache disk
space: the doctor's checks that need neither a GPU nor an import of anything heavy."""

from __future__ import annotations

from collections import namedtuple

import pytest

from flux_trainer.doctor import disk as doctor_disk
from flux_trainer.doctor import env as doctor_env
from flux_trainer.launch.device import DeviceInfo
from flux_trainer.sdscripts.checkout import COMMIT_FILE, ENV_VAR, PINNED_COMMIT
from tests.cards import H200, RTX4090

# ---- sd-scripts --------------------------------------------------------------------------------------------------


def fake_checkout(tmp_path, commit=PINNED_COMMIT):
    path = tmp_path / "sd-scripts"
    path.mkdir()
    (path / "flux_train_network.py").write_text("# stand-in\n")
    (path / COMMIT_FILE).write_text(commit)
    return path


def test_sd_scripts_at_the_pinned_commit_passes(tmp_path):
    path = fake_checkout(tmp_path)
    row = doctor_env.sd_scripts_check(None, {ENV_VAR: str(path)})
    assert row.status == "pass" and PINNED_COMMIT[:10] in row.evidence


def test_sd_scripts_at_another_commit_warns_with_the_checkout_command(tmp_path):
    path = fake_checkout(tmp_path, commit="0123456789abcdef0123456789abcdef01234567")
    row = doctor_env.sd_scripts_check(str(path), {})
    assert row.status == "warn" and f"checkout {PINNED_COMMIT[:10]}" in row.fix


def test_sd_scripts_missing_fails_with_setup(tmp_path):
    row = doctor_env.sd_scripts_check(str(tmp_path / "nowhere"), {})
    assert row.status == "fail" and "does not exist" in row.evidence and "flux-train setup" in row.fix


@pytest.mark.parametrize(
    ("version", "spec", "ok"),
    [
        ("4.54.1", ">=4.54,<5", True),
        ("4.57.0+cu128", ">=4.54,<5", True),
        ("4.53.3", ">=4.54,<5", False),
        ("5.0.0", ">=4.54,<5", False),
        ("0.32.1", "==0.32.*", True),
        ("0.32", "==0.32.*", True),
        ("0.33.0", "==0.32.*", False),
        ("1.0.0rc1", ">=0.34,<1", False),
        ("0.34.3", ">=0.34,<1", True),
    ],
)
def test_version_specs(version, spec, ok):
    assert doctor_env.satisfies(version, spec) is ok


def versions(**overrides):
    good = {
        "transformers": "4.54.1", "diffusers": "0.32.1", "huggingface_hub": "0.34.3", "tokenizers": "0.21.4",
        "accelerate": "1.6.0", "safetensors": "0.4.5", "toml": "0.10.2", "voluptuous": "0.15.2",
        "imagesize": "1.4.1", "ftfy": "6.3.1", "einops": "0.7.0", "sentencepiece": "0.2.1",
        "opencv-python-headless": "4.10.0", "numpy": "2.1.0", "pillow": "11.0.0", "prodigyopt": "1.1.2", "av": "14.0.1",
    }  # fmt: skip
    good.update(overrides)

    def version_of(names):
        return next(((n, good[n]) for n in names if good.get(n)), None)

    return version_of


def test_dependencies_at_compatible_versions_pass():
    assert doctor_env.dependency_check("Prodigy", versions()).status == "pass"


def test_transformers_5_fails_and_the_fix_pins_the_range():
    row = doctor_env.dependency_check("Prodigy", versions(transformers="5.0.1"))
    assert row.status == "fail" and "transformers 5.0.1" in row.evidence
    assert '"transformers>=4.54,<5"' in row.fix and row.fix.startswith("pip install")


def test_diffusers_outside_0_32_fails():
    row = doctor_env.dependency_check("AdamW", versions(diffusers="0.35.2"))
    assert row.status == "fail" and "diffusers" in row.fix


def test_bitsandbytes_is_required_only_for_the_8bit_optimizer():
    assert doctor_env.dependency_check("AdamW", versions()).status == "pass"
    row = doctor_env.dependency_check("AdamW8bit", versions())
    assert row.status == "fail" and "bitsandbytes missing" in row.evidence and "bitsandbytes" in row.fix
    assert doctor_env.dependency_check("AdamW8bit", versions(bitsandbytes="0.45.5")).status == "pass"


def test_av_is_required_only_for_a_musubi_tuner_model():
    """A FLUX.1 run does not need musubi-tuner's video package (the lent GPU machine has none); FLUX.2 does."""
    assert doctor_env.dependency_check("AdamW", versions(av="")).status == "pass"
    row = doctor_env.dependency_check("AdamW", versions(av=""), musubi=True)
    assert row.status == "fail" and "av missing" in row.evidence and '"av"' in row.fix
    assert doctor_env.dependency_check("AdamW", versions(), musubi=True).status == "pass"


def test_any_opencv_distribution_satisfies_cv2():
    version_of = versions(**{"opencv-python-headless": ""}, **{"opencv-python": "4.10.0"})
    assert doctor_env.dependency_check("AdamW", version_of).status == "pass"


def test_dependency_versions_are_read_without_importing(monkeypatch):
    import builtins
    import sys

    real_import = builtins.__import__
    heavy = ("transformers", "diffusers", "accelerate")

    def guard(name, *args, **kwargs):
        if name.split(".")[0] in heavy and name not in sys.modules:
            raise AssertionError(f"imported {name} to read a version")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guard)
    for name in heavy:
        monkeypatch.delitem(sys.modules, name, raising=False)
    doctor_env.dependency_check("AdamW")  # real metadata; must not import them


# ---- environment -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "status", "said"),
    [
        ("expandable_segments:True", "pass", "valid"),
        ("expandable_segments:True,garbage_collection_threshold:0.8,max_split_size_mb:512", "pass", "valid"),
        ("roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True", "pass", "valid"),
        ("expandible_segments:True", "fail", "did you mean expandable_segments"),
        ("expandable_segment:True", "fail", "did you mean expandable_segments"),
        ("garbage_colection_threshold:0.8", "fail", "did you mean garbage_collection_threshold"),
        ("expandable_segments:true", "fail", "True or False"),
        ("garbage_collection_threshold:1.5", "fail", "between 0 and 1"),
        ("max_split_size_mb:10", "fail", ">= 20"),
        ("backend:cudaMallocAsync,expandable_segments:True", "warn", "ignores expandable_segments"),
        ("expandable_segments:True,expandable_segments:False", "warn", "given twice"),
        ("backend:cudamallocasync", "fail", "unknown"),
    ],
)
def test_allocator_settings(value, status, said):
    row = doctor_env.alloc_conf_check({"PYTORCH_CUDA_ALLOC_CONF": value}, H200)
    assert row.status == status, row.evidence
    assert said in row.evidence
    assert bool(row.fix) is (status != "pass")


def test_a_misspelt_key_gets_the_corrected_spelling_as_its_fix():
    row = doctor_env.alloc_conf_check({"PYTORCH_ALLOC_CONF": "expandible_segments:True"}, H200)
    assert "write expandable_segments instead of expandible_segments" in row.fix


def test_both_allocator_variables_set_and_different_warn():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}
    row = doctor_env.alloc_conf_check(env, H200)
    assert row.status == "warn" and "differ" in row.evidence and "unset" in row.fix
    same = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert doctor_env.alloc_conf_check(same, H200).status == "pass"


def test_unset_allocator_says_what_flux_train_sets_for_the_card():
    assert "expandable_segments:True" in doctor_env.alloc_conf_check({}, H200).evidence
    assert "garbage_collection_threshold:0.8" in doctor_env.alloc_conf_check({}, RTX4090).evidence
    assert "garbage_collection" not in doctor_env.alloc_conf_check({}, H200).evidence
    assert "not used" in doctor_env.alloc_conf_check({}, DeviceInfo.cpu()).evidence


@pytest.mark.parametrize(
    ("env", "status"),
    [
        ({}, "pass"),
        ({"CUDA_LAUNCH_BLOCKING": "1"}, "warn"),
        ({"CUDA_LAUNCH_BLOCKING": "0"}, "pass"),
        ({"NVIDIA_TF32_OVERRIDE": "0"}, "warn"),
        ({"CUDA_VISIBLE_DEVICES": ""}, "warn"),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, "pass"),
        ({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "warn"),
    ],
)
def test_other_variables_that_crash_or_slow_training(env, status):
    row = doctor_env.other_env_check(env)
    assert row.status == status
    if status == "warn":
        assert next(iter(env)) in row.evidence and "unset" in row.fix


# ---- disk ----------------------------------------------------------------------------------------------------------

Usage = namedtuple("Usage", "total used free")


def test_cache_sizes_follow_sd_scripts_float32_npz():
    assert doctor_disk.latent_bytes(1024) == 16 * 128 * 128 * 4 + doctor_disk.NPZ_OVERHEAD  # 1 MiB + overhead
    assert doctor_disk.latent_bytes(1024, flip=True) - doctor_disk.NPZ_OVERHEAD == 2 * 16 * 128 * 128 * 4
    assert 8 * 2**20 < doctor_disk.text_bytes(512) < 8.1 * 2**20  # T5 512 x 4096 fp32 dominates


def per_image(resolution=512, tokens=32):
    return doctor_disk.latent_bytes(resolution) + doctor_disk.text_bytes(tokens)


@pytest.mark.parametrize(("free", "status"), [(0, "fail"), (10**9, "warn"), (10**12, "pass")])
def test_disk_free_space_against_the_estimate(compose, monkeypatch, free, status):
    cfg = compose("+dataset=mychar", "model=random_tiny")  # 3 images at 512, 32 T5 tokens
    monkeypatch.setattr(doctor_disk.shutil, "disk_usage", lambda p: Usage(10**12, 0, free))
    row = doctor_disk.disk_check(cfg)
    assert row.status == status, row.evidence
    assert row.data["images"] == 3 and row.data["need_bytes"] == 3 * per_image()


def test_images_already_cached_need_no_new_space(compose, workdir):
    cfg = compose("+dataset=mychar", "model=random_tiny")
    folder = workdir / "pics" / "mychar"
    (folder / "img0_0512x0512_flux.npz").write_bytes(b"x")
    (folder / "img0_flux_te.npz").write_bytes(b"x")
    (folder / "img1_flux_te.npz").write_bytes(b"x")
    need = doctor_disk.disk_check(cfg).data["need_bytes"]
    assert need == 2 * doctor_disk.latent_bytes(512) + 1 * doctor_disk.text_bytes(32)


def test_caches_in_memory_need_no_disk(compose):
    cfg = compose("+dataset=mychar", "cache.latents_to_disk=false", "cache.text_encoder_outputs_to_disk=false")
    row = doctor_disk.disk_check(cfg)
    assert row.status == "pass" and "memory" in row.evidence


def test_no_dataset_skips_the_disk_check(compose):
    assert doctor_disk.disk_check(compose()).status == "skip"


def test_t5_tokens_follow_the_model(compose):
    assert doctor_disk.t5_tokens_for(compose()) == 512
    assert doctor_disk.t5_tokens_for(compose("model=flux_schnell")) == 256
    assert doctor_disk.t5_tokens_for(compose("model=random_tiny")) == 32
