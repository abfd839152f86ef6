"""`kvbench slo scrape`: timestamped samples of serving engines' Prometheus `/metrics`.

    kvbench slo scrape prefill=http://127.0.0.1:18011/metrics decode=http://127.0.0.1:18012/metrics \\
        --interval 1 --duration 120 --out run.metrics.jsonl

Each endpoint is labelled by its role (prefill, decode, aggregated, or any name). Every
`--interval` seconds all endpoints are fetched at once, each response is parsed by the
`prometheus-client` library's text parser, and the samples of the metrics kvbench reads
(docs/slo.md; `--all-metrics` keeps every sample) are written as one JSON line:

    {"kind": "header", "schema": "kvbench.slo.metrics/1", "endpoints": [...], ...}
    {"kind": "sample", "role": "decode", "url": ..., "t_s": 1.002, "elapsed_ms": 3.1,
     "samples": {"vllm:num_requests_waiting": [[{"engine": "0", ...}, 2.0]], ...}}
    {"kind": "gap", "role": "prefill", "url": ..., "t_s": 2.001, "error": "connection refused"}
    {"kind": "end", "t_s": 120.0, "scrapes": 240, "gaps": 1, "interrupted": false}

`t_s` is seconds since the first scrape on one monotonic clock; the header has the wall
time it started. The run is bounded: it stops after `--duration`, or at once after one
last scrape when it receives SIGTERM (the end line then says `"stopped": "SIGTERM"`: a
caller ending the scrape with its load, not an interruption), no fetch outlives its
timeout (at most the interval, 10 s at most) even when the endpoint trickles its answer a
byte at a time (a timer cuts the socket mid-read), Ctrl-C ends the fetches in progress at
once (exit 130, what was scraped is kept), and a response larger than 32 MiB is a gap.
Fetches are plain HTTP GETs (`http.client`): no proxy, no redirect. An endpoint
that fails, hangs or stops answering is a gap and the run goes on. The file appears at
`--out` only when the run ends (atomically; an existing file is never replaced).
"""

from __future__ import annotations

import http.client
import math
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvbench.cli import UsageError, stop_signal_handled
from kvbench.records.schema.slo import SCHEMA_METRICS, ScrapeHeader
from kvbench.records.write import as_contract, check_new_file, dumps_json, new_file_stream

MAX_RESPONSE_BYTES = 32 * 2**20
_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created", "_info")


@dataclass(frozen=True)
class Endpoint:
    role: str
    url: str


def parse_endpoint(text: str) -> Endpoint:
    """ROLE=URL; the role labels the samples (prefill, decode, aggregated, ...)."""
    role, sep, url = text.partition("=")
    if not sep or not role or not url.startswith(("http://", "https://")):
        raise UsageError(f"endpoint {text!r}: expected ROLE=http://HOST:PORT/metrics "
                         "(e.g. decode=http://127.0.0.1:18012/metrics)")
    return Endpoint(role, url)


def family_of(sample_name: str, families: set[str]) -> str | None:
    for suffix in _SUFFIXES:
        if suffix and not sample_name.endswith(suffix):
            continue
        base = sample_name[: len(sample_name) - len(suffix)] if suffix else sample_name
        if base in families:
            return base
    return None


def parse_metrics_text(text: str, keep: Callable[[str], bool]) -> dict[str, list]:
    """Samples by name, [[labels, value], ...], parsed by prometheus-client's text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if keep(s.name):
                out.setdefault(s.name, []).append([dict(s.labels), _json_value(s.value)])
    return out


def _json_value(v: float) -> float | str:
    """A sample value as JSON can hold it: NaN and infinities in Prometheus' own spelling."""
    if math.isfinite(v):
        return v
    return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")


