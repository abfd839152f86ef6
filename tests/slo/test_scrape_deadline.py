"""`kvbench slo scrape` against an endpoint that trickles its answer (issue 25, group 1).

The planted server answers with headers and then one byte every 0.3 s, forever: every
single recv succeeds well within any per-read timeout, so only a deadline that holds
*mid-read* ends a fetch. Before the fix the scrape read 64 KiB blocks and checked its
deadline between them: it never ended and ignored SIGTERM and SIGINT. The subprocess
timeouts below are hang bounds (a fixed scrape ends in seconds), not timing assertions.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading

import pytest

from tests.conftest import ROOT, default_signals

HANG_BOUND_S = 90


class DripServer:
    """127.0.0.1 on a free port: reads the request, sends 200 headers, then a byte every 0.3 s."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self.stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def _serve(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket):
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                data = conn.recv(4096)
                if not data:
                    return
                request += data
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                             b"Content-Length: 10000000\r\n\r\n")
                self.accepted.set()
                while not self.stopped.wait(0.3):
                    conn.sendall(b"#")
            except OSError:  # the client hung up: what a bounded fetch does
                return

    def close(self):
        self.stopped.set()
        self.sock.close()


@pytest.fixture
def drip():
    server = DripServer()
    yield server
    server.close()


def scrape(url: str, out, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvbench", "slo", "scrape", f"decode={url}",
                             "--out", str(out), *extra], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_signals)


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=HANG_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"scrape still running {HANG_BOUND_S} s later: a fetch outlived its deadline")


def test_a_trickling_endpoint_is_a_gap_per_scrape_and_the_run_ends(drip, tmp_path):
    out = tmp_path / "drip.jsonl"
    stdout, stderr = finish(scrape(drip.url, out, "--interval", "1", "--duration", "2"))
    got = rows(out)
    assert [r["kind"] for r in got[1:-1]] == ["gap"] * 3, got
    assert all("not complete after 1 s" in r["error"] for r in got[1:-1])
    assert got[-1]["kind"] == "end" and got[-1]["gaps"] == 3 and not got[-1]["interrupted"]


@pytest.mark.parametrize("sig, rc, note", [(signal.SIGINT, 130, "(interrupted)"),
                                            (signal.SIGTERM, 0, "(stopped by SIGTERM)")])
def test_signals_end_a_scrape_waiting_on_a_trickle(drip, tmp_path, sig, rc, note):
    """Interval 3 s (a 3 s fetch deadline), duration an hour: the signal must be honoured while
    the fetch waits. Ctrl-C cuts the fetch at once; SIGTERM lets it end at its deadline."""
    out = tmp_path / "drip.jsonl"
    proc = scrape(drip.url, out, "--interval", "3", "--duration", "3600")
    assert drip.accepted.wait(HANG_BOUND_S), "the scrape never fetched"
    proc.send_signal(sig)
    stdout, stderr = finish(proc)
    assert proc.returncode == rc, stderr
    assert note in stdout and "Traceback" not in stderr
    end = rows(out)[-1]
    assert end["kind"] == "end" and end["interrupted"] == (sig == signal.SIGINT)
