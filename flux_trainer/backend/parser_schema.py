"""A trainer's argument parser as data, and the check every emitted key must pass (shared by both backends).

sd-scripts and musubi-tuner read their training TOML into an argparse Namespace and ignore keys the parser does not
define, and argparse does not convert or check values that arrive through a Namespace. So a misspelt key or a string
where an int belongs is silently wrong there. Each backend commits its parsers' flags (`describe_parser`) from the
pinned commit and checks every run's keys against them (`check_keys`) before anything launches.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any


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
    name = (getattr(action.type, "__name__", None) or "").lstrip("_")  # musubi-tuner's is `_int_or_float`
    if action.type is None:
        return "str"
    return {"int": "int", "float": "float", "str": "str", "Path": "path", "int_or_float": "number"}.get(name, "str")


def _choices(action: argparse.Action) -> list[Any] | None:
    if not action.choices:
        return None
    return [c for c in action.choices if c is None or isinstance(c, (str, int, float))]


_KIND_CHECK = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "path": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list) and all(isinstance(i, (str, int, float)) for i in v),
}


def check_keys(flat: dict[str, Any], flags: dict[str, dict[str, Any]], trainer: str) -> list[str]:
    """Every problem with a flattened TOML (or argument list) against a parser's flags (empty when it is clean).
    `trainer` names the program in the messages."""
    problems = []
    for key, value in flat.items():
        spec = flags.get(key)
        if spec is None:
            problems.append(f"{trainer} has no flag {key!r}; it would silently ignore it")
            continue
        if not _KIND_CHECK[spec["kind"]](value):
            problems.append(f"{trainer} flag {key!r} takes a {spec['kind']}, got {value!r}")
        elif spec["choices"] is not None and value not in spec["choices"]:
            allowed = ", ".join(str(c) for c in spec["choices"] if c is not None)
            problems.append(f"{trainer} flag {key!r} = {value!r} is not one of: {allowed}")
    return problems


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


@contextlib.contextmanager
def _capturing() -> Iterator[None]:
    saved = argparse.ArgumentParser.parse_args

    def parse_args(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = saved


def parser_of(main: Callable[[], Any]) -> argparse.ArgumentParser:
    """The parser a script's `main()` builds, taken at its first `parse_args` (so main runs nothing else): the
    caching scripts build theirs inline in main, with no function that returns it."""
    with _capturing():
        try:
            main()
        except _Captured as got:
            return got.parser
    raise RuntimeError(f"{getattr(main, '__module__', main)}.main() built no parser")
