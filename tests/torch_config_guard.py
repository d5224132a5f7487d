"""A pytest plugin: no test may leave torch's config modules changed.

torch keeps torch.compile's switches in config modules (`torch._inductor.config`, `torch._dynamo.config`,
`torch._functorch.config`, ...). They are changed only through their own `patch()` (the `torch_config` fixture in
conftest.py). Anything else can break every later test in the process: pytest's `monkeypatch.setattr` on such a
module, when undone, *deletes* the key (pytest 9.2 finds it missing from the module's `__dict__`), and every later
compile fails with "torch._inductor.config.fx_graph_cache does not exist".

Before each test's set-up this plugin reads every key of every torch config module loaded at the time (the three
above are loaded at the start of the session, where torch is installed), and again after its teardown (fixtures
undone): a key missing or a value changed is an error of that test, naming the module and the key, and the config
is put back as it was so that the tests after it are not failed by it. Loaded by conftest.py.
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.util
import sys
from typing import Any

import pytest

# loaded before the first test, so a test that imports one of them first is still compared against its state
WATCHED = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
_MISSING = object()


def config_modules() -> dict[str, Any]:
    """Every torch config module loaded in this process, by name (none where torch was never imported)."""
    cm = sys.modules.get("torch.utils._config_module")
    if cm is None:
        return {}
    kind = cm.ConfigModule
    return {name: m for name, m in list(sys.modules.items()) if isinstance(m, kind)}


def _read(module: Any, key: str) -> Any:
    """A key's value as the module would give it, read from torch's entry where it can be (a plain getattr warns
    about deprecated keys once per process, which would use up the warning the product's own read should give).
    torch 2.13 keeps an entry's override in a ContextVar, torch 2.11 as a plain value: both are read; anything
    else falls back to getattr."""
    entry = module._config[key]
    if getattr(entry, "alias", None) is not None:
        return None  # a name for another module's value (compared there); reading it warns that it is deprecated
    unset = getattr(sys.modules["torch.utils._config_module"], "_UNSET_SENTINEL", None)
    try:
        if entry.hide:
            return _MISSING
        override = entry.user_override
        if isinstance(override, contextvars.ContextVar):
            override = override.get()
        for value in (entry.env_value_force, override, entry.env_value_default):
            if value is not unset:
                return value
        return entry.default
    except AttributeError:  # an entry of another shape: ask the module
        try:
            return getattr(module, key)
        except AttributeError:
            return _MISSING


def snapshot(modules: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """module name -> {key: value}, a key that reads as missing ("does not exist") as _MISSING. Values are compared
    with ==, so the objects themselves are kept."""
    return {name: {key: _read(module, key) for key in list(module._config)} for name, module in modules.items()}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared (tensors, ...) count as changed
        return False


def differences(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """What changed between two snapshots, one line per key, for modules present in both."""
    lines = []
    for name, values in before.items():
        now = after.get(name, {})
        for key, value in values.items():
            got = now.get(key, _MISSING)
            if _same(value, got):
                continue
            if got is _MISSING:
                lines.append(f"{name}.{key} no longer exists (was {value!r})")
            elif value is _MISSING:
                lines.append(f"{name}.{key} exists again ({got!r})")
            else:
                lines.append(f"{name}.{key} changed: {value!r} -> {got!r}")
    return lines


def pytest_sessionstart(session: pytest.Session) -> None:
    if importlib.util.find_spec("torch") is None:
        return
    for name in WATCHED:
        try:
            importlib.import_module(name)
        except ImportError:  # an older or newer torch without one of them
            pass


def put_back(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> None:
    """The keys that differ between the snapshots as they were before, through torch's own load_config (which also
    brings back a deleted key)."""
    modules = config_modules()
    for name, values in before.items():
        now = after.get(name, {})
        changed = {k: v for k, v in values.items() if v is not _MISSING and not _same(v, now.get(k, _MISSING))}
        if name in modules and changed:
            modules[name].load_config(changed)


_BEFORE = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_BEFORE] = snapshot(config_modules())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield  # the test's fixtures are torn down first: `torch_config`'s patches undone, monkeypatch undone
    before = item.stash.get(_BEFORE, None)
    after = snapshot(config_modules())
    changed = [] if before is None else differences(before, after)
    if changed:
        put_back(before, after)  # the tests after this one run on torch's config as it was
        pytest.fail(
            "this test left torch's config changed (change it only through the `torch_config` fixture or the "
            "module's own patch()):\n  " + "\n  ".join(changed),
            pytrace=False,
        )
    return result
