"""The tour names a failure of the notebook client itself (not a timeout), and a stress run
records failed notebooks and goes on."""

from __future__ import annotations

import pytest

pytest.importorskip("jupyter_client")  # the tour's kernel client (a GPU-only environment may lack it)
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from mm3lab import cli  # noqa: E402
from mm3lab.tour import TourError, execute_notebook, repeat_report, repeat_tour  # noqa: E402


def _notebook(folder, name, *sources):
    folder.mkdir(exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, folder / name)
    return folder / name


def _client_fails_at_cell(monkeypatch, index: int, exc: Exception):
    """Make the notebook client raise ``exc`` (as if from inside nbclient) once cell ``index`` ran."""
    original = nbclient.NotebookClient.async_execute_cell

    async def execute_cell(self, cell, cell_index, *args, **kwargs):
        result = await original(self, cell, cell_index, *args, **kwargs)
        if cell_index == index:
            raise exc
        return result

    monkeypatch.setattr(nbclient.NotebookClient, "async_execute_cell", execute_cell)


def test_a_client_error_is_named_with_its_origin_not_called_a_timeout(tmp_path, monkeypatch, capsys):
    path = _notebook(tmp_path / "nb", "07_x.ipynb", "x = 1", "y = 2")
    _client_fails_at_cell(monkeypatch, 1, AssertionError("hook mismatch"))
    with pytest.raises(TourError) as err:
        execute_notebook(path, timeout=30)
    msg = str(err.value)
    assert "07_x.ipynb: stopped at cell 1" in msg
    assert "the notebook client failed (AssertionError: hook mismatch; raised at test_tour_errors.py:" in msg
    assert "no reply within" not in msg and "--only 07_x" in msg
    assert "AssertionError: hook mismatch" in capsys.readouterr().err  # the whole traceback, on stderr


def test_a_stress_run_records_a_failed_notebook_and_goes_on(tmp_path, monkeypatch, capsys):
    nb_dir = tmp_path / "nb"
    _notebook(nb_dir, "01_a.ipynb", "x = 1")
    _notebook(nb_dir, "02_b.ipynb", "x = 1", "y = 2")
    _client_fails_at_cell(monkeypatch, 1, RuntimeError("lost"))  # only 02_b has a cell 1
    lines = []
    tours = repeat_tour(2, notebooks_dir=nb_dir, echo=lines.append)
    assert [[bool(r.error) for r in t] for t in tours] == [[False, True], [False, True]]
    assert sum("FAILED: 02_b.ipynb: stopped at cell 1" in line for line in lines) == 2
    report = repeat_report(tours)
    assert "failed notebook runs: 2 of 4" in report and "RuntimeError: lost" in report
    code = cli.main(["tour", "--notebooks", str(nb_dir), "--repeat", "1"])
    assert code == 1 and "failed notebook runs: 1 of 2" in capsys.readouterr().out


def test_sigterm_during_a_cell_stops_the_tour_and_names_the_signal(tmp_path):
    import os
    import signal
    import threading

    from mm3lab.tour import TourInterrupted

    _notebook(tmp_path / "nb", "05_long.ipynb", "x = 1", "import time\ntime.sleep(20)")
    timer = threading.Timer(6.0, os.kill, (os.getpid(), signal.SIGTERM))  # while cell 1 sleeps
    timer.start()
    try:
        with pytest.raises(TourInterrupted) as err:
            repeat_tour(3, notebooks_dir=tmp_path / "nb", echo=lambda line: None)
    finally:
        timer.cancel()
    assert "05_long.ipynb: SIGTERM at cell 1" in str(err.value) and "the tour stops" in str(err.value)
