"""`flux-train --help`: the groups, their options (shipped and the user's own), and examples."""

from __future__ import annotations

import re
from pathlib import Path

from flux_trainer.config.paths import shipped_config_dir, user_config_dirs

GROUPS = {
    "model": "which model and files: FLUX.1 / Chroma (sd-scripts), FLUX.2 / Kontext (musubi-tuner); random* for tests",
    "dataset": "your images: configs/dataset/NAME.yaml, picked with +dataset=NAME",
    "network": "the LoRA: rank, alpha, which blocks",
    "optimizer": "optimizer and learning-rate schedule",
    "precision": "bf16, or fp8 frozen base weights",
    "memory": "what to trade for VRAM; auto picks the tier for your card",
    "hardware": "the card: auto-detected, or hardware=rtx4090 (rtx3060 ... h200) to plan for a named one",
    "kernels": "fast kernels (auto) or plain sd-scripts (off)",
    "launcher": "processes, GPUs, nodes",
}

EXAMPLES = """\
examples:
  flux-train dataset init mychar --images ~/pics/mychar --trigger ohwx
  flux-train dataset caption ~/pics/mychar --dry-run  # show 3 captions from the captioner, write nothing
  flux-train +dataset=mychar dry_run=true            # write the run dir, do not train
  flux-train +dataset=mychar                          # train with the defaults (Prodigy, bf16, rank 16)
  flux-train +dataset=mychar network.rank=32 optimizer=adamw train.max_steps=2000
  flux-train +dataset=mychar model=random_tiny train.max_steps=3   # smoke run, random weights
  flux-train -m +dataset=mychar network.rank=8,16,32  # a sweep, one run dir each
  flux-train demo                                     # tiny random model on generated images
  flux-train runs                                     # list runs: steps, loss, s/step, peak VRAM

other keys: train.* (max_steps, save_every_n_steps, seed, output_name ...), sample.*, cache.*, logging.root,
sd_scripts=PATH, tokenizer_dir=PATH, resume=auto|off|PATH, dry_run=true. -v shows tracebacks.
"""


def group_options(group: str, user_dirs: list[Path] | None = None) -> list[str]:
    """Options of a config group: the shipped ones and the user's own (./configs, $FLUX_TRAIN_CONFIG_DIR)."""
    found = set()
    for root in [shipped_config_dir(), *(user_config_dirs() if user_dirs is None else user_dirs)]:
        found.update(p.stem for p in (Path(root) / group).glob("*.yaml"))
    return sorted(found, key=natural)


def natural(name: str) -> list:
    """Sort key that reads the numbers in a name as numbers: vram8 before vram12, rtx3060 before rtx4060ti16."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def help_text() -> str:
    lines = [
        "usage: flux-train [+dataset=NAME] [GROUP=OPTION ...] [KEY=VALUE ...] [-m] [-v]",
        "       flux-train {dataset init,dataset caption,demo,setup,runs,doctor,bench} ...",
        "       flux-train [overrides] --cfg job|hydra|all [--resolve] | --info [TOPIC] | --hydra-help",
        "",
        "subcommands:",
        "  dataset init NAME --images DIR   check a folder of images, write configs/dataset/NAME.yaml",
        "  dataset caption DIR [--model M]  write a caption beside each image without one (a VLM)",
        "  demo                             train a tiny random-weight FLUX on generated images (no download)",
        "  setup [--models] [model=NAME]    get the model's trainer at its pinned commit (and the model files)",
        "  runs [ROOT]                      list runs and sweep members: steps, loss, s/step, peak VRAM",
        "  doctor [overrides] [--speed]     why a setup will fail or crawl, with the fix",
        "  bench --cases ... [--baseline]   s/step and memory against plain sd-scripts",
        "",
        "Hydra's own flags work as Hydra documents them: --cfg, --resolve, --info, --hydra-help, -c, -cp/-cn,",
        "--config-dir (adds a folder of your own configs), -m (a sweep).",
        "",
        "config groups:",
    ]
    for group, what in GROUPS.items():
        opts = group_options(group)
        lines.append(f"  {group:<10} {what}")
        lines.append(f"  {'':<10} options: {', '.join(opts) if opts else '(none yet)'}")
    return "\n".join(lines) + "\n\n" + EXAMPLES
