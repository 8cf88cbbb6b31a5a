"""The set-up stays honest: one dependency list, a CI that runs the README's command."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower()


def _pyproject():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+ (tomllib)")
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


def _run_py():
    spec = importlib.util.spec_from_file_location("run_py", ROOT / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUN_PY = _run_py()


def _pins(name: str) -> dict:
    """The pins of a constraints file, read as the set-up reads them."""
    return RUN_PY._pins(ROOT / name)


def test_constraints_pin_packages_the_project_depends_on():
    deps = {_name(d) for d in _pyproject()["project"]["dependencies"]}
    for name in ("constraints.txt", "constraints-newest.txt"):
        pins = _pins(name)
        assert pins and set(pins) <= deps, name


def _version(v: str) -> tuple:
    return tuple(int(x) for x in v.split("."))


def test_newest_constraints_test_a_newer_triton_than_the_oldest_supported():
    oldest, newest = _pins("constraints.txt"), _pins("constraints-newest.txt")
    floor = next(d for d in _pyproject()["project"]["dependencies"] if _name(d) == "triton").split(">=")[1]
    assert oldest["triton"].startswith(floor), "constraints.txt pins the oldest Triton pyproject.toml allows"
    assert _version(newest["triton"]) > _version(oldest["triton"])
    assert newest["torch"] == oldest["torch"], "one torch for both, so that a failure is Triton's"


def test_set_up_reads_the_pins_and_asks_torch_for_its_own_triton(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# a comment == not a pin\nTorch == 2.13.0  # the CPU wheel\n\ntriton==3.6.0\n")
    assert RUN_PY._pins(constraints) == {"torch": "2.13.0", "triton": "3.6.0"}
    assert set(_pins("constraints.txt")) == {"torch", "triton"}
    # a CPU build of torch names no Triton (the pinned one stays); a CUDA build names the one it pulled in
    out = subprocess.run([sys.executable, "-c", RUN_PY._TORCH_TRITON], capture_output=True, text=True, check=True)
    torch_names_triton = any(r.startswith("triton") for r in (importlib.metadata.requires("torch") or []))
    if not torch_names_triton:
        assert out.stdout.strip() == ""
    else:
        assert out.stdout.strip() in ("", importlib.metadata.version("triton"))


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "python3 run.py test"
    assert command in readme and command in ci


def test_ci_runs_the_tests_with_the_newest_triton():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 run.py test-newest" in ci and "python3 run.py test-newest" in (ROOT / "README.md").read_text()


def test_ci_runs_the_browser_check_after_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 run.py test-browser" in (ROOT / "README.md").read_text()
    assert ci.index("python3 run.py test\n") < ci.index("python3 run.py test-browser")


def test_the_suite_hands_out_its_longest_files_first():
    """xdist's ``loadfile`` keeps the collection order only with ``--no-loadscope-reorder``; the files
    the conftest puts first exist (a renamed one would quietly fall back to its alphabetical place)."""
    import conftest

    assert all((ROOT / path).is_file() for path in conftest.LONGEST_FIRST)
    args = RUN_PY.PYTEST_ARGS
    assert args[args.index("--dist") + 1] == "loadfile" and "--no-loadscope-reorder" in args
    first, second = conftest.LONGEST_FIRST[:2]

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    ids = ["tests/test_a.py::x", "notebooks/n.ipynb::Cell 0", f"{second}::y", f"{first}::z", "tests/test_a.py::w"]
    items = [Item(i) for i in ids]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [ids[3], ids[2], ids[0], ids[1], ids[4]]


def test_the_newest_pass_leaves_the_other_gpus_compile_checks_to_test():
    assert "not other_gpus" in RUN_PY.NEWEST_PYTEST_ARGS[-1] and "other_gpus" not in " ".join(RUN_PY.PYTEST_ARGS)


def test_run_py_help_lists_every_job():
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "help"], capture_output=True, text=True, check=True)
    for job in ("tour", "test", "lab", "info", "test-gpu", "test-browser", "test-newest"):
        assert f"run.py {job}" in out.stdout


@pytest.mark.parametrize(
    "system, machine, ok",
    [
        ("linux", "x86_64", True),
        ("linux", "aarch64", True),
        ("darwin", "arm64", False),  # macOS: Triton has no wheel
        ("win32", "AMD64", False),
        ("linux", "ppc64le", False),
    ],
)
def test_the_set_up_stops_with_directions_where_triton_has_no_wheel(system, machine, ok):
    if ok:
        RUN_PY.check_platform(system, machine)
        return
    with pytest.raises(SystemExit) as info:
        RUN_PY.check_platform(system, machine)
    message = str(info.value.code)
    assert "Linux" in message and "WSL2" in message and "docker run" in message and machine in message