class Fetches:
    """The connections of the fetches in progress, so a deadline or Ctrl-C can cut them mid-read.

    Why: a socket timeout bounds each recv, not a response; an endpoint that sends one byte
    every 0.3 s passes every per-read timeout forever. Shutting the socket down from another
    thread ends a recv at once, whatever the fetch is doing (headers, body, TLS).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._live: set[http.client.HTTPConnection] = set()
        self.closed = False

    def add(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if self.closed:
                raise InterruptedError("the scrape is stopping")
            self._live.add(conn)

    def discard(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._live.discard(conn)

    def cut(self, conn: http.client.HTTPConnection) -> None:
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the fetch itself

    def cut_all(self) -> None:
        """End every fetch in progress now (Ctrl-C): each returns an error at once."""
        with self._lock:
            self.closed = True
            live = list(self._live)
        for conn in live:
            self.cut(conn)


class HTTPStatusError(Exception):
    """A response that is not 200 OK."""


def _fetch(url: str, timeout_s: float, fetches: Fetches | None = None) -> str:
    """The body of GET url, bounded in time and size; any failure is an exception.

    Connecting is bounded by the socket timeout; once connected, a timer cuts the socket at
    the deadline, so a response that trickles in (headers or body) ends at timeout_s too.
    """
    fetches = fetches or Fetches()
    conn = _connection(url, timeout_s)
    cut = threading.Event()
    timer = threading.Timer(timeout_s, lambda: (cut.set(), fetches.cut(conn)))
    timer.daemon = True
    try:
        fetches.add(conn)
        timer.start()
        try:
            conn.connect()  # each step bounded by the socket timeout; the timer cuts a slow handshake
            if cut.is_set():  # the deadline passed before the socket existed to be cut
                raise TimeoutError
            body = _get(conn, url)
            if cut.is_set():  # a cut socket reads as the end of the body
                raise TimeoutError
            return body
        except (OSError, http.client.HTTPException):
            if cut.is_set():
                raise TimeoutError(f"response not complete after {timeout_s:g} s") from None
            raise
    finally:
        timer.cancel()
        fetches.discard(conn)
        conn.close()


def _connection(url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        return cls(parts.hostname or "", parts.port, timeout=timeout_s)
    except ValueError as exc:  # a port that is not a number
        raise ValueError(f"bad URL {url!r}: {exc}") from None


def _get(conn: http.client.HTTPConnection, url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn.request("GET", path, headers={"Accept": "text/plain", "Connection": "close"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise HTTPStatusError(f"HTTP {resp.status} {resp.reason}")
    chunks, size = [], 0
    while chunk := resp.read1(65536):  # returns what one recv brought: never waits to fill 64 KiB
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise ValueError(f"response larger than {MAX_RESPONSE_BYTES // 2**20} MiB")
        chunks.append(chunk)
    if resp.length:  # the connection ended before Content-Length bytes came
        raise http.client.IncompleteRead(b"", resp.length)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0]


def scrape_once(ep: Endpoint, t0: float, timeout_s: float, keep: Callable[[str], bool],
                fetches: Fetches | None = None) -> dict:
    """One line of the file: a sample, or a gap saying why there is none."""
    start = time.monotonic()
    base = {"role": ep.role, "url": ep.url, "t_s": round(start - t0, 6)}
    try:
        samples = parse_metrics_text(_fetch(ep.url, timeout_s, fetches), keep)
    except Exception as exc:  # any failure of one endpoint is a gap, never the end of the run
        return {"kind": "gap", **base, "error": _error_text(exc)}
    return {"kind": "sample", **base, "elapsed_ms": round((time.monotonic() - start) * 1000, 3),
            "samples": samples}


def run_scrape(endpoints: Sequence[Endpoint], interval_s: float, duration_s: float, out: Path,
               keep: Callable[[str], bool], header: dict, progress=sys.stderr) -> dict:
    """Scrape until duration_s (or SIGTERM); write the file atomically at out; return the end record."""
    out = check_new_file(out)
    timeout_s = min(interval_s, 10.0)
    counts = {"scrapes": 0, "gaps": 0}
    t0 = time.monotonic()
    with _stop_on_sigterm() as stop, new_file_stream(out) as fh, \
            ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
        head = {"kind": "header", "schema": SCHEMA_METRICS, "started_unix": time.time(), **header}
        as_contract(ScrapeHeader, head, "the scrape's header")
        fh.write(dumps_json(head, indent=None) + "\n")

        def scrape_all(fetches: Fetches) -> list[dict]:
            return list(pool.map(lambda ep: scrape_once(ep, t0, timeout_s, keep, fetches), endpoints))

        end = _loop(scrape_all, interval_s, duration_s, t0, fh, counts, progress, stop)
        fh.write(dumps_json(end, indent=None) + "\n")
    return end


@contextmanager
def _stop_on_sigterm():
    """A flag SIGTERM sets: a caller (e.g. `kvbench sweep`, when its load ends) stops the scrape
    early and cleanly. Only the main thread can take a signal; elsewhere the flag stays unset."""
    stop = [False]
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        stop[0] = True

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, old)


def _sleep_until(due: float, stop: list[bool]) -> bool:
    """Sleep until the monotonic time due; True at once when SIGTERM asked to stop."""
    while not stop[0] and (left := due - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))
    return stop[0]


def _loop(scrape_all, interval_s, duration_s, t0, fh, counts, progress, stop) -> dict:
    """Scrape every interval until the duration, SIGTERM (one last reading) or Ctrl-C (at once)."""
    tick, interrupted, last_note, final = 0, False, t0, False
    fetches = Fetches()
    try:
        while True:
            due = t0 + tick * interval_s
            if due - t0 > duration_s + 1e-9:
                break
            final = _sleep_until(due, stop)  # asked to stop: one last reading, taken now
            for line in scrape_all(fetches):
                counts["scrapes" if line["kind"] == "sample" else "gaps"] += 1
                fh.write(dumps_json(line, indent=None) + "\n")
            fh.flush()
            tick += 1
            if final:
                break
            if progress is not None and time.monotonic() - last_note >= 10.0:
                last_note = time.monotonic()
                print(f"kvbench slo scrape: {last_note - t0:.0f}/{duration_s:g} s, "
                      f"{counts['scrapes']} samples, {counts['gaps']} gaps", file=progress, flush=True)
    except KeyboardInterrupt:  # keep what was scraped: the file says it was cut short
        stop_signal_handled()
        fetches.cut_all()  # the fetches in progress end now, so the pool's threads can be joined
        interrupted = True
    end = {"kind": "end", "t_s": round(time.monotonic() - t0, 6), **counts, "interrupted": interrupted}
    return {**end, "stopped": "SIGTERM"} if final else end
