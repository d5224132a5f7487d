"""The TOML documents handed to the trainers (sd-scripts, musubi-tuner), a comment beside each value that needs one,
written by tomlkit.

The TOML is also documentation for the user ("why is d_coef 1.0?"), so each key may carry a comment; tomli-w cannot
write comments, tomlkit can, and it escapes every string by the TOML spec, so any user string (quotes, backslashes,
Windows paths, newlines, unicode) round-trips through tomli. This module keeps the small model translate.py builds
(tables, arrays of tables, values with comments, array items with comments) and hands the writing to tomlkit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Union

import tomlkit
from tomlkit.items import Whitespace

Scalar = Union[str, int, float, bool]  # noqa: UP007 - a runtime alias, py3.10 safe either way


@dataclass
class Entry:
    key: str
    value: Any  # Scalar | list[Scalar] | list[Item]
    comment: str = ""


@dataclass
class Item:
    """An array element with its own comment (used for optimizer_args and network_args)."""

    value: Scalar
    comment: str = ""


@dataclass
class Table:
    """`[name]` with entries, or `[[name]]` (an array-of-tables element) when `array` is set."""

    name: str
    entries: list[Entry] = field(default_factory=list)
    comment: str = ""
    array: bool = False
    children: list[Table] = field(default_factory=list)

    def add(self, key: str, value: Any, comment: str = "") -> None:
        """Add a key; None means "not set" and is left out, so sd-scripts keeps its own default."""
        if value is None:
            return
        if any(e.key == key for e in self.entries):
            raise ValueError(f"duplicate TOML key {key!r} in [{self.name}]")
        _check(value)
        self.entries.append(Entry(key, value, comment))

    def plain(self) -> dict[str, Any]:
        """The table as plain Python values (what tomli reads back)."""
        out: dict[str, Any] = {}
        for e in self.entries:
            out[e.key] = [_scalar(i) for i in e.value] if isinstance(e.value, list) else e.value
        for child in self.children:
            out.setdefault(child.name.rsplit(".", 1)[-1], []).append(child.plain())
        return out


@dataclass
class Document:
    header: str = ""
    tables: list[Table] = field(default_factory=list)

    def table(self, name: str, comment: str = "", array: bool = False) -> Table:
        t = Table(name, comment=comment, array=array)
        self.tables.append(t)
        return t

    def plain(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for t in self.tables:
            if t.array:
                out.setdefault(t.name, []).append(t.plain())
            else:
                out[t.name] = t.plain()
        return out

    def flat(self) -> dict[str, Any]:
        """Every key of every non-array table in one dict: how sd-scripts reads a training TOML."""
        out: dict[str, Any] = {}
        for t in self.tables:
            if t.array:
                continue
            for k, v in t.plain().items():
                if k in out:
                    raise ValueError(f"key {k!r} appears in two tables; sd-scripts would keep only one")
                out[k] = v
        return out

    def dumps(self) -> str:
        doc = tomlkit.document()
        for line in self.header.splitlines():
            doc.add(tomlkit.comment(line))
        for t in self.tables:
            doc.add(tomlkit.nl())
            for line in t.comment.splitlines():
                doc.add(tomlkit.comment(line))
            doc.add(Whitespace(""))  # the comment sits on the table's header (tomlkit would part them by a blank line)
            if t.array:
                if t.name not in doc:
                    doc.add(t.name, tomlkit.aot())
                doc[t.name].append(_table(t))
            else:
                doc.add(t.name, _table(t))
        return tomlkit.dumps(doc).lstrip("\n")


def _scalar(v: Any) -> Scalar:
    return v.value if isinstance(v, Item) else v


def _check(value: Any) -> None:
    """The values sd-scripts' TOML may hold: strings, integers, finite floats, booleans, and lists of them."""
    for v in value if isinstance(value, list) else [value]:
        v = _scalar(v)
        if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
            raise ValueError(f"TOML for sd-scripts cannot hold {v}")
        if not isinstance(v, (str, int, float, bool)):
            raise TypeError(f"no TOML form for {type(v).__name__}: {v!r}")


def _table(t: Table) -> Any:
    out = tomlkit.table()
    for e in t.entries:
        if isinstance(e.value, list) and any(isinstance(i, Item) and i.comment for i in e.value):
            if e.comment:
                out.add(tomlkit.comment(e.comment))
            items = tomlkit.array()
            for i in e.value:
                items.add_line(_scalar(i), indent="  ", comment=(i.comment or None) if isinstance(i, Item) else None)
            items.add_line(indent="")  # the closing bracket on a line of its own
            out.add(e.key, items)
            continue
        value = tomlkit.item([_scalar(i) for i in e.value] if isinstance(e.value, list) else e.value)
        if e.comment:
            value.comment(e.comment)
            value.trivia.comment_ws = "  "  # two spaces before a comment, as code is written
        out.add(e.key, value)
    for child in t.children:
        key = child.name.rsplit(".", 1)[-1]
        if not child.array:
            out.add(key, _table(child))
            continue
        if key not in out:
            out.add(tomlkit.nl())
            out.add(key, tomlkit.aot())
        out[key].append(_table(child))
    return out
