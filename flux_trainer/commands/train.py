"""Training from the command line: Hydra overrides and flags in, one run (or a sweep) out.

`run_training` splits Hydra's own flags from the overrides (`split_args`), checks everything before Hydra makes a
run dir (`preflight`: every refusal one line with its fix), then hands the overrides to `@hydra.main`
(`hydra_run`), whose task (`_hydra_task`) calls `flux_trainer.app.train` in the run dir. A sweep (`-m`) checks every
member first and summarises at the end (`run_sweep`, with `flux_trainer.commands.sweep`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from flux_trainer.commands import fail
from flux_trainer.config import ConfigError

MULTIRUN_FLAGS = ("-m", "--multirun")
_exit_code = 0


def compose_checked(
    overrides: list[str], search_dirs: list[Path], *, config_path: str | None = None, config_name: str | None = None
):
    """Compose the run as Hydra will, every value resolved, or one line per problem (flux_trainer.config.refusals):
    YAML syntax (file:line), an unknown option or key (what exists), a value Hydra cannot read, an interpolation
    that resolves to nothing."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue, OmegaConfBaseException

    from flux_trainer.config import refusals
    from flux_trainer.config.compose import compose_run
    from flux_trainer.config.schema import RunConfig

    tree = refusals.schema_keys(RunConfig)
    try:
        cfg = compose_run(overrides, search_dirs, config_path=config_path, config_name=config_name)
    except yaml.YAMLError as exc:
        raise ConfigError(refusals.yaml_problem(exc)) from exc
    except (HydraException, OmegaConfBaseException) as exc:
        found = refusals.find_yaml_error(overrides, search_dirs, refusals.chosen_groups(overrides))
        raise ConfigError(found or _composition_problem(exc, overrides, search_dirs, tree)) from exc
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except (InterpolationToMissingValueError, MissingMandatoryValue):
        pass  # a key left to fill (no +dataset=, a dataset file without a key): preflight names it
    except OmegaConfBaseException as exc:
        raise ConfigError(refusals.interpolation_problem(exc)) from exc
    return cfg


def preflight(
    overrides: list[str], search_dirs: list[Path], *, config_path: str | None = None, config_name: str | None = None
):
    """Compose and check before Hydra creates a run dir, so bad input leaves nothing behind: every refusal is one
    line naming the override or file and the fix (flux_trainer.config.refusals). Returns the composed config."""
    from omegaconf import OmegaConf

    from flux_trainer.config import refusals
    from flux_trainer.config.schema import RunConfig
    from flux_trainer.config.validate import no_dataset_message

    cfg = compose_checked(overrides, search_dirs, config_path=config_path, config_name=config_name)
    if OmegaConf.is_missing(cfg, "dataset"):
        raise ConfigError(no_dataset_message(search_dirs))
    tree = refusals.schema_keys(RunConfig)
    if unknown := refusals.unknown_added_keys(cfg, RunConfig):
        raise ConfigError([refusals.unknown_key_message(k, tree) for k in unknown])
    missing = sorted(OmegaConf.missing_keys(cfg))
    if cfg.dataset.get("images") is None and not cfg.dataset.get("subsets"):  # neither form of dataset: its folder
        missing.append("dataset.images")
    if missing:
        option = refusals.chosen_groups(overrides).get("dataset")
        files = [d / "dataset" / f"{option}.yaml" for d in search_dirs if option]
        raise ConfigError(refusals.missing_keys_message(missing, next((f for f in files if f.is_file()), None)))
    if problem := refusals.output_name_problem(cfg.train.output_name):
        raise ConfigError(problem)
    return cfg


