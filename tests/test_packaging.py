"""The set-up stays honest: one dependency list, a CI that runs the README's command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower()


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _environment_pip_section() -> list[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    deps = []
    for line in lines[start + 1 :]:
        m = re.match(r"^\s{6,}- (.+)$", line)
        if not m:
            break
        deps.append(m.group(1).strip())
    return deps


def test_environment_yml_lists_the_pyproject_dependencies():
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + extras["test"] + extras["browser"]
    listed = [d for d in _environment_pip_section() if not d.startswith("-e")]
    assert sorted(listed) == sorted(wanted), "environment.yml's pip section and pyproject.toml disagree"
    assert "-e ." in _environment_pip_section(), "environment.yml must install the package itself"


def test_environment_yml_is_conda_forge_python_311():
    text = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s+- conda-forge$", text, re.M)
    assert re.search(r"^\s+- python=3\.11$", text, re.M)


def test_constraints_pin_packages_the_project_depends_on():
    deps = {_name(d) for d in _pyproject()["project"]["dependencies"]}
    pins = [line.split("==")[0] for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line]
    assert pins and set(pins) <= deps


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "python3 run.py test"
    assert command in readme and command in ci


def test_ci_runs_the_browser_check_after_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 run.py test-browser" in (ROOT / "README.md").read_text()
    assert ci.index("python3 run.py test\n") < ci.index("python3 run.py test-browser")


def test_run_py_help_lists_every_job():
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "help"], capture_output=True, text=True, check=True)
    for job in ("tour", "test", "lab", "info", "test-gpu", "test-browser"):
        assert f"run.py {job}" in out.stdout
