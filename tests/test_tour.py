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


def test_the_notebook_client_really_uses_the_tours_channel(tmp_path):
    from mm3lab.tour import TourKernelManager

    assert type(TourKernelManager(kernel_name="python3").client().shell_channel).__name__ == "SlicedPollChannel"
    path = _notebook(tmp_path / "nb", "01_a.ipynb", "x = 1")
    assert execute_notebook(path)[1].channel == "SlicedPollChannel"
    assert execute_notebook(path, sliced_poll=False)[1].channel == "AsyncZMQSocketChannel"


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


# --- the lost wake-up itself, with a stand-in kernel on a real ZeroMQ socket ---------------------


def _reply_then_send(channel_cls, send, timeout):
    """A reply lands in the client's shell socket while the event loop is busy, then the client
    sends on that socket (as the notebook client does with widget state) before the loop looks
    again. Returns (message type, seconds the waiting receive took after the send)."""
    import time

    import zmq
    import zmq.asyncio
    from jupyter_client.session import Session

    async def trial():
        session = Session(key=b"test")
        actx = zmq.asyncio.Context()
        kernel = zmq.Context.instance().socket(zmq.ROUTER)
        port = kernel.bind_to_random_port("tcp://127.0.0.1")
        client = actx.socket(zmq.DEALER)
        client.connect(f"tcp://127.0.0.1:{port}")
        try:
            channel = channel_cls(client, session)
            channel.send(session.msg("execute_request", {"code": "x = 1"}))
            ident, *request = kernel.recv_multipart()
            request = session.deserialize(session.feed_identities(request)[1])
            waiting = asyncio.ensure_future(channel.get_msg(timeout=timeout))
            await asyncio.sleep(0.05)  # the receive is registered; the loop is idle
            session.send(kernel, "execute_reply", {"status": "ok"}, parent=request, ident=ident)
            time.sleep(0.2)  # noqa: ASYNC251 - the loop is busy on purpose: the reply arrives meanwhile
            send(channel, session.msg("comm_msg", {"comm_id": "w", "data": {"method": "update"}}))
            start = time.monotonic()
            msg = await waiting
            return msg["msg_type"], time.monotonic() - start
        finally:
            client.close(0)
            kernel.close(0)
            actx.term()

    return asyncio.run(trial())


def test_a_send_after_the_reply_arrived_wakes_the_waiting_receive_at_once(monkeypatch):
    monkeypatch.setattr("mm3lab.tour.POLL_SLICE_S", 3.0)  # so only the re-read after the send can wake it
    before = SlicedPollChannel.woken_after_send
    kind, waited = _reply_then_send(SlicedPollChannel, SlicedPollChannel.send, timeout=30)
    assert kind == "execute_reply" and waited < 1.0
    assert SlicedPollChannel.woken_after_send == before + 1


def test_the_sliced_poll_bounds_a_wakeup_lost_to_a_plain_send(monkeypatch):
    from jupyter_client.channels import AsyncZMQSocketChannel

    monkeypatch.setattr("mm3lab.tour.POLL_SLICE_S", 0.3)
    before = SlicedPollChannel.late_wakeups
    kind, waited = _reply_then_send(SlicedPollChannel, AsyncZMQSocketChannel.send, timeout=30)
    assert kind == "execute_reply" and waited < 1.5  # one slice, not the 30 s timeout
    assert SlicedPollChannel.late_wakeups == before + 1


def test_the_stock_channel_reads_the_reply_only_when_its_wait_times_out():
    """The defect the tour's client works around (jupyter_client 8.10, pyzmq 27.3)."""
    from jupyter_client.channels import AsyncZMQSocketChannel

    kind, waited = _reply_then_send(AsyncZMQSocketChannel, AsyncZMQSocketChannel.send, timeout=1.5)
    if waited < 0.5:
        pytest.skip("this jupyter_client / pyzmq wakes the receive after a send: the workaround is not needed")
    assert kind == "execute_reply" and waited >= 1.0  # the whole timeout, then the reply is there
