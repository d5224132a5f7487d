"""Issue 59: the validation loss (dataset.validation_split, train.validate_every_n_steps), train.loss_type and
dataset.caption_dropout_rate: refused with one line where wrong, translated to the keys sd-scripts reads, and the
validation loss read back for `flux-train runs`."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli
from torch.utils.tensorboard import SummaryWriter

from flux_trainer.cli import main
from flux_trainer.config import ConfigError
from flux_trainer.config.validate import validate
from flux_trainer.data.stage import ready, split_counts
from flux_trainer.metrics.step import StepMetrics
from flux_trainer.metrics.tensorboard import summarize_run
from flux_trainer.sdscripts.parser_schema import check_training_keys, load_schema
from flux_trainer.sdscripts.translate import RunPaths, translate
from tests.unit.test_cli import run_dirs
from tests.unit.test_data_check import dataset_and_model, make_images
from tests.unit.test_metrics_step import FakeClock

FLAGS = load_schema()["flags"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["dataset.validation_split=0.7"], "dataset.validation_split=0.7: the fraction of images held out"),
        (["dataset.validation_split=-0.1"], "dataset.validation_split=-0.1:"),
        (["train.loss_type=l3"], "train.loss_type=l3: unknown; choose l2, l1, huber, smooth_l1"),
        (["train.loss_type=huber", "train.huber_schedule=snr"], "snr needs a noise schedule"),
        (["train.loss_type=smooth_l1", "train.huber_c=0"], "train.huber_c=0.0: must be above 0"),
        (["train.validate_every_n_steps=0"], "train.validate_every_n_steps=0: must be at least 1"),
        (["dataset.caption_dropout_rate=1.5"], "dataset.caption_dropout_rate=1.5: a fraction"),
        (["dataset.caption_dropout_rate=0.1"], "needs cache.text_encoder_outputs=false"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(workdir, capsys, args, needle):
    assert main(["+dataset=mychar", "model=random_tiny", "dry_run=true", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert err.strip().count("\n") == 0 and err.startswith("flux-train: error:"), err
    assert run_dirs(workdir) == []


def test_good_values_pass_and_a_validation_step_without_a_split_is_a_warning(compose):
    ok = compose("+dataset=mychar", "model=random_tiny", "dataset.validation_split=0.5", "train.loss_type=huber")
    assert validate(ok) == []
    for loss in ("l1", "l2", "smooth_l1"):
        assert validate(compose("+dataset=mychar", "model=random_tiny", f"train.loss_type={loss}")) == []
    (warning,) = validate(compose("+dataset=mychar", "model=random_tiny", "train.validate_every_n_steps=10"))
    assert "dataset.validation_split is 0: no validation loss" in warning
    with pytest.raises(ConfigError):
        validate(compose("+dataset=mychar", "model=random_tiny", "dataset.validation_split=0.51"))


def _translated(compose, *overrides):
    cfg = compose("+dataset=mychar", "model=random_tiny", *overrides)
    train, dataset = translate(cfg, RunPaths(Path("/runs/v")))
    assert check_training_keys(train.flat(), FLAGS) == []
    return train.flat(), tomli.loads(dataset.dumps())


def test_the_split_goes_to_the_dataset_with_one_seed_and_validation_to_the_training_toml(compose):
    flat, data = _translated(
        compose, "dataset.validation_split=0.25", "train.validate_every_n_steps=50", "train.max_validation_steps=4"
    )
    ds = data["datasets"][0]
    # one seed for the training and the validation part's shuffles (else they overlap), train.seed by default
    assert (ds["validation_split"], ds["validation_seed"]) == (0.25, 42)
    assert (flat["validate_every_n_steps"], flat["max_validation_steps"], flat["validation_seed"]) == (50, 4, 42)
    assert "validation_split" not in flat  # the dataset's, not the training arguments' fallback
    flat, data = _translated(compose, "dataset.validation_split=0.25", "train.validation_seed=7")
    assert data["datasets"][0]["validation_seed"] == 7 and flat["validation_seed"] == 7
    assert "validate_every_n_steps" not in flat  # null: sd-scripts validates at each epoch's end only


def test_without_a_split_nothing_about_validation_is_written(compose):
    flat, data = _translated(compose, "train.validate_every_n_steps=50")
    assert not [k for k in flat if "validat" in k] and not [k for k in data["datasets"][0] if "validat" in k]


def test_loss_types_and_huber_options(compose):
    flat, _ = _translated(compose)
    assert flat["loss_type"] == "l2" and "huber_c" not in flat and "huber_schedule" not in flat
    flat, _ = _translated(compose, "train.loss_type=smooth_l1", "train.huber_c=0.2", "train.huber_schedule=exponential")
    assert (flat["loss_type"], flat["huber_c"], flat["huber_schedule"]) == ("smooth_l1", 0.2, "exponential")
    flat, _ = _translated(compose, "train.loss_type=huber")
    assert (flat["huber_c"], flat["huber_schedule"]) == (0.1, "constant")  # not sd-scripts' snr, which fails on FLUX


def test_caption_dropout_is_the_subsets_option(compose):
    _, data = _translated(compose, "dataset.caption_dropout_rate=0.05", "cache.text_encoder_outputs=false")
    assert data["datasets"][0]["subsets"][0]["caption_dropout_rate"] == 0.05
    _, data = _translated(compose)
    assert "caption_dropout_rate" not in data["datasets"][0]["subsets"][0]


@pytest.mark.parametrize(
    ("images", "split", "counts"), [(10, 0.1, (9, 1)), (4, 0.1, (4, 0)), (4, 0.25, (3, 1)), (15, 0.1, (14, 2))]
)
def test_split_counts_follow_sd_scripts(images, split, counts):
    assert split_counts(images, split) == counts
    assert split_counts(images, 0.0) == (images, 0)


def test_a_split_that_holds_out_no_image_is_refused_before_staging(tmp_path):
    folder = make_images(tmp_path / "pics", n=3)
    dataset, model = dataset_and_model("d", folder)
    dataset.validation_split = 0.1
    with pytest.raises(ConfigError, match=r"holds out no image .*set dataset.validation_split=0.34 or more") as info:
        ready(dataset, model, tmp_path / "cache")
    assert len(info.value.problems) == 1
    assert not (tmp_path / "cache" / "datasets").exists()
    dataset.validation_split = 0.34
    with pytest.raises(ConfigError, match=r"larger than the 2 images dataset 'd' trains on"):
        ready(dataset, model, tmp_path / "cache", batch_size=3)
    staged, notes = ready(dataset, model, tmp_path / "cache", batch_size=2)
    assert len(list(staged.glob("*.png"))) == 3 and notes == []  # sd-scripts splits the staged folder itself


def test_validation_time_is_not_the_next_steps_time():
    m = StepMetrics("cpu", flops_per_step=1e12, images_per_step=1, clock=FakeClock(0.0, 1.0, 5.0, 6.0), nvml=None)
    m.start()  # 0.0
    assert m.on_step_end(1)["time/step_s"] == 1.0  # 1.0
    m.skip_since_step_end()  # 5.0: four seconds of validation
    assert m.on_step_end(2)["time/step_s"] == 1.0  # 6.0, not 5.0


def _events(run_dir: Path, val: dict[str, list[tuple[int, float]]]) -> Path:
    with SummaryWriter(str(run_dir / "tb" / "network_train")) as w:
        for s in (1, 2, 3, 4):
            w.add_scalar("loss/current", 1.0 / s, s)
        for tag, points in val.items():
            for step, value in points:
                w.add_scalar(tag, value, step)
    return run_dir


def test_runs_shows_the_last_validation_loss(tmp_path, capsys):
    root = tmp_path / "runs"
    _events(root / "a" / "2026-11-28_08-00-00", {"loss/validation/step_average": [(2, 0.5), (4, 0.25)]})
    _events(root / "b" / "2026-11-28_09-00-00", {})
    s = summarize_run(root / "a" / "2026-11-28_08-00-00")
    assert s.last_val_loss == 0.25 and s.loss_tag == "loss/current" and s.last_loss == 0.25
    assert summarize_run(root / "b" / "2026-11-28_09-00-00").last_val_loss is None
    assert main(["runs", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:6] == ["run", "status", "steps", "last", "loss", "val"]
    a = next(ln.split() for ln in out if ln.startswith("a/"))
    b = next(ln.split() for ln in out if ln.startswith("b/"))
    assert a[1:5] == ["stopped", "4", "0.2500", "0.2500"] and b[4] == "-"


def test_only_validation_losses_is_not_taken_for_the_training_loss(tmp_path):
    run = tmp_path / "r"
    with SummaryWriter(str(run / "tb")) as w:
        w.add_scalar("loss/validation/epoch_average", 0.75, 1)
        w.add_scalar("loss/average", 0.5, 3)
    s = summarize_run(run)
    assert (s.loss_tag, s.last_loss, s.last_val_loss) == ("loss/average", 0.5, 0.75)


def test_an_image_in_both_parts_is_a_note(tmp_path):
    folder = make_images(tmp_path / "pics", n=5)
    dataset, model = dataset_and_model("d", folder)
    dataset.validation_split = 0.3  # sd-scripts: ceil(3.5) = 4 trained, round(1.5) = 2 held out, of 5
    _, notes = ready(dataset, model, tmp_path / "cache")
    assert notes == [
        "dataset.validation_split=0.3: 1 of the 2 held-out images also trains (sd-scripts' rounding of 5 images)"
    ]
