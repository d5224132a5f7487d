"""Issue 59 end to end on the CPU: tiny random FLUX, 4 steps over 4 images with one held out
(dataset.validation_split=0.25), the validation loss every 2 steps. sd-scripts' `loss/validation/*` scalars land in
the run's own TensorBoard run beside `loss/current`, the step metrics count 4 steps (not the validations), and
`flux-train runs` shows the last validation loss. The new keys also pass sd-scripts' own parser and dataset
validator."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import tomli

from flux_trainer.cli import main
from flux_trainer.sdscripts import live_check
from flux_trainer.sdscripts.checkout import import_sd_scripts
from tests.integration.tiny_run import CHECKOUT, flux_train, need_checkout, newest_run, tiny_dataset
from tests.unit.test_cli import run_dirs

pytestmark = pytest.mark.sd_scripts


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    need_checkout()
    work = tmp_path_factory.mktemp("val")
    tiny_dataset(work, extra="validation_split: 0.25\n")
    proc = flux_train(work, "+dataset=tiny", "model=random_tiny", "train.max_steps=4", "train.save_every_n_steps=null",
                      "train.data_loader_workers=0", "train.validate_every_n_steps=2", "memory=cpu")  # fmt: skip
    return SimpleNamespace(proc=proc, run_dir=newest_run(work), root=work / "runs")


def scalars_by_run(run_dir) -> dict:
    """Each TensorBoard run (event directory) of the run dir: its scalars."""
    from flux_trainer.metrics.tensorboard import read_scalars

    return {p: read_scalars(p) for p in {e.parent for e in (run_dir / "tb").rglob("events.out.tfevents.*")}}


def test_the_run_trains_on_three_images_and_validates_on_one(validated):
    proc, run_dir = validated.proc, validated.run_dir
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ds = tomli.loads((run_dir / "dataset.toml").read_text())["datasets"][0]
    assert (ds["validation_split"], ds["validation_seed"]) == (0.25, 42)
    train = tomli.loads((run_dir / "sd_scripts.toml").read_text())["validation"]
    assert train == {"validate_every_n_steps": 2, "validation_seed": 42}
    log = (run_dir / "train.log").read_text()
    assert "num validation images * repeats" in log
    # sd-scripts' count lines, by their English label (each line also carries a translation after " / ")
    counts = {ln.split(" / ")[0].strip(): ln.rsplit(":", 1)[1].strip() for ln in log.splitlines() if "* repeats" in ln}
    assert counts["num train images * repeats"] == "3", counts
    assert counts["num validation images * repeats"] == "1", counts


def test_validation_loss_is_in_the_same_tensorboard_run_as_the_training_loss(validated):
    runs = scalars_by_run(validated.run_dir)
    (scalars,) = [s for s in runs.values() if "loss/current" in s]
    assert [s for s, _ in scalars["loss/current"]] == [1, 2, 3, 4]
    step_val = scalars["loss/validation/step_average"]
    assert [s for s, _ in step_val] == [2, 4]  # every 2 steps, at the run's step
    assert all(math.isfinite(v) and v > 0 for _, v in step_val)
    assert [s for s, _ in scalars["loss/validation/step_divergence"]] == [2, 4]
    # at each epoch's end too (3 training images a epoch), at the epoch as sd-scripts logs loss/epoch_average
    assert [s for s, _ in scalars["loss/validation/epoch_average"]] == [1, 2]
    # the validations are not steps: one step time per optimizer step, and none of them taking the validation
    assert [s for s, _ in scalars["time/step_s"]] == [1, 2, 3, 4]


def test_runs_shows_the_last_validation_loss(validated, capsys):
    (scalars,) = [s for s in scalars_by_run(validated.run_dir).values() if "loss/current" in s]
    last = scalars["loss/validation/epoch_average"][-1][1]  # logged after step 4's, at the run's end
    assert main(["runs", str(validated.root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "val loss" in out[0]
    row = next(ln.split() for ln in out if ln.startswith("tiny/"))
    assert row[1:4] == ["done", "4", f"{scalars['loss/current'][-1][1]:.4f}"]
    assert row[4] == f"{last:.4f}"


def test_the_new_keys_pass_sd_scripts_parser_and_dataset_validator(workdir):
    need_checkout()
    args = ["+dataset=mychar", "model=random_tiny", "dry_run=true", "dataset.validation_split=0.34"]
    args += ["train.validate_every_n_steps=10", "train.max_validation_steps=2", "train.validation_seed=3"]
    args += ["train.loss_type=huber", "train.huber_c=0.2", "train.huber_schedule=exponential"]
    args += ["dataset.caption_dropout_rate=0.05", "cache.text_encoder_outputs=false"]
    assert main(args) == 0
    (run,) = run_dirs(workdir)
    train, dataset = run / "sd_scripts.toml", run / "dataset.toml"
    assert live_check.live_check(import_sd_scripts(CHECKOUT.path), train, dataset) == []
    flat = {k: v for t in tomli.loads(train.read_text()).values() for k, v in t.items()}
    assert (flat["loss_type"], flat["huber_c"], flat["huber_schedule"]) == ("huber", 0.2, "exponential")
    data = tomli.loads(dataset.read_text())
    assert data["datasets"][0]["subsets"][0]["caption_dropout_rate"] == 0.05
