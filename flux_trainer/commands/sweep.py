"""Sweeps (`flux-train -m ...`): each member of a Hydra multirun in its own run dir, a failed member never stops
the others, and one summary at the end: a table on stdout and `summary.json` in the sweep dir.

Hydra expands the sweep and launches the members: one after another in this process by default, as submitit jobs
with `hydra/launcher=slurm` or `hydra/launcher=local_submitit`. Every member writes one record,
`<sweep dir>/.members/<num>.json`, wherever it ran; the summary is built from those files rather than from Hydra's
return values, because `@hydra.main` discards what a sweep returns and submitit members run in other processes
(under SLURM, on other machines that share the sweep dir).

Also here: `effective_batch`, the images per optimizer step of a (multi-GPU, multi-node) run.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux_trainer.config.errors import ConfigError

MEMBERS_DIR = ".members"
SUMMARY_FILE = "summary.json"
SLURM_EXTRA = "pip install 'flux-trainer[slurm]'"
SUBMITIT_PLUGIN = "hydra_plugins.hydra_submitit_launcher"
SUBMITIT_LAUNCHERS = ("slurm", "local_submitit", "submitit_local", "submitit_slurm")
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
STATUS = {0: "ok", 2: "bad input", 130: "interrupted"}  # any other exit code: "failed"


def effective_batch(cfg: Any, processes: int) -> int:
    """Images per optimizer step: per-process batch x gradient accumulation x processes (GPUs over all nodes).

    sd-scripts' `train_batch_size` (our `train.batch_size`) is per process, and accelerate's data parallelism
    averages gradients over processes, so a 2-GPU run steps with twice the images of a 1-GPU run. Neither
    sd-scripts nor accelerate scales the learning rate with it.
    """
    return int(cfg.train.batch_size) * int(cfg.train.gradient_accumulation_steps) * int(processes)


def effective_batch_line(cfg: Any, processes: int) -> str:
    """The sentence to print once at launch."""
    batch, accum = int(cfg.train.batch_size), int(cfg.train.gradient_accumulation_steps)
    line = (
        f"effective batch {effective_batch(cfg, processes)} images/step = train.batch_size {batch} "
        f"x train.gradient_accumulation_steps {accum} x {processes} process{'es' if processes != 1 else ''}"
    )
    if processes > 1:
        line += " (the learning rate is not scaled with it)"
    return line


@dataclass(frozen=True)
class Member:
    """One member of a sweep, numbered as Hydra numbers it (`hydra.job.num`)."""

    num: int
    overrides: tuple[str, ...]  # every task override of this member, as Hydra passes them
    varying: tuple[str, ...]  # the swept ones: what sets this member apart

    @property
    def label(self) -> str:
        return " ".join(self.varying or self.overrides) or "(no overrides)"


def launcher_choice(args: list[str]) -> str | None:
    """The `hydra/launcher=NAME` of a command line (the last one wins, as in Hydra)."""
    choice = None
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") == "hydra/launcher":
            choice = value.strip()
    return choice


def check_launcher(args: list[str], multirun: bool) -> None:
    """A submitit launcher needs its plugin installed, and launchers only launch sweeps: say so in one line."""
    choice = launcher_choice(args)
    if choice is None:
        return
    if not multirun:
        raise ConfigError(
            f"hydra/launcher={choice} launches sweep members: add -m (a command line without a sweep is a "
            "1-member sweep)"
        )
    if choice in SUBMITIT_LAUNCHERS and importlib.util.find_spec(SUBMITIT_PLUGIN) is None:
        raise ConfigError(
            f"hydra/launcher={choice} needs the hydra-submitit-launcher plugin, which is not installed: {SLURM_EXTRA}"
        )


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def expand(parsed: list[Any]) -> list[Member]:
    """The members Hydra's BasicSweeper makes of these parsed task overrides, in its order (= `hydra.job.num`)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return [
        Member(num, tuple(ov), tuple(o for o in ov if o.partition("=")[0] in swept)) for num, ov in enumerate(batch)
    ]


