"""`flux-train doctor`: say exactly why this machine's setup will fail or crawl, and how to fix it, before a
30-minute model load finds out.

    flux-train doctor [--json] [--speed] [overrides ...]     e.g. flux-train doctor +dataset=mychar model=flux_schnell

Every check gives pass / warn / fail (or skip where it does not apply), the evidence it saw and a one-line fix. Exit
code 0 when nothing fails, 1 when something does; bad overrides are bad input (ConfigError, exit 2 via the CLI).

The checks live in flat modules, one job each: `doctor_gpu` (card, driver, torch build, bf16 / fp8 matmuls),
`doctor_attention` (attention backends and flux_kernels, forward + backward against a reference), `doctor_env`
(sd-scripts checkout and dependency versions, environment variables), `doctor_models` (model files, by their
safetensors header), `doctor_disk` (cache space), `doctor_speed` (`--speed`). `fast_checks` is the subset that
runs in about a second without touching the GPU; training runs it before launching and stops on a fail.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import textwrap
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict
from itertools import zip_longest
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from flux_trainer.config.errors import ConfigError
from flux_trainer.doctor.core import FAIL, PASS, SKIP, STATUSES, WARN, CheckResult, exit_code, one_line
from flux_trainer.launch.device import DeviceInfo

__all__ = ["CheckResult", "doctor_main", "exit_code", "fast_checks", "render_json", "render_table", "run_doctor"]

USAGE = """usage: flux-train doctor [--json] [--speed] [overrides ...]

Checks the GPU, driver and PyTorch build, attention backends and flux-train's kernels, the sd-scripts checkout and
its dependencies, the model files and dataset cache space the config names, and environment variables.
  --json    print the results as JSON instead of a table
  --speed   also measure bf16 matmul TFLOP/s and one FLUX block step against what this card should reach
  overrides the same Hydra overrides as training (+dataset=NAME model=flux_schnell ...), so the files that
            run would use are the ones checked
Exit code: 0 when nothing fails, 1 when something fails."""


def _guard(check: str, group: str, fn: Callable[[], CheckResult | list[CheckResult]]) -> list[CheckResult]:
    """Run one check; a crash inside the doctor is reported as a row, never raised into training."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's per-backend UserWarnings would drown the table
            out = fn()
    except Exception as e:  # noqa: BLE001
        return [
            CheckResult(
                check,
                WARN,
                f"the check itself crashed: {one_line(e)}",
                "report this to flux-train with `FLUX_TRAIN_VERBOSE=1 flux-train doctor`",
                group,
            )
        ]
    return out if isinstance(out, list) else [out]


def fast_checks(cfg: DictConfig, info: DeviceInfo, env: Mapping[str, str] | None = None) -> list[CheckResult]:
    """What runs in about a second and touches no GPU kernel: card / driver / torch build (arch list), sd-scripts
    and its dependency versions, model files (headers only), cache disk space, environment variables.
    Training calls this before launching and stops when any row is a fail."""
    from flux_trainer.doctor import disk as doctor_disk
    from flux_trainer.doctor import env as doctor_env
    from flux_trainer.doctor import gpu as doctor_gpu
    from flux_trainer.doctor import models as doctor_models

    env = os.environ if env is None else env
    rows = _guard("gpu", "gpu", lambda: doctor_gpu.identity_checks(info))
    rows += _guard("sd-scripts", "sd-scripts", lambda: doctor_env.sd_scripts_check(cfg.get("sd_scripts"), env))
    from flux_trainer.backend import MUSUBI, backend_for

    musubi = backend_for(str(cfg.model.get("model_type", "flux"))) == MUSUBI
    rows += _guard(
        "sd-scripts deps", "sd-scripts", lambda: doctor_env.dependency_check(str(cfg.optimizer.type), musubi=musubi)
    )
    rows += _guard("models", "models", lambda: doctor_models.model_checks(cfg, info))
    rows += _guard("disk", "disk", lambda: doctor_disk.disk_check(cfg))
    rows += _guard("env", "env", lambda: doctor_env.env_checks(env, info))
    return rows


def config_check(cfg: DictConfig, info: DeviceInfo, search_dirs: list[Path] | None = None) -> CheckResult:
    """The config's own validation (flux_trainer.config.validate), minus what other rows report (model files) and
    the dataset when none was given (the doctor runs without one)."""
    from flux_trainer.config.validate import validate

    no_dataset = OmegaConf.is_missing(cfg, "dataset")
    try:
        warned = validate(cfg, family=info.family, search_dirs=search_dirs)
        problems: list[str] = []
    except ConfigError as e:
        warned, problems = [], [p for p in e.problems if not p.startswith(("no dataset:", "model."))]
    note = " (no +dataset=NAME given: dataset not checked)" if no_dataset else ""
    if problems:
        return CheckResult("config", FAIL, "; ".join(problems), "fix the overrides named above", "config")
    if warned:
        return CheckResult("config", WARN, "; ".join(warned) + note, "see the warning", "config")
    return CheckResult(
        "config", PASS, f"model={cfg.model.name} optimizer={cfg.optimizer.name} valid{note}", "", "config"
    )


def named_card_check(cfg: DictConfig, here: DeviceInfo) -> CheckResult:
    """The card `hardware=NAME` names: the tier memory=auto would pick there and the kernels it would get."""
    from flux_trainer.config.tiers import tier_for_vram
    from flux_trainer.doctor.gpu import kernels_for_card
    from flux_trainer.plan import named_card

    check = f"hardware={cfg.hardware.name}"
    try:
        named = named_card(cfg, here)
    except ConfigError as e:
        return CheckResult(check, FAIL, str(e), "name the card's card, capability and vram_gib", "gpu")
    row = kernels_for_card(named)
    tier = tier_for_vram(named.vram_gib)
    return CheckResult(check, row.status, f"memory=auto would pick {tier}; {row.evidence}",
                       row.fix, "gpu", {**row.data, "tier": tier})  # fmt: skip


