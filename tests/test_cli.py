"""The ``mm3lab`` command: info and tour (on a tiny notebook made here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("jupyter_client")  # the tour's kernel client (a GPU-only environment may lack it)

from mm3lab import cli  # noqa: E402
from mm3lab.tour import run_tour  # noqa: E402


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] in ("triton", "interpret", "torch")
    for key in ("mm3lab", "python", "torch", "triton", "device", "triton_interpreter"):
        assert key in data


def test_info_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "mm3lab", "info"], capture_output=True, text=True, check=True)
    assert "backend" in out.stdout


def test_unknown_subcommand_fails():
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])


def test_tour_writes_html_and_figures(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nb_dir = tmp_path / "notebooks"
    nb_dir.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# tiny"),
        nbformat.v4.new_code_cell(
            "%matplotlib inline\nimport matplotlib.pyplot as plt\n"
            "fig, ax = plt.subplots()\nax.plot([0, 1]); print('drawn')"
        ),
    ]
    nbformat.write(nb, nb_dir / "00_tiny.ipynb")
    out = run_tour(notebooks_dir=nb_dir, out_dir=tmp_path / "out", progress=False)
    html = (out / "00_tiny.html").read_text()
    assert "drawn" in html
    assert list((out / "00_tiny").glob("figure-*.png"))
    assert "00_tiny.html" in (out / "index.html").read_text()


def test_tour_without_notebooks_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no notebooks"):
        run_tour(notebooks_dir=tmp_path / "empty", out_dir=tmp_path / "out", progress=False)
