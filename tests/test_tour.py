"""The tour's waits: a cell past its timeout fails by name, the stress run reports times,
and the kernel client reads a reply even when its wake-up is lost."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("jupyter_client")  # the tour's kernel client (a GPU-only environment may lack it)

from mm3lab import cli  # noqa: E402
from mm3lab.tour import SlicedPollChannel, TourError, execute_notebook, repeat_report, repeat_tour  # noqa: E402

nbformat = pytest.importorskip("nbformat")


def _notebook(folder, name, *sources):
    folder.mkdir(exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# tiny")] + [nbformat.v4.new_code_cell(s) for s in sources]
    path = folder / name
    nbformat.write(nb, path)
    return path


def test_cell_past_its_timeout_fails_with_notebook_cell_and_advice(tmp_path):
    path = _notebook(tmp_path / "nb", "07_slow.ipynb", "x = 1", "import time\ntime.sleep(30)", "print('never')")
    with pytest.raises(TourError) as err:
        execute_notebook(path, timeout=3)
    msg = str(err.value)
    assert "07_slow.ipynb" in msg and "cell 2" in msg and "no reply within 3 s" in msg
    assert "--only 07_slow" in msg and "--timeout" in msg


def test_cli_tour_timeout_exits_1_and_says_where(tmp_path, capsys):
    _notebook(tmp_path / "nb", "08_slow.ipynb", "import time\ntime.sleep(30)")
    code = cli.main(["tour", "--notebooks", str(tmp_path / "nb"), "--out", str(tmp_path / "out"), "--timeout", "3"])
    assert code == 1
    assert "tour failed: 08_slow.ipynb: stopped at cell 1" in capsys.readouterr().err


def test_repeat_reports_min_median_max_and_longest_cell(tmp_path):
    _notebook(tmp_path / "nb", "01_a.ipynb", "x = 1", "import time\ntime.sleep(0.3)")
    lines = []
    tours = repeat_tour(2, notebooks_dir=tmp_path / "nb", echo=lines.append)
    assert len(tours) == 2 and len(lines) == 2 and lines[0].startswith("tour 1/2:")
    report = repeat_report(tours)
    assert "01_a" in report and "median" in report and "whole tour" in report
    assert "longest single cell wait" in report and "(01_a cell 2)" in report


class _Socket:
    """A socket whose first poll never wakes (a lost wake-up) but whose message is there."""

    def __init__(self):
        self.polls = []

    async def poll(self, timeout_ms):
        self.polls.append(timeout_ms)
        await asyncio.sleep(timeout_ms / 1000)
        return 1  # the state read when the wait ends finds the message


def test_sliced_poll_bounds_a_lost_wakeup_to_one_slice(monkeypatch):
    monkeypatch.setattr("mm3lab.tour.POLL_SLICE_S", 0.05)
    channel = SlicedPollChannel.__new__(SlicedPollChannel)
    channel.socket = _Socket()

    async def recv():
        return {"msg_type": "execute_reply"}

    channel._recv = recv
    before = SlicedPollChannel.late_wakeups
    msg = asyncio.run(channel.get_msg(timeout=600))
    assert msg["msg_type"] == "execute_reply"
    assert channel.socket.polls == [50]  # one 50 ms slice, not the 600 s timeout
    assert SlicedPollChannel.late_wakeups == before + 1
