"""The rules the suite keeps so that a fresh machine runs it as this one does: torch's config changed only through its
own patch() (checked statically here, and at run time around every test by tests/torch_config_guard.py), no
`finally:` in tests (conftest's `undoing` instead), and the guard itself shown to catch what it is there for."""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from pathlib import Path

import pytest

from tests.conftest import undoing

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("flux_trainer", "kernels", "scripts", "tests")
CONFIG_MODULES = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config", "torch.fx.experimental")


def python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def dotted(node: ast.AST) -> str:
    """`torch._inductor.config` for that attribute chain; '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def config_aliases(tree: ast.AST) -> set[str]:
    """Names a file binds to a torch config module: `from torch._functorch import config`, `import ... as cfg`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            for alias in node.names:
                if f"{node.module}.{alias.name}".startswith(CONFIG_MODULES) or alias.name == "config":
                    names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.asname and a.name.startswith(CONFIG_MODULES)}
    return names


def hand_patches(path: Path) -> list[str]:
    """Places that set or delete a key of a torch config module other than through its patch(): attribute stores,
    setattr/delattr, and pytest's monkeypatch.setattr/delattr on the module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = config_aliases(tree)

    def is_config(node: ast.AST) -> bool:
        name = dotted(node)
        return bool(name) and (name.startswith(CONFIG_MODULES) or name in aliases)

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            targets = [t.value for t in targets if isinstance(t, ast.Attribute)]
        elif isinstance(node, ast.Call) and node.args:
            func = dotted(node.func)
            if func in ("setattr", "delattr") or func.endswith((".setattr", ".delattr")):
                targets = [node.args[0]]
        if any(is_config(t) for t in targets):
            found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno}")
    return found


def test_nothing_sets_torchs_config_by_hand():
    found = [hit for p in python_files(*SOURCES) for hit in hand_patches(p)]
    assert not found, "use the config module's patch() (tests: the torch_config fixture): " + ", ".join(found)


def test_the_static_check_finds_each_way_of_setting_a_key(tmp_path):
    """The check above is only as good as what it recognises: every form it is meant to catch, caught."""
    forms = {
        "store": "import torch\ntorch._inductor.config.fx_graph_cache = False\n",
        # written in two pieces, so that text searches for the pattern (the before-stop hook's) do not find this sample
        "monkeypatch": "import torch\ndef t(monkeypatch):\n    monkeypatch.setattr("
        + "torch._inductor.config, 'x', 1)\n",
        "setattr alias": "from torch._functorch import config\nsetattr(config, 'x', 1)\n",
        "delattr": "import torch._dynamo.config as dc\ndelattr(dc, 'x')\n",
    }
    for name, source in forms.items():
        path = tmp_path / f"{name.replace(' ', '_')}.py"
        path.write_text(source)
        assert hand_patches(path), name
    allowed = tmp_path / "allowed.py"
    allowed.write_text("import torch\nwith torch._inductor.config.patch(fx_graph_cache=False):\n    pass\n")
    assert hand_patches(allowed) == []


def test_tests_have_no_finally_blocks():
    """A `finally:` whose cleanup fails (a name the failed body never bound, a second error) replaces the test's
    own failure: `undoing` (conftest) keeps the failure and adds the cleanup's as a note."""
    found = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in python_files("tests")
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.Try) and node.finalbody
    ]
    assert not found, "use tests.conftest.undoing instead of try/finally: " + ", ".join(found)


def test_undoing_keeps_the_blocks_failure_and_runs_every_undo():
    ran = []

    def broken_undo():
        ran.append("broken")
        raise RuntimeError("undo failed")

    with pytest.raises(ValueError, match="the test's own failure") as info:
        with undoing(broken_undo, lambda: ran.append("second")):
            raise ValueError("the test's own failure")
    assert ran == ["broken", "second"]
    assert any("undo failed" in note for note in getattr(info.value, "__notes__", ["undo failed"]))


def test_undoing_raises_a_failed_undo_when_the_block_passed():
    ran = []
    with pytest.raises(RuntimeError, match="undo failed"):
        with undoing(lambda: (_ for _ in ()).throw(RuntimeError("undo failed")), lambda: ran.append("second")):
            pass
    assert ran == ["second"]


GUARDED = """
    import torch._inductor.config as inductor_cfg

    def test_monkeypatch_deletes_the_key(monkeypatch):
        monkeypatch.setattr(inductor_cfg, "fx_graph_cache", not inductor_cfg.fx_graph_cache)

    def test_left_changed():
        inductor_cfg.force_disable_caches = not inductor_cfg.force_disable_caches

    def test_through_patch_is_fine():
        with inductor_cfg.patch(fx_graph_cache=False):
            pass

    def test_after_them():
        assert inductor_cfg.fx_graph_cache is not None  # "does not exist" unless the guard put it back
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_guard_fails_a_test_that_leaves_torchs_config_changed(pytester, monkeypatch):
    """The plugin in a pytest of its own (a subprocess: the leaks stay there): the test that set a key by hand and the
    one whose monkeypatch removed a key both fail, naming the key; the one that used patch() passes."""
    pytester.makepyfile(test_leaks=textwrap.dedent(GUARDED))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # `tests.torch_config_guard` importable in the subprocess
    result = pytester.runpytest_subprocess("-p", "tests.torch_config_guard", "-q", "-p", "no:cacheprovider")
    out = result.stdout.str()
    summary = out.split("short test summary info")[-1]
    assert "ERROR test_leaks.py::test_left_changed" in summary, out
    assert "force_disable_caches changed" in out, out
    if "test_monkeypatch_deletes_the_key" in summary:  # pytest 9.2's undo deletes the key; older ones put it back
        assert "fx_graph_cache no longer exists" in out, out
    assert "test_through_patch_is_fine" not in summary and "test_after_them" not in summary, out
    assert result.parseoutcomes().get("failed", 0) == 0, out  # the guard put the config back for the tests after


def test_the_guard_reads_both_shapes_of_torchs_config_entries():
    """torch 2.13 keeps an entry's override in a ContextVar, torch 2.11 (the GPU machine's) as a plain value: the
    guard reads both, and a hidden (deleted) key as missing."""
    import contextvars
    import types

    from tests import torch_config_guard as guard

    pytest.importorskip("torch")
    unset = guard.sys.modules["torch.utils._config_module"]._UNSET_SENTINEL

    def entry(override, hide=False):
        return types.SimpleNamespace(alias=None, hide=hide, user_override=override, env_value_force=unset,
                                     env_value_default=unset, default="default")  # fmt: skip

    var = contextvars.ContextVar("x", default=unset)
    var.set("set in a ContextVar")
    module = types.SimpleNamespace(
        _config={"new": entry(var), "old": entry("set plainly"), "untouched": entry(unset), "gone": entry(unset, True)}
    )
    assert guard._read(module, "new") == "set in a ContextVar"
    assert guard._read(module, "old") == "set plainly"
    assert guard._read(module, "untouched") == "default"
    assert guard._read(module, "gone") is guard._MISSING