def _composition_problem(exc: BaseException, overrides: list[str], search_dirs: list[Path], tree: dict) -> str:
    """The one line for a composition error: a group option that does not exist lists those that do."""
    from flux_trainer.commands.help import group_options
    from flux_trainer.config import refusals

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    m = re.search(r"Could not find '([\w/-]+?)/?([^'/]*)'", text)
    if m is None:
        return refusals.explain_composition_error(exc, overrides, tree)
    group, option = m.groups()
    found = group_options(group, search_dirs)
    if group.startswith("hydra/"):  # Hydra's own options and its plugins' live in the ConfigStore
        found = sorted({*found, *_stored_options(group)})
    choose = f"choose one of: {', '.join(found) or 'none found'}"
    text = f"{group}={option}: no such {group} config; {choose}" if option else f"{group}=: no option named; {choose}"
    if group == "dataset":
        text += f" (in {', '.join(str(d / 'dataset') for d in search_dirs) or './configs/dataset'}); "
        text += "create one with `flux-train dataset init NAME --images DIR`"
    return text


def _stored_options(group: str) -> list[str]:
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # imports installed Hydra plugins, which register their configs
    try:
        return [name.removesuffix(".yaml") for name in ConfigStore.instance().list(group)]
    except OSError:
        return []


# Hydra's own command-line flags (hydra/_internal/utils.py get_args_parser): those that take a value, and those that
# show something (config, information, help, completion) instead of running the job.
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
               "--experimental-rerun")  # fmt: skip
INFO_TOPICS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
SHOW_FLAGS = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--shell-completion", "-sc", "--version")
HELP_FLAGS = ("--hydra-help", "--version")


