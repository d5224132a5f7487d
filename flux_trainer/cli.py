"""`flux-train`: the entry point. Training runs go through Hydra; a few subcommands do the rest.

    flux-train +dataset=mychar [group=option ...] [key=value ...]   train (Hydra overrides)
    flux-train -m +dataset=mychar network.rank=8,16                  sweep (Hydra multirun)
    flux-train -m hydra/launcher=slurm hydra.launcher.partition=gpu ...  sweep members as SLURM jobs
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
MULTIRUN_FLAGS = ("-m", "--multirun")
_exit_code = 0


def _verbose() -> bool:
    return os.environ.get("FLUX_TRAIN_VERBOSE", "") not in ("", "0")


def fail(exc: BaseException, code: int = 2, prefix: str = "") -> int:
    if _verbose():
        traceback.print_exception(exc)
    print(f"flux-train: error: {prefix}{exc}", file=sys.stderr)
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
        if text.startswith("Error merging override") and exc.__cause__ is not None:  # the cause says why
            text += ": " + str(exc.__cause__).strip().splitlines()[0]
        if m := re.search(r"Could not find '([\w/-]+)/([^'/]+)'", text):
            group, option = m.groups()
            found = group_options(group, search_dirs)
            if group.startswith("hydra/"):  # Hydra's own options and its plugins' live in the ConfigStore
                found = sorted({*found, *_stored_options(group)})
            text = f"{group}={option}: no such {group} config; choose one of: {', '.join(found) or 'none found'}"
            if group == "dataset":
                text += f" (in {', '.join(str(d / 'dataset') for d in search_dirs) or './configs/dataset'}); "
                text += "create one with `flux-train dataset init NAME --images DIR`"
        raise ConfigError(text) from exc
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(cfg, "dataset"):
        raise ConfigError(no_dataset_message(search_dirs))


def _stored_options(group: str) -> list[str]:
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # imports installed Hydra plugins, which register their configs
    try:
        return [name.removesuffix(".yaml") for name in ConfigStore.instance().list(group)]
    except OSError:
        return []


def run_training(overrides: list[str], search_dirs: list[Path] | None = None) -> int:
    from flux_trainer.config.paths import user_config_dirs
    from flux_trainer.sweep import check_launcher

    search_dirs = [d for d in (search_dirs or user_config_dirs()) if d.is_dir()]
    multirun = any(a in MULTIRUN_FLAGS for a in overrides)
    check_launcher([a for a in overrides if not a.startswith("-")], multirun)
    if multirun and all(a in MULTIRUN_FLAGS or not a.startswith("-") for a in overrides):
        return run_sweep(overrides, search_dirs)
    if multirun:  # Hydra's own modes (--cfg job, --info, ...) show things and run nothing: no summary to make
        return hydra_run(overrides, search_dirs)
    preflight(overrides, search_dirs)
    return hydra_run(overrides, search_dirs)


def run_sweep(overrides: list[str], search_dirs: list[Path]) -> int:
    """`flux-train -m ...`: check every swept value, run the members through Hydra's launcher, then summarise.

    A value that does not compose (unknown option, typo'd key, wrong type) stops the sweep before anything runs,
    one line per bad member; Hydra would refuse it too, only later. A member that composes but fails (bad value,
    crash, training error) is recorded and the sweep goes on. Ctrl-C stops the sweep; the summary still follows.
    """
    from flux_trainer import sweep

    members, hydra_args = sweep.parse([a for a in overrides if not a.startswith("-")])
    checked = sweep.covering(members)
    problems: dict[str, list[sweep.Member]] = {}
    for member in checked:
        try:
            preflight([*member.overrides, *hydra_args], search_dirs)
        except ConfigError as exc:
            problems.setdefault(str(exc), []).append(member)
    if len(problems) == 1 and len(next(iter(problems.values()))) == len(checked):
        raise ConfigError(next(iter(problems)))  # the same problem in every member: say it once
    if problems:
        raise ConfigError([f"sweep member #{m.num} ({m.label}): {text}" for text, ms in problems.items() for m in ms])
    sweep_dir, basic = sweep.sweep_dir_for([*members[0].overrides, *hydra_args], search_dirs)
    expected = members if basic else None  # another sweeper (optuna, ...) picks its own members
    pinned = [*overrides, f"hydra.sweep.dir={sweep.quote_override(str(sweep_dir))}"]
    try:
        hydra_run(pinned, search_dirs)
    except KeyboardInterrupt:
        print("flux-train: interrupted", file=sys.stderr)
        return sweep.finish(sweep_dir, expected, interrupted=True)
    except SystemExit as exc:  # Hydra reported an error of its own (launcher, submitit job) and exited
        print(
            f"flux-train: error: the sweep launcher stopped (exit {exc.code}); members without a record failed",
            file=sys.stderr,
        )
    return sweep.finish(sweep_dir, expected)


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


def _hydra_task(cfg) -> int:
    """One run (or one sweep member): train in Hydra's output dir. Never raises for a failed run, so a sweep
    goes on; a sweep member also leaves a record for the summary (see flux_trainer.sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from flux_trainer.app import train
    from flux_trainer.config.compose import register
    from flux_trainer.config.paths import user_config_dirs

    global _exit_code
    register()  # a submitit member starts in a fresh process: our resolvers are not registered there yet
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    member = hydra_cfg.job.num if hydra_cfg.mode == RunMode.MULTIRUN else None
    prefix = "" if member is None else f"sweep member #{member}: "
    error = None
    try:
        code = train(cfg, run_dir, search_dirs=[d for d in user_config_dirs() if d.is_dir()])
    except ConfigError as exc:
        _remove_if_empty(run_dir)
        code, error = fail(exc, exc.exit_code, prefix), "; ".join(exc.problems)
    except KeyboardInterrupt:
        print("flux-train: interrupted", file=sys.stderr)
        code, error = 130, "interrupted"
    except Exception as exc:  # noqa: BLE001 - one line for the user; the traceback with -v
        _remove_if_empty(run_dir)
        code, error = fail(exc, 1, prefix), f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    if member is not None:
        from flux_trainer.sweep import record_member

        if code not in (0, 2, 130) and error is None:
            error = f"training exited with {code}; see {run_dir / 'train.log'}"
        overrides = list(hydra_cfg.overrides.task)
        record_member(Path(hydra_cfg.sweep.dir), member, overrides=overrides, run_dir=run_dir, code=code, error=error)
        if code == 130:
            raise KeyboardInterrupt  # Ctrl-C stops the whole sweep, not just this member
    _exit_code = _exit_code or code
    return code


def _remove_if_empty(run_dir: Path) -> None:
    try:
        run_dir.rmdir()
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
