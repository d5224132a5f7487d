"""Every memory tier planned for its card on this machine (`memory=vramNN hardware=CARD dry_run=true`): the run dir's
two TOMLs pass sd-scripts' own argument parser and dataset validator, read from the checkout itself."""

from __future__ import annotations

import pytest
import tomli

from flux_trainer.cli import main
from flux_trainer.sdscripts import live_check
from flux_trainer.sdscripts.checkout import import_sd_scripts
from tests.integration.tiny_run import CHECKOUT, WHY
from tests.unit.test_cli import run_dirs

pytestmark = pytest.mark.sd_scripts


# each tier with a card it is for (the full-size random model: sd-scripts reads FLUX.1's block counts)
TIER_CARDS = [
    ("vram8", "rtx4060"),
    ("vram8", "rtx3070"),
    ("vram12", "rtx3060"),
    ("vram16", "rtx5080"),
    ("vram16", "rtx4080"),
    ("vram24", "rtx4090"),
    ("vram24", "rtx3090"),
    ("vram32", "rtx5090"),
    ("vram48", "l40s"),
    ("vram80", "h100"),
    ("vram80", "a100"),
]


@pytest.mark.parametrize(("tier", "card"), TIER_CARDS)
def test_a_tier_planned_for_its_card_passes_sd_scripts_parser(workdir, tier, card):
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")
    assert main(["+dataset=mychar", "model=random", f"memory={tier}", f"hardware={card}", "dry_run=true"]) == 0
    (run,) = run_dirs(workdir)
    train, dataset = run / "sd_scripts.toml", run / "dataset.toml"
    assert live_check.live_check(import_sd_scripts(CHECKOUT.path), train, dataset) == []
    flat = {k: v for t in tomli.loads(train.read_text()).values() for k, v in t.items()}
    assert flat["output_dir"] == str(run)
