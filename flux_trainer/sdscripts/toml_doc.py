"""A small TOML writer that keeps a comment beside each value.

The TOML we hand sd-scripts is also documentation for the user ("why is d_coef 1.0?"), so each key may
carry a comment. tomli_w cannot write comments; this writes the subset we need (tables, arrays of tables,
strings, numbers, booleans, arrays of scalars) and escapes every string by the TOML spec, so any user
string (quotes, backslashes, Windows paths, newlines, unicode) round-trips through tomli.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Union

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
        self.entries.append(Entry(key, value, comment))

    def plain(self) -> dict[str, Any]:
        """The table as plain Python values (what tomli reads back)."""
        out: dict[str, Any] = {}
        for e in self.entries:
            out[e.key] = (
                [i.value if isinstance(i, Item) else i for i in e.value] if isinstance(e.value, list) else e.value
            )
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
        lines = [f"# {ln}" if ln else "#" for ln in self.header.splitlines()]
        for t in self.tables:
            lines.extend(_table_lines(t, indent=""))
        return "\n".join(lines).lstrip("\n") + "\n"


def _table_lines(t: Table, indent: str) -> list[str]:
    lines = [""]
    if t.comment:
        lines.extend(f"{indent}# {ln}" for ln in t.comment.splitlines())
    lines.append(f"{indent}[[{_key_path(t.name)}]]" if t.array else f"{indent}[{_key_path(t.name)}]")
    for e in t.entries:
        lines.extend(_entry_lines(e, indent))
    for child in t.children:
        lines.extend(_table_lines(child, indent + "  "))
    return lines


def _entry_lines(e: Entry, indent: str) -> list[str]:
    key = bare_or_quoted(e.key)
    if isinstance(e.value, list) and any(isinstance(i, Item) and i.comment for i in e.value):
        out = [f"{indent}# {e.comment}"] if e.comment else []
        out.append(f"{indent}{key} = [")
        for i in e.value:
            item = i if isinstance(i, Item) else Item(i)
            out.append(f"{indent}  {format_value(item.value)},{'  # ' + item.comment if item.comment else ''}")
        out.append(f"{indent}]")
        return out
    text = f"{indent}{key} = {format_value(e.value)}"
    return [f"{text}  # {e.comment}" if e.comment else text]


def _key_path(name: str) -> str:
    return ".".join(bare_or_quoted(part) for part in name.split("."))


def bare_or_quoted(key: str) -> str:
    if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key):
        return key
    return format_string(key)


def format_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            raise ValueError(f"TOML for sd-scripts cannot hold {v}")
        return repr(v)
    if isinstance(v, str):
        return format_string(v)
    if isinstance(v, list):
        return "[" + ", ".join(format_value(i.value if isinstance(i, Item) else i) for i in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}: {v!r}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def format_string(s: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped; other unicode kept as is."""
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
