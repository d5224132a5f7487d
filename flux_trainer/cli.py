"""`flux-train`: the entry point. Training runs go through Hydra; a few subcommands do the rest.

    flux-train +dataset=mychar [group=option ...] [key=value ...]   train (Hydra overrides)
    flux-train -m +dataset=mychar network.rank=8,16                  sweep (Hydra multirun)
    flux-train dataset init NAME --images DIR                        write configs/dataset/NAME.yaml
    flux-train demo                                                  tiny random model on generated images
    flux-train setup [--models]                                      get sd-scripts (and model files)
    flux-train runs [ROOT]                                           list runs with their metrics

Bad input: one line naming the cause and the fix, exit code 2, no traceback (add -v, or set
FLUX_TRAIN_VERBOSE=1, for one).
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from pathlib import Path

from flux_trainer.config import ConfigError

SUBCOMMANDS = ("dataset", "demo", "setup", "runs", "doctor", "bench")
_exit_code = 0


def _verbose() -> bool:
    return os.environ.get("FLUX_TRAIN_VERBOSE", "") not in ("", "0")


def fail(exc: BaseException, code: int = 2) -> int:
    if _verbose():
        traceback.print_exception(exc)
    print(f"flux-train: error: {exc}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-v" in argv or "--verbose" in argv:
        os.environ["FLUX_TRAIN_VERBOSE"] = "1"
        argv = [a for a in argv if a not in ("-v", "--verbose")]
    if argv and argv[0] in ("-h", "--help", "help"):
        from flux_trainer.cli_help import help_text

        print(help_text())
        return 0
    try:
        if argv and argv[0] in SUBCOMMANDS:
            from flux_trainer import cli_commands

            return cli_commands.dispatch(argv)
        return run_training(argv)
    except ConfigError as exc:
        return fail(exc, exc.exit_code)
    except KeyboardInterrupt:
        print("flux-train: interrupted", file=sys.stderr)
        return 130


def preflight(overrides: list[str], search_dirs: list[Path]) -> None:
    """Compose and validate before Hydra creates a run dir, so bad input leaves nothing behind."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from flux_trainer.cli_help import group_options
    from flux_trainer.config.compose import compose_run
    from flux_trainer.config.validate import no_dataset_message

    try:
        cfg = compose_run(overrides, search_dirs)
    except (HydraException, OmegaConfBaseException) as exc:
        text = str(exc).strip().splitlines()[0]
        if m := re.search(r"Could not find '([\w-]+)/([^']+)'", text):
            group, option = m.groups()
            found = group_options(group, search_dirs)
            text = f"{group}={option}: no such {group} config; choose one of: {', '.join(found) or 'none found'}"
            if group == "dataset":
                text += f" (in {', '.join(str(d / 'dataset') for d in search_dirs) or './configs/dataset'}); "
                text += "create one with `flux-train dataset init NAME --images DIR`"
        raise ConfigError(text) from exc
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(cfg, "dataset"):
        raise ConfigError(no_dataset_message(search_dirs))


def run_training(overrides: list[str], search_dirs: list[Path] | None = None) -> int:
    from flux_trainer.config.paths import user_config_dirs

    search_dirs = [d for d in (search_dirs or user_config_dirs()) if d.is_dir()]
    multirun = any(a in ("-m", "--multirun") for a in overrides)
    if not multirun:
        preflight(overrides, search_dirs)
    return hydra_run(overrides, search_dirs)


def hydra_run(overrides: list[str], search_dirs: list[Path]) -> int:
    """Hand the overrides to `@hydra.main`, which makes the run dir and calls `_hydra_task`."""
    import hydra

    from flux_trainer.config.compose import hydra_overrides, register
    from flux_trainer.config.paths import shipped_config_dir

    register()
    global _exit_code
    _exit_code = 0
    task = hydra.main(config_path=str(shipped_config_dir()), config_name="config", version_base="1.3")(_hydra_task)
    saved = sys.argv
    sys.argv = [saved[0] if saved else "flux-train", *overrides, *hydra_overrides(search_dirs)]
    try:
        task()
    finally:
        sys.argv = saved
    return _exit_code


def _hydra_task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from flux_trainer.app import train
    from flux_trainer.config.paths import user_config_dirs

    global _exit_code
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        code = train(cfg, run_dir, search_dirs=[d for d in user_config_dirs() if d.is_dir()])
    except ConfigError as exc:
        _remove_if_empty(run_dir)
        code = fail(exc, exc.exit_code)
    except KeyboardInterrupt:
        print("flux-train: interrupted", file=sys.stderr)
        code = 130
    except Exception as exc:  # noqa: BLE001 - one line for the user; the traceback with -v
        _remove_if_empty(run_dir)
        code = fail(exc, 1)
    _exit_code = _exit_code or code


def _remove_if_empty(run_dir: Path) -> None:
    try:
        run_dir.rmdir()
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
