"""`flux-train dataset caption DIR`: a caption beside every image that has none, from a vision-language model.

Everything that can be refused is refused before the model loads and before anything is written: an unknown
captioner, a missing folder, a folder without images, a captioner not downloaded (with the setup command).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flux_trainer.caption.models import DEFAULT, RANDOM_TINY, CaptionerSpec, resolve
from flux_trainer.caption.run import Outcome, Plan, caption_folder, model_folder, plan_folder
from flux_trainer.config import ConfigError

DRY_RUN_IMAGES = 3
NONSENSE = "random_tiny is random weights: its captions are nonsense (for tests and the CPU demo only)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="the image folder; captions are written beside the images")
    p.add_argument("--model", default=DEFAULT, help=f"captioner (default {DEFAULT}; random_tiny: no download)")
    p.add_argument("--overwrite", action="store_true", help="caption every image, replacing existing captions")
    p.add_argument("--trigger", help="word put first in every caption written")
    p.add_argument("--prompt", help="what the model is asked (default: a one-paragraph FLUX-style caption)")
    p.add_argument("--batch-size", type=int, help="images per batch (default: 4 on a GPU, 1 on the CPU)")
    p.add_argument("--dry-run", action="store_true", help=f"show {DRY_RUN_IMAGES} captions, write nothing")


def prepare(folder: Path, model: str | None, overwrite: bool) -> tuple[CaptionerSpec, Plan, Path]:
    """The captioner, the folder's plan and the model's files, or one ConfigError: nothing loaded or written."""
    spec = resolve(model)
    plan = plan_folder(folder, overwrite)
    return spec, plan, model_folder(spec)


def caption_images(
    spec: CaptionerSpec,
    plan: Plan,
    files: Path,
    *,
    trigger: str | None = None,
    prompt: str | None = None,
    batch_size: int | None = None,
    dry_run: bool = False,
) -> Outcome:
    """Load the captioner and caption the plan's images, saying what it does as it goes."""
    from flux_trainer.caption.engine import PROMPT, load, place

    print(
        f"{plan.folder}: {len(plan.todo)} to caption, {len(plan.kept)} keep their caption, "
        f"{len(plan.failed)} cannot be captioned"
    )
    if dry_run:
        print(f"dry run: the first {min(DRY_RUN_IMAGES, len(plan.todo))} captions are shown, nothing is written")
    if spec.name == RANDOM_TINY:
        print(f"note: {NONSENSE}")
    if not plan.todo:
        return Outcome(kept=list(plan.kept), failed=dict(plan.failed))
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: must be at least 1")
    placement = place()
    if placement.slow and spec.name != RANDOM_TINY:
        print(f"note: no GPU, so {spec.name} runs on the CPU in fp32: expect minutes per image")
    elif placement.slow:
        print("note: captioning on the CPU (slow for a real captioner; random_tiny is small)")
    batch = batch_size or (1 if placement.slow else 4)
    where = placement.gpu_name or "CPU"
    print(f"loading {spec.name} on the {where} ({str(placement.dtype).removeprefix('torch.')}, batch {batch})")
    engine = load(spec, files, placement)
    text = prompt or PROMPT
    outcome = caption_folder(
        plan,
        lambda images: engine.caption(images, text),
        trigger=trigger,
        batch_size=batch,
        dry_run=DRY_RUN_IMAGES if dry_run else 0,
    )
    if outcome.captioned:
        rate = outcome.captioned / outcome.seconds if outcome.seconds else 0.0
        print(f"{outcome.captioned} images in {outcome.seconds:.1f} s ({rate:.2f} images/s)")
    return outcome


def caption_command(ns: argparse.Namespace) -> int:
    """0: every image has a caption; 1: some failed (named); 130: interrupted (what was written is said)."""
    spec, plan, files = prepare(ns.folder, ns.model, ns.overwrite)
    outcome = caption_images(
        spec, plan, files, trigger=ns.trigger, prompt=ns.prompt, batch_size=ns.batch_size, dry_run=ns.dry_run
    )
    print(("dry run: " if ns.dry_run else "captions: ") + outcome.summary())
    if spec.name == RANDOM_TINY and outcome.captioned:
        print(f"note: {NONSENSE}")
    if outcome.interrupted:
        print("flux-train: interrupted", file=sys.stderr)
        return 130
    return 1 if outcome.failed else 0
