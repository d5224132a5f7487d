"""`flux-train`'s commands, one module each: train (Hydra overrides, the default), dataset, caption (`dataset
caption`), demo, setup, runs, bench, doctor (a package of its own), help. `dispatch` routes a subcommand; `fail`
is every command's one line."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from flux_trainer.config.paths import CONFIG_DIR_ENV


def verbose() -> bool:
    return os.environ.get("FLUX_TRAIN_VERBOSE", "") not in ("", "0")


def fail(exc: BaseException, code: int = 2, prefix: str = "") -> int:
    """The one line a refusal prints (with the traceback under -v); returns the exit code."""
    if verbose():
        traceback.print_exception(exc)
    print(f"flux-train: error: {prefix}{exc}", file=sys.stderr)
    return code


def dispatch(argv: list[str]) -> int:
    from flux_trainer.caption.models import DEFAULT
    from flux_trainer.commands.caption import add_arguments

    ap = argparse.ArgumentParser(prog="flux-train")
    sub = ap.add_subparsers(dest="command", required=True)

    ds = sub.add_parser("dataset", help="dataset configs").add_subparsers(dest="action", required=True)
    init = ds.add_parser("init", help="check an image folder and write configs/dataset/NAME.yaml")
    init.add_argument("name")
    init.add_argument(
        "--images", required=True, type=Path, action="append", help="folder of images with .txt captions (repeatable)"
    )
    init.add_argument("--reg", type=Path, action="append", default=[], help="folder of regularisation images")
    init.add_argument(
        "--masks", type=Path, action="append", default=[],
        help="folder of loss masks named as the images (white: learned); the Nth goes with the Nth --images",
    )  # fmt: skip
    init.add_argument("--trigger", help="word put in front of every caption (and the caption of uncaptioned images)")
    init.add_argument("--resolution", default="1024", help="a resolution, or several: 512,768,1024")
    init.add_argument("--repeats", type=int, default=10)
    init.add_argument("--config-dir", type=Path, help=f"where to write (default ./configs, or ${CONFIG_DIR_ENV})")
    init.add_argument("--force", action="store_true", help="overwrite an existing config of that name")
    init.add_argument(
        "--caption",
        nargs="?",
        const=DEFAULT,
        metavar="MODEL",
        help="first caption the images that have none (`dataset caption`), with MODEL or the default captioner",
    )
    add_arguments(ds.add_parser("caption", help="write a caption beside every image that has none (a VLM)"))

    demo = sub.add_parser("demo", help="train the tiny random model on generated images (no downloads)")
    demo.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. train.max_steps=10")

    setup = sub.add_parser("setup", help="get the pinned sd-scripts checkout (and model files)")
    setup.add_argument("--models", action="store_true", help="also download the model files the config names")
    setup.add_argument(
        "--captioner",
        nargs="?",
        const=DEFAULT,
        metavar="NAME",
        help="with --models: download only this captioner (default: the default one) instead of FLUX's files",
    )
    setup.add_argument("overrides", nargs="*", help="Hydra overrides naming the model, e.g. model=flux_schnell")

    sub.add_parser("bench", help="measure s/step and memory on the random full-size model", add_help=False)
    sub.add_parser("doctor", help="check this machine's GPU, PyTorch, sd-scripts and model files", add_help=False)

    runs = sub.add_parser("runs", help="list runs with steps, last loss, median s/step, peak VRAM")
    runs.add_argument("root", nargs="?", default="runs", type=Path)

    if argv[0] == "bench":
        from flux_trainer.commands.bench import bench_main

        return bench_main(argv[1:])
    if argv[0] == "doctor":
        from flux_trainer.doctor import doctor_main

        return doctor_main(argv[1:])
    ns = ap.parse_args(argv)
    if ns.command == "dataset" and ns.action == "caption":
        from flux_trainer.commands.caption import caption_command

        return caption_command(ns)
    if ns.command == "dataset":
        from flux_trainer.commands.dataset import dataset_init

        return dataset_init(ns)
    if ns.command == "demo":
        from flux_trainer.commands.demo import demo_command

        return demo_command(ns.overrides)
    if ns.command == "setup":
        from flux_trainer.commands.setup import setup

        if ns.captioner:
            from flux_trainer.commands.setup import setup_captioner

            return setup_captioner(ns.captioner, ns.overrides)
        return setup(models=ns.models, overrides=ns.overrides)
    if ns.command == "runs":
        from flux_trainer.commands.runs import runs_command

        return runs_command(ns.root)
    return 2


if __name__ == "__main__":
    sys.exit(dispatch(sys.argv[1:]))
