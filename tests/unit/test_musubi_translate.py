"""Run config -> musubi-tuner's three steps: the flags each step gets, and every one passes the pinned parsers'
committed schema (flux_trainer/musubi/parser_schema.json)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli

from flux_trainer.musubi.parser_schema import SCRIPTS, check_script_keys, load_schema
from flux_trainer.musubi.stage import MusubiFolders, caption_text
from flux_trainer.musubi.translate import argv_of, translate
from flux_trainer.plan import absolute_paths

RUN = Path("/runs/x/1")


def folders(control: bool = False) -> list[MusubiFolders]:
    root = Path("/cache/musubi/x")
    return [MusubiFolders(root / "images", root / "control" if control else None, root / "cache-k")]


def run_of(cfg, control: bool = False):
    absolute_paths(cfg)
    return translate(cfg, RUN, folders(control))


@pytest.fixture
def flux2(compose):
    return lambda *o: compose("+dataset=mychar", "model=flux2_klein_base_4b", *o)


def test_the_committed_schema_is_the_pinned_commits():
    from flux_trainer.musubi.checkout import PINNED_COMMIT

    schema = load_schema()
    assert schema["commit"] == PINNED_COMMIT
    assert set(schema["scripts"]) == {s for trio in SCRIPTS.values() for s in trio}
    assert "flux2_shift" in schema["scripts"]["flux_2_train_network"]["timestep_sampling"]["choices"]


def test_flux2_base_4b_defaults(flux2):
    run, said = run_of(flux2())
    flat = run.train.flat()
    assert run.problems() == [] and said == []
    assert run.scripts == ("flux_2_cache_latents", "flux_2_cache_text_encoder_outputs", "flux_2_train_network")
    assert flat["model_version"] == "klein-base-4b" and flat["timestep_sampling"] == "flux2_shift"
    assert flat["network_module"] == "networks.lora_flux_2" and flat["network_dim"] == 16
    assert flat["mixed_precision"] == "bf16" and flat["sdpa"] is True and "fp8_base" not in flat
    assert flat["optimizer_type"] == "prodigyopt.Prodigy"  # a bare Prodigy would be looked up in torch.optim
    assert "decouple=True" in flat["optimizer_args"]
    assert (
        flat["output_dir"] == str(RUN) and flat["logging_dir"] == str(RUN / "tb") and flat["log_with"] == "tensorboard"
    )
    assert flat["text_encoder"].endswith("model-00001-of-00002.safetensors")
    assert "dataset_config" not in flat  # given on the command line (the parser requires it there)
    assert run.cache_latents["model_version"] == "klein-base-4b" and run.cache_latents["skip_existing"] is True
    assert run.cache_text_encoder["text_encoder"] == flat["text_encoder"]


def test_fp8_and_block_swap_come_from_the_memory_tier(flux2):
    run, said = run_of(flux2("memory=vram12"))  # the tier file's keys (plan.resolve fits them to the model first)
    flat = run.train.flat()
    assert flat["fp8_base"] is True and flat["fp8_scaled"] is True
    assert flat["blocks_to_swap"] == 13 and flat["gradient_checkpointing"] is True  # the tier's 20, klein 4B's most
    assert said == ["memory.blocks_to_swap=20: flux2_klein_base_4b swaps at most 13; 13 swapped"]
    assert run.problems() == []


@pytest.mark.parametrize("swap", [0, 1, 13])
def test_swapped_blocks_are_copied_from_page_locked_memory(flux2, swap):
    run, _ = run_of(flux2("memory=vram12", f"memory.blocks_to_swap={swap}"))
    flat = run.train.flat()
    # musubi-tuner's default copies the blocks from pageable memory (klein 4B, 13 swapped: 2.05 s/step)
    assert flat.get("use_pinned_memory_for_block_swap") is (True if swap else None)
    assert flat.get("blocks_to_swap") == (swap or None)
    assert run.problems() == []


def test_a_small_tier_encodes_in_fp8_where_musubi_can(flux2, compose):
    run, _ = run_of(flux2("memory=vram8"))
    assert run.cache_text_encoder.get("fp8_text_encoder") is True
    dev, _ = run_of(compose("+dataset=mychar", "model=flux2_dev", "memory=vram8"))
    assert "fp8_text_encoder" not in dev.cache_text_encoder  # Mistral 3 has no fp8 mode in musubi-tuner


def test_kontext_uses_both_text_encoders_and_its_references(compose, workdir):
    refs = workdir / "refs"
    refs.mkdir()
    cfg = compose("+dataset=mychar", "model=flux_kontext", f"+dataset.control_images={refs}")
    run, _ = run_of(cfg, control=True)
    flat = run.train.flat()
    assert run.scripts[2] == "flux_kontext_train_network" and flat["network_module"] == "networks.lora_flux"
    assert flat["timestep_sampling"] == "flux_shift" and "model_version" not in flat
    assert flat["text_encoder1"].endswith("t5xxl_fp16.safetensors") and flat["text_encoder2"].endswith(
        "clip_l.safetensors"
    )
    assert "model_version" not in run.cache_latents
    (ds,) = tomli.loads(run.dataset.dumps())["datasets"]
    assert ds["control_directory"] == "/cache/musubi/x/control" and ds["image_directory"] == "/cache/musubi/x/images"
    assert run.problems() == []


def test_the_dataset_toml_has_one_cache_folder_per_resolution(flux2):
    run, _ = run_of(flux2("dataset.resolution=[256,512]", "train.batch_size=1"))
    doc = tomli.loads(run.dataset.dumps())
    assert doc["general"]["batch_size"] == 1 and doc["general"]["caption_extension"] == ".txt"
    assert [d["resolution"] for d in doc["datasets"]] == [[256, 256], [512, 512]]
    assert [d["cache_directory"] for d in doc["datasets"]] == [
        "/cache/musubi/x/cache-k/256",
        "/cache/musubi/x/cache-k/512",
    ]
    assert all(d["num_repeats"] == 10 for d in doc["datasets"])


def test_an_unknown_flag_or_a_wrong_kind_is_caught_by_the_schema():
    problems = check_script_keys("flux_2_train_network", {"network_dimm": 16, "max_train_steps": "2"})
    assert problems == [
        "musubi-tuner flux_2_train_network has no flag 'network_dimm'; it would silently ignore it",
        "musubi-tuner flux_2_train_network flag 'max_train_steps' takes a int, got '2'",
    ]
    assert check_script_keys("flux_kontext_cache_text_encoder_outputs", {"text_encoder": "x"})  # FLUX.2's name


def test_argv_of_writes_what_the_scripts_parse():
    assert argv_of({"a": True, "b": False, "c": None, "d": 3, "e": ["x", "y"]}) == ["--a", "--d", "3", "--e", "x", "y"]


def test_the_trigger_word_is_written_into_the_captions():
    assert caption_text("ohwx", " a cat\n") == "ohwx, a cat"
    assert caption_text("ohwx", None) == "ohwx"
    assert caption_text(None, "a cat") == "a cat"


def test_sample_prompts_go_to_musubi_tuners_toml_with_the_tiers_text_encoder_precision(flux2):
    run, _ = run_of(flux2("memory=vram8", "sample.prompts=[a red square]", "sample.every_n_steps=50"))
    flat = run.train.flat()
    assert flat["sample_prompts"] == str(RUN / "sample_prompts.txt") and flat["sample_every_n_steps"] == 50
    assert flat["fp8_text_encoder"] is True  # vram8 caches the captions in fp8: the trainer encodes the prompts so
    assert run.problems() == []
    run, _ = run_of(flux2())
    assert not {"sample_prompts", "sample_every_n_steps", "fp8_text_encoder"} & set(run.train.flat())


def test_the_prompts_file_is_the_format_both_trainers_read(flux2):
    from flux_trainer.backend.samples import prompts_text

    cfg = flux2("sample.prompts=[a red square,a cat]", "sample.width=768", "sample.seed=7")
    cfg.sample.prompts[0] = "a red\n  square"  # one line per prompt whatever the YAML held
    assert (
        prompts_text(cfg)
        == "a red square --w 768 --h 1024 --s 20 --g 3.5 --d 7\na cat --w 768 --h 1024 --s 20 --g 3.5 --d 7\n"
    )


def test_a_kontext_prompts_line_names_its_reference(compose):
    from flux_trainer.backend.samples import prompts_text

    cfg = compose("+dataset=mychar", "model=flux_kontext", "sample.prompts=[a,b]", "sample.references=[/r/one.png]")
    assert [line.rsplit(" --ci ", 1)[1] for line in prompts_text(cfg).splitlines()] == ["/r/one.png", "/r/one.png"]
    cfg.sample.references = ["/r/1.png", "/r/2.png"]
    assert prompts_text(cfg).endswith("--d 42 --ci /r/1.png\nb --w 1024 --h 1024 --s 20 --g 3.5 --d 42 --ci /r/2.png\n")
