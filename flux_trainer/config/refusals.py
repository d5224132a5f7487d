"""What composition refused, said the way a user can act on it: one line with the fix.

Hydra's own messages name the problem in its terms (`LexerNoViableAltException`, "Could not override 'network.rnak'",
"Could not find 'dataset/'", a YAML scanner traceback). These functions turn each into a sentence that says what is
wrong with which override or file and what to type instead: the closest valid key, the options that exist, how to
quote, the file and line. Pure functions of the exception and the schema; the CLI raises the result as ConfigError.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any

OUTPUT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def output_name_problem(name: Any) -> str | None:
    """Why `train.output_name` cannot name a run's folder and files (None: it can). It is a plain name: no path
    separator, no '..', no control or shell-special characters, so the run stays under the runs root."""
    text = str(name)
    if OUTPUT_NAME.fullmatch(text) and ".." not in text:
        return None
    return (
        f"train.output_name={text!r}: a plain name is needed (letters, digits, '.', '_', '-'; no '/', no '..', at "
        "most 100 characters), since it names the run's folder under the runs root and its files; "
        "e.g. train.output_name=mychar_v2"
    )


def schema_keys(schema: type) -> dict[str, Any]:
    """The key tree of a dataclass schema: field -> sub-tree (a nested dataclass) or None (a leaf, or a free-form
    dict/Any whose keys are the user's)."""
    tree: dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints.get(f.name)
        tree[f.name] = schema_keys(hint) if dataclasses.is_dataclass(hint) else None
    return tree


def free_form(schema: type, path: list[str]) -> bool:
    """Whether the key at `path` holds the user's own keys (a dict or Any field: optimizer.args, model.hub ...)."""
    node: Any = schema
    for part in path:
        if not dataclasses.is_dataclass(node):
            return True
        hints = typing.get_type_hints(node)
        node = hints.get(part)
        if node is None:
            return False
    return not dataclasses.is_dataclass(node)


def all_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, sub in tree.items():
        out.append(prefix + key)
        if sub:
            out.extend(all_keys(sub, f"{prefix}{key}."))
    return out


def unknown_key_message(key: str, tree: dict[str, Any]) -> str:
    """`network.rnak: no such key; did you mean network.rank?`, with the keys of its section when nothing is close."""
    parts = key.split(".")
    node, known = tree, []
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            section = ".".join(parts[:i])
            siblings = [f"{section}.{k}" if section else k for k in (node or {})]
            break
        known.append(part)
        node = node[part]
    else:
        return f"{key}: no such key"
    candidates = all_keys(tree)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6) or difflib.get_close_matches(
        key, siblings, n=1, cutoff=0.4
    )
    hint = f"; did you mean {close[0]}?" if close else ""
    listing = f" ({section} has: {', '.join(s.rsplit('.', 1)[-1] for s in siblings)})" if section and not close else ""
    if not close and not section:
        listing = f" (top-level keys and groups: {', '.join(sorted(tree))})"
    return f"{key}: no such key{hint}{listing}"


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def explain_composition_error(exc: BaseException, overrides: list[str], tree: dict[str, Any]) -> str:
    """One sentence for a Hydra / OmegaConf error raised while composing `overrides` (not the missing-file kind,
    which the CLI answers with the options that exist)."""
    text = str(exc)
    cause = exc.__cause__
    if type(exc).__name__ == "OverrideParseException":
        bad = next((o for o in overrides if o in text), None) or _first_line(text)
        return (
            f"cannot read the override {bad!r}: Hydra's syntax is KEY=VALUE; a value with spaces, quotes or "
            "characters such as = , [ ] { } ( ) needs quoting for Hydra inside the shell's quotes, e.g. "
            "'train.output_name=\"my run\"'; a list is key=[a,b]"
        )
    if m := re.search(r"Could not override '([^']+)'", text):
        return unknown_key_message(m.group(1), tree)
    if m := re.search(r"Could not append to config. An item is already at '([^']+)'", text):
        return f"+{m.group(1)}: that key exists already; set it without the '+': {m.group(1)}=VALUE"
    if text.startswith("Error merging override") and cause is not None:
        key = text.removeprefix("Error merging override").strip().split("=", 1)[0]
        reason = _first_line(cause)
        if m := re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", reason):
            return f"{key}={m.group(1)}: must be {'an' if m.group(2)[0] in 'AEIOU' else 'a'} {m.group(2).lower()}"
        return f"{key}: {reason}"
    if cause is not None and type(cause).__name__ in ("ConfigKeyError", "ConfigAttributeError"):
        if m := re.search(r"full_key: ([\w.]+)", str(cause)):
            return unknown_key_message(m.group(1), tree)
    return _first_line(text)


