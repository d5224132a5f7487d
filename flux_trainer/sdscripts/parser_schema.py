"""The committed schema of sd-scripts' FLUX LoRA parser, and the check every run's TOML must pass.

sd-scripts reads its training TOML into an argparse Namespace and ignores keys its parser does not define,
and argparse does not convert or check values that arrive through a Namespace. So a misspelt key or a
string where an int belongs is silently wrong there. We check both here, before anything launches.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("parser_schema.json")


def describe_parser(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """flag -> {kind, choices}: what a TOML value for that flag must be."""
    flags: dict[str, dict[str, Any]] = {}
    for action in parser._actions:  # argparse has no public accessor for its actions
        if action.dest in ("help", argparse.SUPPRESS):
            continue
        flags[action.dest] = {"kind": _kind(action), "choices": _choices(action)}
    return flags


def _kind(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "bool"
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        return "list"
    name = getattr(action.type, "__name__", None)
    if action.type is None:
        return "str"
    return {"int": "int", "float": "float", "str": "str", "Path": "path", "int_or_float": "number"}.get(name, "str")


def _choices(action: argparse.Action) -> list[Any] | None:
    if not action.choices:
        return None
    return [c for c in action.choices if c is None or isinstance(c, (str, int, float))]


def load_schema(path: Path = SCHEMA_PATH) -> dict[str, Any]:
    return json.loads(path.read_text())


_KIND_CHECK = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "path": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list) and all(isinstance(i, (str, int, float)) for i in v),
}


def check_training_keys(flat: dict[str, Any], flags: dict[str, dict[str, Any]]) -> list[str]:
    """Every problem with a flattened training TOML against the parser's flags (empty when it is clean)."""
    problems = []
    for key, value in flat.items():
        spec = flags.get(key)
        if spec is None:
            problems.append(f"sd-scripts has no flag {key!r}; it would silently ignore it")
            continue
        if not _KIND_CHECK[spec["kind"]](value):
            problems.append(f"sd-scripts flag {key!r} takes a {spec['kind']}, got {value!r}")
        elif spec["choices"] is not None and value not in spec["choices"]:
            allowed = ", ".join(str(c) for c in spec["choices"] if c is not None)
            problems.append(f"sd-scripts flag {key!r} = {value!r} is not one of: {allowed}")
    return problems
