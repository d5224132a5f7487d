"""Config -> sd-scripts TOML: goldens, the committed parser schema, TOML round trips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tomli

from flux_trainer.backend.toml_doc import Document
from flux_trainer.sdscripts.parser_schema import check_training_keys, load_schema
from flux_trainer.sdscripts.translate import RunPaths, translate

GOLDEN = Path(__file__).parent.parent / "golden"
FLAGS = load_schema()["flags"]
CASES = {
    "default": [],
    "rank32_adamw_2000": ["network.rank=32", "optimizer=adamw", "train.max_steps=2000"],
    "fp8_vram16": ["precision=fp8_base", "memory=vram16"],
    "lokr": ["network=lokr"],
    "chroma": ["model=chroma"],
    "adafactor_samples": ["optimizer=adafactor", "sample.prompts=[ohwx smiling]", "sample.every_n_steps=100"],
    "validation_huber": [
        "dataset.validation_split=0.1",
        "train.validate_every_n_steps=100",
        "train.loss_type=huber",
        "dataset.caption_dropout_rate=0.05",
        "cache.text_encoder_outputs=false",
    ],
}


def _paths(name: str) -> RunPaths:
    run = Path("/runs") / name
    return RunPaths(
        run_dir=run,
        tokenizer_dir=Path("/cache/tokenizers"),
        sample_prompts=run / "sample_prompts.txt",
        tracker_config=run / "tracker.toml",
    )


@pytest.fixture
def golden_compose(compose, monkeypatch, workdir):
    monkeypatch.setenv("FLUX_TRAIN_MODEL_DIR", "/models")

    def _c(*overrides):
        cfg = compose("+dataset=mychar", *overrides)
        cfg.dataset.images = "/data/mychar"  # stable text in the goldens
        return cfg

    return _c


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_tomls(case, golden_compose):
    cfg = golden_compose(*CASES[case])
    train_doc, dataset_doc = translate(
        cfg, _paths(case) if cfg.sample.prompts else RunPaths(Path("/runs") / case, Path("/cache/tokenizers"))
    )
    for kind, doc in (("sd_scripts", train_doc), ("dataset", dataset_doc)):
        path = GOLDEN / f"{case}.{kind}.toml"
        text = doc.dumps()
        if os.environ.get("UPDATE_GOLDENS"):
            path.write_text(text)
        assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDENS=1 once and review it"
        assert text == path.read_text(), f"{path.name} changed; review and UPDATE_GOLDENS=1 if intended"


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_emitted_key_is_in_the_committed_parser_schema(case, golden_compose):
    train_doc, _ = translate(golden_compose(*CASES[case]), _paths(case))
    flat = train_doc.flat()
    assert check_training_keys(flat, FLAGS) == []
    # and the file sd-scripts reads holds exactly these values
    parsed = tomli.loads(train_doc.dumps())
    merged = {k: v for section in parsed.values() for k, v in section.items()}
    assert merged == flat


def test_defaults_carry_the_product_choices(golden_compose):
    train_doc, dataset_doc = translate(golden_compose(), _paths("d"))
    t = train_doc.flat()
    assert t["mixed_precision"] == "bf16" and t["save_precision"] == "bf16"
    assert t["optimizer_type"] == "Prodigy" and t["learning_rate"] == 1.0
    assert "decouple=True" in t["optimizer_args"] and "use_bias_correction=True" in t["optimizer_args"]
    assert t["cache_latents_to_disk"] and t["cache_text_encoder_outputs_to_disk"]
    assert t["sdpa"] is True
    assert (t["network_module"], t["network_dim"], t["network_alpha"]) == ("networks.lora_flux", 16, 16.0)
    assert t["timestep_sampling"] == "flux_shift" and t["model_prediction_type"] == "raw"
    assert t["guidance_scale"] == 1.0
    text = train_doc.dumps()
    for arg in ("decouple", "weight_decay", "use_bias_correction", "safeguard_warmup", "d_coef"):
        line = next(ln for ln in text.splitlines() if f'"{arg}=' in ln)
        assert " # " in line, f"optimizer arg {arg} has no comment saying why"
    d = tomli.loads(dataset_doc.dumps())
    sub = d["datasets"][0]["subsets"][0]
    assert sub["caption_prefix"] == "ohwx," and sub["num_repeats"] == 10
    assert d["datasets"][0]["resolution"] == 512


def test_overrides_reach_the_toml(golden_compose):
    t, _ = translate(golden_compose("network.rank=32", "optimizer=adamw", "train.max_steps=2000"), _paths("o"))
    flat = t.flat()
    assert flat["network_dim"] == 32 and flat["optimizer_type"] == "AdamW" and flat["max_train_steps"] == 2000


def test_the_ae_runs_in_fp32_on_the_cpu_only(golden_compose):
    """A CPU's bf16 convolutions crawl (latent caching of the demo's 8 images: 33 s against ~0.1 s): no_half_vae."""
    cpu, _ = translate(golden_compose("memory=cpu"), _paths("c"))
    gpu, _ = translate(golden_compose("memory=vram24"), _paths("g"))
    assert cpu.flat()["no_half_vae"] is True and "no_half_vae" not in gpu.flat()


def test_network_args_are_strings_lora_flux_parses(golden_compose):
    cfg = golden_compose("network.split_qkv=true", "network.train_blocks=single", "network.loraplus_lr_ratio=4")
    args = translate(cfg, _paths("n"))[0].flat()["network_args"]
    assert args == ["train_blocks=single", "split_qkv=True", "loraplus_lr_ratio=4.0"]
    # networks/lora_flux.py: key, value = s.split("=", 1); booleans compared with the literal "True"
    assert dict(a.split("=", 1) for a in args)["split_qkv"] == "True"


def test_tensorboard_gets_a_tracker_config_that_accelerate_passes_to_its_writer(golden_compose, tmp_path):
    """sd-scripts reads `log_tracker_config` as accelerate's init_kwargs; the [tensorboard] table becomes the
    keyword arguments of its SummaryWriter (no queue of 10 events, a flush every 10 s)."""
    from accelerate import Accelerator

    from flux_trainer.sdscripts.translate import tracker_document

    t = translate(golden_compose(), _paths("d"))[0].flat()
    assert t["log_tracker_config"] == "/runs/d/tracker.toml" and t["log_with"] == "tensorboard"
    off = translate(golden_compose("logging.tensorboard=false"), _paths("d"))[0].flat()
    assert "log_tracker_config" not in off and "log_with" not in off
    kwargs = tomli.loads(tracker_document().dumps())
    assert kwargs == {"tensorboard": {"max_queue": 1000, "flush_secs": 10}}
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("network_train", init_kwargs=kwargs)  # what sd-scripts' init_trackers does with it
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    assert (writer.max_queue, writer.flush_secs) == (1000, 10)
    accelerator.end_training()


def test_schema_check_catches_unknown_and_mistyped_keys():
    problems = check_training_keys({"network_dimm": 16, "network_dim": "16", "mixed_precision": "fp9"}, FLAGS)
    assert any("network_dimm" in p and "silently ignore" in p for p in problems)
    assert any("'network_dim' takes a int" in p for p in problems)
    assert any("fp9" in p and "bf16" in p for p in problems)


NASTY = [
    'say "hi"',
    "C:\\Users\\me\\pics",
    "line1\nline2",
    "ünïcødé ✓ Ελληνικά кириллица",
    "tab\there",
    'back\\slash"quote',
    "\x01",
]


@pytest.mark.parametrize("value", NASTY)
def test_toml_strings_round_trip(value):
    doc = Document()
    doc.table("t").add("k", value)
    doc.table("d", array=True).add("image_dir", value)
    parsed = tomli.loads(doc.dumps())
    assert parsed["t"]["k"] == value and parsed["d"][0]["image_dir"] == value


def test_user_strings_in_dataset_round_trip(golden_compose):
    cfg = golden_compose()
    cfg.dataset.images = 'C:\\data\\my "char"\nx'
    cfg.dataset.trigger = "ohwx ✓"
    _, dataset_doc = translate(cfg, _paths("s"))
    sub = tomli.loads(dataset_doc.dumps())["datasets"][0]["subsets"][0]
    assert sub["image_dir"] == 'C:\\data\\my "char"\nx' and sub["caption_prefix"] == "ohwx ✓,"


def test_committed_schema_records_the_pinned_commit():
    from flux_trainer.sdscripts.checkout import PINNED_COMMIT

    assert load_schema()["commit"] == PINNED_COMMIT
    assert len(FLAGS) > 150 and FLAGS["network_args"]["kind"] == "list"


MULTI_FOLDER = [
    "dataset.images=null",
    "dataset.resolution=[512,768,1024]",
    "dataset.subsets=[{images:'/data/mychar/closeups',trigger:ohwx,repeats:10,caption_dropout_rate:0.05},"
    "{images:'/data/mychar/full_body',trigger:ohwx,repeats:5},{images:'/data/reg/man',is_reg:true,repeats:1}]",
    "train.prior_loss_weight=0.8",
    "cache.text_encoder_outputs=false",
]


def test_golden_multi_folder(golden_compose):
    """Several folders, a regularisation folder and three resolutions: one sd-scripts dataset per resolution, each
    with every folder as a subset; the staged folders stand in for the user's, in order."""
    cfg = golden_compose(*MULTI_FOLDER)
    cfg.dataset.images = None
    staged = (Path("/cache/datasets/a"), Path("/cache/datasets/b"), Path("/cache/datasets/c"))
    train_doc, dataset_doc = translate(cfg, RunPaths(Path("/runs/multi"), Path("/cache/tokenizers"), images=staged))
    for kind, doc in (("sd_scripts", train_doc), ("dataset", dataset_doc)):
        path = GOLDEN / f"multi_folder.{kind}.toml"
        if os.environ.get("UPDATE_GOLDENS"):
            path.write_text(doc.dumps())
        assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDENS=1 once and review it"
        assert doc.dumps() == path.read_text(), f"{path.name} changed; review and UPDATE_GOLDENS=1 if intended"
    assert check_training_keys(train_doc.flat(), FLAGS) == []
    with pytest.raises(ValueError, match="2 staged folders for the 3 folders"):
        translate(cfg, RunPaths(Path("/runs/multi"), images=staged[:2]))
