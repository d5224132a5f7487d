"""`flux-train`: the entry point. Training runs go through Hydra; a few subcommands do the rest.

    flux-train +dataset=mychar [group=option ...] [key=value ...]   train (Hydra overrides)
    flux-train -m +dataset=mychar network.rank=8,16                  sweep (Hydra multirun)
    flux-train -m hydra/launcher=slurm hydra.launcher.partition=gpu ...  sweep members as SLURM jobs
    flux-train dataset init NAME --images DIR                        write configs/dataset/NAME.yaml
    flux-train dataset caption DIR [--model NAME]                    caption the images that have none
    flux-train demo                                                  tiny random model on generated images
    flux-train setup [--models]                                      get sd-scripts (and model files)
    flux-train runs [ROOT]                                           list runs with their metrics

Bad input: one line naming the cause and the fix, exit code 2, no traceback (add -v, or set
FLUX_TRAIN_VERBOSE=1, for one).
"""

from __future__ import annotations

import os
import sys

from flux_trainer.commands import fail
from flux_trainer.config import ConfigError

SUBCOMMANDS = ("dataset", "demo", "setup", "runs", "doctor", "bench")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-v" in argv or "--verbose" in argv:
        os.environ["FLUX_TRAIN_VERBOSE"] = "1"
        argv = [a for a in argv if a not in ("-v", "--verbose")]
    if argv and argv[0] in ("-h", "--help", "help"):
        from flux_trainer.commands.help import help_text

        print(help_text())
        return 0
    try:
        if argv and argv[0] in SUBCOMMANDS:
            from flux_trainer.commands import dispatch

            return dispatch(argv)
        from flux_trainer.commands.train import run_training

        return run_training(argv)
    except ConfigError as exc:
        return fail(exc, exc.exit_code)
    except KeyboardInterrupt:
        print("flux-train: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