def run_doctor(
    cfg: DictConfig,
    info: DeviceInfo,
    *,
    speed: bool = False,
    env: Mapping[str, str] | None = None,
    search_dirs: list[Path] | None = None,
) -> list[CheckResult]:
    """Every check, in the order of the table: GPU, attention and kernels, sd-scripts, models, disk, env, config,
    then the speed check when asked for."""
    from flux_trainer.doctor import attention as doctor_attention
    from flux_trainer.doctor import gpu as doctor_gpu
    from flux_trainer.doctor import speed as doctor_speed

    fast = fast_checks(cfg, info, env)
    gpu = [r for r in fast if r.group == "gpu"]
    rest = [r for r in fast if r.group != "gpu"]
    rows = gpu + _guard("gpu kernels", "gpu", lambda: doctor_gpu.runtime_checks(info))
    rows += _guard("attention", "attention", lambda: doctor_attention.attention_and_kernel_checks(info))
    if str(cfg.hardware.get("name", "auto")) != "auto":  # hardware=NAME: what a run on that card would get
        rows += _guard("named card", "gpu", lambda: named_card_check(cfg, info))
    rows += rest
    rows += _guard("config", "config", lambda: config_check(cfg, info, search_dirs))
    if speed:
        rows += _guard("speed", "speed", lambda: doctor_speed.speed_checks(info))
    return rows


# ---- output -----------------------------------------------------------------------------------------------------


def counts(results: list[CheckResult]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def _plain(value):
    """JSON-safe: NaN/inf become None, tuples lists, anything else unknown its str()."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def render_json(results: list[CheckResult], info: DeviceInfo, *, speed: bool = False) -> str:
    """{"ok", "exit_code", "counts", "device", "speed", "checks": [{"check", "status", "evidence", "fix", "group",
    "data"}]}: the table's rows in the same order."""
    doc = {
        "ok": exit_code(results) == 0,
        "exit_code": exit_code(results),
        "counts": counts(results),
        "device": asdict(info),
        "speed": speed,
        "checks": [r.as_dict() for r in results],
    }
    return json.dumps(_plain(doc), indent=2)


def render_table(results: list[CheckResult], info: DeviceInfo, *, speed: bool = False, width: int | None = None) -> str:
    """check | status | evidence | fix, wrapped to the terminal, then one summary line."""
    width = width or max(100, min(shutil.get_terminal_size((120, 24)).columns, 200))
    c_check = min(max((len(r.check) for r in results), default=5), 26)
    c_status = 6
    rest = width - c_check - c_status - 6
    c_evidence = max(30, int(rest * 0.6))
    c_fix = max(20, rest - c_evidence)
    header = f"{'check':<{c_check}}  {'status':<{c_status}}  {'evidence':<{c_evidence}}  fix"
    lines = [f"flux-train doctor: {info.describe()}", "", header, "-" * min(width, len(header) + c_fix - 3)]
    for r in results:
        cells = (
            textwrap.wrap(r.check, c_check) or [""],
            [r.status.upper()],
            textwrap.wrap(r.evidence, c_evidence, break_on_hyphens=False) or [""],
            textwrap.wrap(r.fix, c_fix, break_on_hyphens=False) or [""],
        )
        for a, b, c, d in zip_longest(*cells, fillvalue=""):
            lines.append(f"{a:<{c_check}}  {b:<{c_status}}  {c:<{c_evidence}}  {d}".rstrip())
    n = counts(results)
    verdict = "something fails: exit 1" if exit_code(results) else "nothing fails: exit 0"
    summary = f"{n[PASS]} pass, {n[WARN]} warn, {n[FAIL]} fail, {n[SKIP]} skip; {verdict}"
    if not speed:
        summary += " (add --speed to measure this card against what it should reach)"
    return "\n".join([*lines, "", summary])


# ---- entry point ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="flux-train doctor", add_help=False)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("-h", "--help", action="store_true")
    ns, rest = ap.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        raise ConfigError(f"doctor: unknown option {unknown[0]}; use --json, --speed and config overrides (key=value)")
    return ns, rest


def compose(overrides: list[str], search_dirs: list[Path]) -> DictConfig:
    """Compose exactly as training does (same configs, same user folders); a bad override is a ConfigError."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from flux_trainer.config.compose import compose_run

    try:
        return compose_run(overrides, search_dirs)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"doctor: {str(e).strip().splitlines()[0]}") from e


def doctor_main(argv: list[str]) -> int:
    """`flux-train doctor [--json] [--speed] [overrides...]`: print the table (or JSON); 0 if nothing fails, else 1."""
    ns, overrides = parse_args(list(argv))
    if ns.help:
        print(USAGE)
        return 0
    from flux_trainer.config.paths import user_config_dirs
    from flux_trainer.launch.device import detect_device

    search_dirs = [d for d in user_config_dirs() if d.is_dir()]
    cfg = compose(overrides, search_dirs)
    info = detect_device()
    results = run_doctor(cfg, info, speed=ns.speed, search_dirs=search_dirs)
    print(render_json(results, info, speed=ns.speed) if ns.json else render_table(results, info, speed=ns.speed))
    return exit_code(results)
