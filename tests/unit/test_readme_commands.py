"""README's two set-up commands are what CI runs, and the packages they install are bounded: the test tools pinned
exactly, every runtime dependency with an upper bound at the newest release tested."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomli

ROOT = Path(__file__).resolve().parents[2]


def readme_command(name: str) -> str:
    spec = importlib.util.spec_from_file_location("readme_command", ROOT / ".ci" / "readme_command.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.command(name, (ROOT / "README.md").read_text(encoding="utf-8"))


def requirements(group: str | None = None) -> list[str]:
    project = tomli.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return project["dependencies"] if group is None else project["optional-dependencies"][group]


def test_the_test_command_installs_the_test_extra_and_runs_pytest():
    command = readme_command("test")
    assert "pip install torch==2.13.0" in command  # the CPU build on disk, first: nothing pulls CUDA wheels
    assert re.search(r'pip install "\.\[[^\]]*\btest\b[^\]]*\]"', command), command
    assert "pytest" in command and "ruff check" in command


def test_the_demo_command_installs_and_runs_the_demo():
    command = readme_command("demo")
    assert command.startswith("pip install torch==2.13.0") and command.endswith("flux-train demo")


def test_ci_runs_readmes_test_command_in_a_new_virtual_environment():
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m venv" in script and "mktemp -d" in script
    assert ".ci/readme_command.py test" in script
    assert f"command='{readme_command('test')}'" in script  # the copy CI compares README's command with


def test_the_extractor_prints_the_command_and_refuses_a_readme_without_it(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_command.py"), "test"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == readme_command("test")
    spec = importlib.util.spec_from_file_location("rc", ROOT / ".ci" / "readme_command.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit, match="no `<!-- command: test -->` marker"):
        module.command("test", "# a README\n```bash\npytest\n```\n")
    with pytest.raises(SystemExit, match="must be one line"):
        module.command("test", "<!-- command: test -->\n```bash\npip install .\npytest\n```\n")


def test_test_tools_are_pinned_exactly():
    loose = [r for r in requirements("test") if not re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][^,;<>=!~ ]*", r)]
    assert not loose, f"pin these exactly (==): {loose}"


def test_every_runtime_dependency_has_an_upper_bound():
    unbounded = [r for r in requirements() if "==" not in r and "<" not in r]
    assert not unbounded, f"bound these to the newest release tested (<): {unbounded}"


def test_every_package_folder_is_installed():
    """A folder with an __init__.py that pyproject's package list forgets works in a checkout and is missing from
    an installed flux-train: every such folder is listed, and every listed package is a folder."""
    tool = tomli.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed, dirs = set(tool["packages"]), tool["package-dir"]

    def folder(package: str) -> Path:
        top = max((d for d in dirs if package == d or package.startswith(d + ".")), key=len)
        return ROOT / dirs[top] / Path(*package[len(top) :].strip(".").split(".") if package != top else ())

    found = {
        ".".join((name, *init.parent.relative_to(ROOT / dirs[name]).parts))
        for name in ("flux_trainer", "flux_kernels")
        for init in (ROOT / dirs[name]).rglob("__init__.py")
    }
    assert found - listed == set(), "packages missing from pyproject's list"
    assert [p for p in listed if not folder(p).is_dir()] == []