def yaml_problem(exc: BaseException, where: Path | None = None) -> str:
    """A YAML syntax error as `FILE:LINE: what`, from the error's own position (1-based as editors count)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    name = getattr(mark, "name", None)
    path = Path(name) if name and not str(name).startswith("<") else where
    line = f":{mark.line + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or _first_line(exc)
    context = getattr(exc, "context", None)
    what = f"{context}, {problem}" if context else problem
    return f"{path or 'a config file'}{line}: YAML syntax error: {what}; fix the file (a value with ':' needs quotes)"


def find_yaml_error(overrides: list[str], search_dirs: list[Path], groups: dict[str, str]) -> str | None:
    """Which of the user's config files picked by `overrides` does not parse as YAML (a message), or None.
    `groups`: group -> option, as the overrides choose them (+dataset=mychar -> dataset: mychar)."""
    import yaml

    for group, option in groups.items():
        for root in search_dirs:
            path = Path(root) / group / f"{option}.yaml"
            if not path.is_file():
                continue
            try:
                yaml.safe_load(path.read_text(encoding="utf-8"))
            except yaml.YAMLError as exc:
                return yaml_problem(exc, path)
            except UnicodeDecodeError as exc:
                return f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
    return None


def chosen_groups(overrides: list[str]) -> dict[str, str]:
    """group -> option for overrides of the form [+]group=option with a plain option name."""
    out = {}
    for o in overrides:
        m = re.fullmatch(r"\+?\+?([a-z_]+)=([\w.-]+)", o)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def missing_keys_message(missing: list[str], dataset_file: Path | None) -> str:
    """Mandatory keys left without a value after composition: the dataset file's keys named with the file."""
    dataset = sorted(k.removeprefix("dataset.") for k in missing if k.startswith("dataset."))
    other = sorted(k for k in missing if not k.startswith("dataset."))
    parts = []
    if dataset:
        where = f" in {dataset_file}" if dataset_file else ""
        fixes = {"images": "images: /path/to/your/images (or subsets: a list of folders)", "name": "name: mychar"}
        example = "; ".join(fixes.get(k, f"{k}: VALUE") for k in dataset)
        parts.append(f"the dataset file is missing {', '.join(dataset)}{where}: add {example}")
    if other:
        parts.append(f"no value for {', '.join(other)}: set {other[0]}=VALUE")
    return "; ".join(parts)


def unknown_added_keys(cfg: Any, schema: type) -> list[str]:
    """Keys in a composed config that the schema does not have (`+network.rnak=8` composes: Hydra lets '+' add keys
    to a dataclass node). Free-form sections (dicts, Any) are the user's and are not checked."""
    from omegaconf import DictConfig

    found: list[str] = []

    def walk(node: Any, path: list[str]) -> None:
        if not isinstance(node, DictConfig) or free_form(schema, path):
            return
        tree = schema_keys(_schema_at(schema, path))
        for key in node.keys():
            key = str(key)
            if key not in tree:
                found.append(".".join([*path, key]))
            else:
                walk(node._get_node(key), [*path, key])

    walk(cfg, [])
    return found


def _schema_at(schema: type, path: list[str]) -> type:
    node: Any = schema
    for part in path:
        node = typing.get_type_hints(node)[part]
    return node


def interpolation_problem(exc: BaseException) -> str:
    """An interpolation that resolves to nothing (`${oops}`, an unset `${oc.env:VAR}`, an unknown resolver), named
    by its key: OmegaConf reads `${...}` in any value, the command line's and a dataset YAML's alike."""
    key = getattr(exc, "full_key", None) or "a value"
    why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"{key}: {why}; `${{...}}` in a value refers to another key (e.g. ${{dataset.name}}) or a resolver "
        "(${oc.env:VAR}); name one that exists, or write the value without `${`"
    )