def covering(members: list[Member]) -> list[Member]:
    """Few members that between them use every swept value once: checking these catches a bad value without
    composing every combination of a large sweep (Hydra composes each member again before launching)."""
    seen: set[str] = set()
    chosen = []
    for member in members:
        if not set(member.varying) <= seen or not chosen:
            chosen.append(member)
            seen.update(member.varying)
    return chosen


def _initialized():
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from flux_trainer.config.compose import register
    from flux_trainer.config.paths import shipped_config_dir

    register()
    GlobalHydra.instance().clear()
    return initialize_config_dir(config_dir=str(shipped_config_dir()), version_base="1.3")


def parse(args: list[str]) -> tuple[list[Member], list[str]]:
    """The members Hydra's basic sweeper will make of a command line, and the line's hydra overrides.

    Raises ConfigError for a line Hydra cannot parse (e.g. `network.rank=8,,16`).
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    with _initialized():
        try:  # the config loader resolves glob(...) sweeps over a group's options
            parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
            parsed = parser.parse_overrides(args)
        except HydraException as exc:
            raise ConfigError(_one_line(exc)) from exc
    hydra_args = [o.input_line for o in parsed if o.is_hydra_override()]
    task = [o for o in parsed if not o.is_hydra_override()]
    try:
        return expand(task), hydra_args
    except HydraException:  # a sweep only another sweeper understands (e.g. optuna's interval(...)): check the rest
        return [Member(0, tuple(o.input_line for o in task if not o.is_sweep_override()), ())], hydra_args


def sweep_dir_for(overrides: list[str], search_dirs: list[Path]) -> tuple[Path, bool]:
    """(the sweep dir Hydra would use, absolute and not yet used; whether Hydra's basic sweeper runs the sweep).

    `overrides` are one member's, hydra overrides included. The caller pins the dir (`hydra.sweep.dir=...`) so
    this process finds the members' records after Hydra returns, whichever launcher ran them; `${now:...}` is
    resolved once here, as Hydra resolves it once per sweep.
    """
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from flux_trainer.config.compose import hydra_overrides

    with _initialized():
        try:
            cfg = compose("config", overrides=[*overrides, *hydra_overrides(search_dirs)], return_hydra_config=True)
            sweep_dir = Path(str(cfg.hydra.sweep.dir)).expanduser().absolute()
            sweeper = OmegaConf.to_container(cfg.hydra.sweeper, resolve=True)
        except (HydraException, OmegaConfBaseException) as exc:
            raise ConfigError(_one_line(exc)) from exc
    basic = sweeper.get("_target_") == BASIC_SWEEPER and not sweeper.get("params")
    return _fresh(sweep_dir), basic


def _fresh(sweep_dir: Path) -> Path:
    """The sweep dir, or a sibling with a suffix when a sweep started in the same second already uses it."""
    candidate, n = sweep_dir, 0
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = sweep_dir.with_name(f"{sweep_dir.name}_{n}")
    return candidate


def quote_override(value: str) -> str:
    """A value as a Hydra override token: single-quoted, so spaces, commas and `=` in a path stay one value.

    Hydra's rule for quoted values: a quote is escaped with a backslash, and backslashes are escaped only where
    they precede a quote (or the closing quote); elsewhere they are literal.
    """
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return f"'{body}'"


# ---- members' records, written by each member wherever it runs ----


def record_member(
    sweep_dir: Path, num: int, *, overrides: list[str], run_dir: Path, code: int, error: str | None = None
) -> Path:
    """Write `<sweep dir>/.members/<num>.json` (atomically: a reader never sees half a record)."""
    folder = Path(sweep_dir) / MEMBERS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "member": int(num),
        "overrides": list(overrides),
        "status": STATUS.get(code, "failed"),
        "exit_code": int(code),
        "run_dir": str(run_dir),
        "error": error,
    }
    path = folder / f"{int(num)}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


def read_records(sweep_dir: Path) -> dict[int, dict[str, Any]]:
    records = {}
    for path in sorted((Path(sweep_dir) / MEMBERS_DIR).glob("*.json")):
        try:
            record = json.loads(path.read_text())
            records[int(record["member"])] = record
        except (ValueError, KeyError, OSError):
            continue
    return records


def _metrics(run_dir: Path) -> dict[str, Any]:
    from flux_trainer.metrics.tensorboard import summarize_run

    try:
        run = summarize_run(run_dir)
    except FileNotFoundError:  # no events: a dry run, or the training never logged a step
        return {}
    return {"steps": run.steps_done, "last_loss": run.last_loss, "median_step_s": run.median_step_s}


def summarize(sweep_dir: Path, members: list[Member] | None, *, missing: str = "no result") -> list[dict[str, Any]]:
    """One row per member: its record joined with its metrics. A member without a record gets status `missing`."""
    records = read_records(sweep_dir)
    by_num = {m.num: m for m in members or []}
    rows = []
    for num in sorted(set(by_num) | set(records)):
        record, member = records.get(num), by_num.get(num)
        row: dict[str, Any] = {
            "member": num,
            "overrides": list(member.varying or member.overrides) if member else list(record["overrides"]),
            "status": missing,
            "exit_code": None,
            "run_dir": None,
            "error": None,
            "steps": None,
            "last_loss": None,
            "median_step_s": None,
        }
        if record is None:
            row["error"] = (
                "the sweep stopped before this member ran"
                if missing == "not run"
                else f"no record from this member (a submitit job's log: {Path(sweep_dir) / '.submitit'})"
            )
        else:
            run_dir = Path(record["run_dir"])
            row.update(status=record["status"], exit_code=record["exit_code"], error=record.get("error"))
            row["run_dir"] = str(run_dir) if run_dir.is_dir() else None
            if row["run_dir"] and record["exit_code"] == 0:
                row.update(_metrics(run_dir))
        rows.append(row)
    return rows


def exit_code(rows: list[dict[str, Any]]) -> int:
    """0 when every member succeeded; 2 when every failure was bad input; 1 otherwise."""
    failed = [r for r in rows if r["status"] != "ok"]
    if not rows:
        return 1
    if not failed:
        return 0
    return 2 if all(r["status"] == "bad input" for r in failed) else 1


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]], code: int) -> Path:
    path = Path(sweep_dir) / SUMMARY_FILE
    doc = {
        "sweep_dir": str(sweep_dir),
        "exit_code": code,
        "members": len(rows),
        "ok": sum(r["status"] == "ok" for r in rows),
        "failed": sum(r["status"] != "ok" for r in rows),
        "rows": rows,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def format_table(sweep_dir: Path, rows: list[dict[str, Any]]) -> str:
    """The summary printed at the end of a sweep; run dirs relative to the sweep dir, which heads the table."""
    ok = sum(r["status"] == "ok" for r in rows)
    head = ("#", "overrides", "status", "exit", "run dir", "steps", "last loss", "s/step")
    body = []
    for r in rows:
        run_dir = r["run_dir"]
        if run_dir:
            run_dir = Path(run_dir).relative_to(sweep_dir) if Path(run_dir).is_relative_to(sweep_dir) else run_dir
        body.append(
            (
                str(r["member"]),
                " ".join(r["overrides"]) or "-",
                r["status"],
                _fmt(r["exit_code"]),
                _fmt(run_dir),
                _fmt(r["steps"]),
                _fmt(r["last_loss"], ".4f"),
                _fmt(r["median_step_s"], ".3f"),
            )
        )
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    numeric = {0, 3, 5, 6, 7}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [f"sweep {sweep_dir}: {len(rows)} members, {ok} ok, {len(rows) - ok} failed", line(head)]
    out += [line(cells) for cells in body]
    out += [f"  #{r['member']}: {r['error']}" for r in rows if r["status"] != "ok" and r["error"]]
    return "\n".join(line.rstrip() for line in out)


def finish(sweep_dir: Path, members: list[Member] | None, *, interrupted: bool = False) -> int:
    """Summarise a finished (or stopped) sweep: print the table, write summary.json, return the exit code."""
    rows = summarize(sweep_dir, members, missing="not run" if interrupted else "no result")
    code = 130 if interrupted else exit_code(rows)
    print(format_table(sweep_dir, rows), flush=True)
    if Path(sweep_dir).is_dir():
        path = write_summary(sweep_dir, rows, code)
        print(f"summary: {path}\ncompare the runs: tensorboard --logdir {sweep_dir}", flush=True)
    return code