def split_args(argv: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """Hydra's flags (name -> value, None for a switch) and the overrides, as Hydra's own parser would split them."""
    flags: dict[str, str | None] = {}
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg.startswith("-") and eq and name in VALUE_FLAGS + ("--info", "-i"):
            flags[name] = value
        elif arg in VALUE_FLAGS and i + 1 < len(argv):
            flags[arg], i = argv[i + 1], i + 1
        elif arg in ("--info", "-i"):
            topic = argv[i + 1] if i + 1 < len(argv) and argv[i + 1] in INFO_TOPICS else None
            flags[arg], i = topic, i + (topic is not None)
        elif arg.startswith("-"):
            flags[arg] = None
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides


def _flag(flags: dict[str, str | None], *names: str) -> str | None:
    return next((flags[n] for n in names if n in flags), None)


def run_training(argv: list[str], search_dirs: list[Path] | None = None) -> int:
    """Training, a sweep, or one of Hydra's own modes (`--cfg job`, `--info`, `--hydra-help` ...), which show things
    and run nothing, so they skip the checks a run gets. `--config-dir DIR` adds DIR to the user's config folders;
    `-cp DIR` / `-cn NAME` pick another primary config, which the checks compose too."""
    from flux_trainer.commands.sweep import check_launcher
    from flux_trainer.config.paths import user_config_dirs

    flags, overrides = split_args(argv)
    search_dirs = list(search_dirs or user_config_dirs())
    if config_dir := _flag(flags, "--config-dir", "-cd"):
        search_dirs.insert(0, Path(config_dir).expanduser().absolute())
    search_dirs = [d for d in search_dirs if d.is_dir()]
    primary = _flag(flags, "--config-path", "-cp")
    if primary is not None:  # Hydra reads a relative one against its own module: give it the one the user meant
        primary = str(Path(primary).expanduser().absolute())
        argv = _replace_flag(argv, ("--config-path", "-cp"), primary)
    name = _flag(flags, "--config-name", "-cn")
    if any(f in flags for f in SHOW_FLAGS):
        if any(f in flags for f in HELP_FLAGS):  # Hydra's own help and version: about Hydra, not this run's values
            argv = [t for flag, value in flags.items() for t in ([flag] if value is None else [flag, value])]
        elif overrides or primary or name:  # what --cfg / --info show must compose: the same one-line refusals
            compose_checked(overrides, search_dirs, config_path=primary, config_name=name)
        try:
            return hydra_run(argv, search_dirs)
        except ValueError as exc:  # Hydra's own refusal of a combination ("Only one of --run, --multirun, --cfg ...")
            raise ConfigError(f"{exc} (Hydra's own flags)") from exc
        except SystemExit as exc:  # argparse's --version prints and exits
            return exc.code if isinstance(exc.code, int) else 0
    multirun = any(f in flags for f in MULTIRUN_FLAGS)
    check_launcher(overrides, multirun)
    if multirun:
        return run_sweep(argv, search_dirs)
    preflight(overrides, search_dirs, config_path=primary, config_name=name)
    return hydra_run(argv, search_dirs)


def _replace_flag(argv: list[str], names: tuple[str, ...], value: str) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in names:
            out.append(f"{arg}={value}")
            skip = i + 1 < len(argv)
        elif arg.partition("=")[0] in names and "=" in arg:
            out.append(f"{arg.partition('=')[0]}={value}")
        else:
            out.append(arg)
    return out


def run_sweep(overrides: list[str], search_dirs: list[Path]) -> int:
    """`flux-train -m ...`: check every swept value, run the members through Hydra's launcher, then summarise.

    A value that does not compose (unknown option, typo'd key, wrong type) stops the sweep before anything runs,
    one line per bad member; Hydra would refuse it too, only later. A member that composes but fails (bad value,
    crash, training error) is recorded and the sweep goes on. Ctrl-C stops the sweep; the summary still follows.
    """
    from flux_trainer.commands import sweep

    members, hydra_args = sweep.parse(split_args(overrides)[1])
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
    flags, plain = split_args(overrides)
    tokens = [t for name, value in flags.items() for t in ([name] if value is None else [name, value])]
    saved = sys.argv
    # overrides first, flags last: argparse takes no positional after an option with a value (`--cfg job x=1`)
    sys.argv = [saved[0] if saved else "flux-train", *plain, *hydra_overrides(search_dirs), *tokens]
    try:
        task()
    finally:
        sys.argv = saved
    return _exit_code


def _hydra_task(cfg) -> int:
    """One run (or one sweep member): train in Hydra's output dir. Never raises for a failed run, so a sweep
    goes on; a sweep member also leaves a record for the summary (see flux_trainer.commands.sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from flux_trainer.app import train
    from flux_trainer.config.compose import register
    from flux_trainer.config.paths import user_config_dirs
    from flux_trainer.launch.rundir import remove_refused

    global _exit_code
    register()  # a submitit member starts in a fresh process: our resolvers are not registered there yet
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    member = hydra_cfg.job.num if hydra_cfg.mode == RunMode.MULTIRUN else None
    prefix = "" if member is None else f"sweep member #{member}: "
    error = None
    # a refused run leaves nothing: the dir Hydra made, and its output_name folder and runs root if left empty
    parents = () if member is not None else (run_dir.parent, Path(str(cfg.logging.root)).expanduser().absolute())
    try:
        code = train(cfg, run_dir, search_dirs=[d for d in user_config_dirs() if d.is_dir()], exclusive=member is None)
    except ConfigError as exc:
        remove_refused(run_dir, made=False, parents=parents)
        code, error = fail(exc, exc.exit_code, prefix), "; ".join(exc.problems)
    except KeyboardInterrupt:
        print("flux-train: interrupted", file=sys.stderr)
        code, error = 130, "interrupted"
    except Exception as exc:  # noqa: BLE001 - one line for the user; the traceback with -v
        remove_refused(run_dir, made=False, parents=parents)
        code, error = fail(exc, 1, prefix), f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    if member is not None:
        from flux_trainer.commands.sweep import record_member

        if code not in (0, 2, 130) and error is None:
            error = f"training exited with {code}; see {run_dir / 'train.log'}"
        overrides = list(hydra_cfg.overrides.task)
        record_member(Path(hydra_cfg.sweep.dir), member, overrides=overrides, run_dir=run_dir, code=code, error=error)
        if code == 130:
            raise KeyboardInterrupt  # Ctrl-C stops the whole sweep, not just this member
    _exit_code = _exit_code or code
    return code
