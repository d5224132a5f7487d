"""The subcommands beside training: dataset init, demo, setup, runs."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flux_trainer.config import ConfigError
from flux_trainer.config.paths import CONFIG_DIR_ENV, cache_root


def dispatch(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="flux-train")
    sub = ap.add_subparsers(dest="command", required=True)

    ds = sub.add_parser("dataset", help="dataset configs").add_subparsers(dest="action", required=True)
    init = ds.add_parser("init", help="check an image folder and write configs/dataset/NAME.yaml")
    init.add_argument("name")
    init.add_argument("--images", required=True, type=Path, help="folder of images with .txt captions")
    init.add_argument("--trigger", help="word put in front of every caption (and the caption of uncaptioned images)")
    init.add_argument("--resolution", type=int, default=1024)
    init.add_argument("--repeats", type=int, default=10)
    init.add_argument("--config-dir", type=Path, help=f"where to write (default ./configs, or ${CONFIG_DIR_ENV})")
    init.add_argument("--force", action="store_true", help="overwrite an existing config of that name")

    demo = sub.add_parser("demo", help="train the tiny random model on generated images (no downloads)")
    demo.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. train.max_steps=10")

    setup = sub.add_parser("setup", help="get the pinned sd-scripts checkout (and model files)")
    setup.add_argument("--models", action="store_true", help="also download the model files the config names")
    setup.add_argument("overrides", nargs="*", help="Hydra overrides naming the model, e.g. model=flux_schnell")

    sub.add_parser("bench", help="measure s/step and memory on the random full-size model", add_help=False)
    sub.add_parser("doctor", help="check this machine's GPU, PyTorch, sd-scripts and model files", add_help=False)

    runs = sub.add_parser("runs", help="list runs with steps, last loss, median s/step, peak VRAM")
    runs.add_argument("root", nargs="?", default="runs", type=Path)

    if argv[0] == "bench":
        from flux_trainer.bench import bench_main

        return bench_main(argv[1:])
    if argv[0] == "doctor":
        from flux_trainer.doctor import doctor_main

        return doctor_main(argv[1:])
    ns = ap.parse_args(argv)
    if ns.command == "dataset":
        return dataset_init(ns)
    if ns.command == "demo":
        return demo_command(ns.overrides)
    if ns.command == "setup":
        from flux_trainer.setup_cmd import setup

        return setup(models=ns.models, overrides=ns.overrides)
    if ns.command == "runs":
        return runs_command(ns.root)
    return 2


def dataset_init(ns: argparse.Namespace) -> int:
    from flux_trainer.datasets import describe_folder, write_dataset_config

    config_dir = ns.config_dir or (
        Path(os.environ[CONFIG_DIR_ENV]) if os.environ.get(CONFIG_DIR_ENV) else Path("configs")
    )
    report = describe_folder(ns.images)
    print(report.text())
    path = write_dataset_config(
        config_dir,
        ns.name,
        ns.images,
        trigger=ns.trigger,
        resolution=ns.resolution,
        repeats=ns.repeats,
        force=ns.force,
        report=report,
    )
    print(f"wrote {path}\nnext: flux-train +dataset={ns.name} dry_run=true")
    return 0


def demo_dir() -> Path:
    return cache_root() / "demo"


def demo_command(extra: list[str]) -> int:
    """Generated images + the tiny random model, a few steps: the whole product with no downloads."""
    from flux_trainer.cli import run_training
    from flux_trainer.config.paths import user_config_dirs
    from flux_trainer.datasets import write_dataset_config
    from flux_trainer.demo import make_demo_dataset

    images = make_demo_dataset(demo_dir() / "images", n=8, size=128)
    configs = demo_dir() / "configs"
    write_dataset_config(
        configs,
        "demo",
        images,
        trigger="demo",
        resolution=128,
        repeats=1,
        force=True,
        extra={"min_bucket_reso": 64, "max_bucket_reso": 256},
    )
    overrides = [
        "+dataset=demo",
        "model=random_tiny",
        "train.max_steps=4",
        "train.save_every_n_steps=2",
        "train.data_loader_workers=0",
        *extra,
    ]
    print("[flux-train] demo: RANDOM tiny FLUX on 8 generated images; it shows the pipeline, not a useful LoRA")
    return run_training(overrides, [*user_config_dirs(), configs])


def runs_command(root: Path) -> int:
    """One line per run dir (runs/<output_name>/<time>), read from its TensorBoard events."""
    from flux_trainer.metrics.tensorboard import summarize_run

    if not root.is_dir():
        raise ConfigError(f"{root} does not exist; runs are under logging.root (default ./runs)")
    run_dirs = sorted(p for p in root.glob("*/*") if (p / "tb").is_dir())
    if not run_dirs:
        print(f"no runs with TensorBoard events under {root}")
        return 0

    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = f"{'run':<40} {'steps':>6} {'last loss':>10} {'s/step':>8} {'peak VRAM':>10} {'TFLOP/s':>8}"
    header += f" {'W':>4} {'SM MHz':>6} {'start-up':>9}"  # the card's medians; command to the first step's end
    print(header + "\n" + "-" * len(header))
    for run_dir in run_dirs:
        s = summarize_run(run_dir)
        name = str(run_dir.relative_to(root))[-40:]
        startup = "-" if s.startup_s is None else f"{s.startup_s:.1f} s"
        print(
            f"{name:<40} {s.steps_done:>6} {fmt(s.last_loss, '.4f'):>10} {fmt(s.median_step_s, '.3f'):>8} "
            f"{fmt(s.peak_vram_gib, '.1f'):>8} G {fmt(s.median_tflops, '.0f'):>8} {fmt(s.median_power_w, '.0f'):>4} "
            f"{fmt(s.median_sm_clock_mhz, '.0f'):>6} {startup:>9}"
        )
    print(f"\ncompare: tensorboard --logdir {root}")
    return 0


if __name__ == "__main__":
    sys.exit(dispatch(sys.argv[1:]))
