"""The sweep's one metrics step: scrape the deployment's /metrics while a run is going.

`kvbench slo scrape` (issue 13) is the scraper kvbench ships; this module only decides
how to call it. When the installed kvbench has it, the sweep runs it as a command
(`kvbench slo scrape ROLE=URL ... --duration D --out F`) and `slo analyze --metrics`
reads its file. Until then a minimal stand-in records the Prometheus text of each endpoint
every interval (JSONL: t, role, url, text or the error), keeping the lines of the
families the lab reads (KEPT) unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def slo_has_scrape() -> bool:
    return importlib.util.find_spec("kvbench.slo.scrape") is not None


def slo_supports(command: str, flag: str) -> bool:
    """Whether this kvbench's `slo COMMAND` takes FLAG (issue 13 adds --metrics, --cache-state ...)."""
    from kvbench.slo.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices.get(command)
    return sub is not None and any(flag in a.option_strings for a in sub._actions)


def endpoint_args(metrics: dict[str, list[str]]) -> list[str]:
    """ROLE=URL items, numbered when a role has several instances (roles must be unique)."""
    out = []
    for role, urls in metrics.items():
        for i, url in enumerate(urls):
            out.append(f"{role}={url}" if len(urls) == 1 else f"{role}-{i}={url}")
    return out


class Scraper:
    """Start before the run, stop after it; the file lands at `out` either way."""

    def __init__(self, metrics: dict[str, list[str]], out: Path, max_s: float, labels: dict):
        self.metrics, self.out, self.max_s, self.labels = metrics, out, max_s, labels
        self.proc: subprocess.Popen | None = None
        self.started = time.monotonic()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if slo_has_scrape():
            cmd = [sys.executable, "-m", "kvbench", "slo", "scrape", *endpoint_args(self.metrics),
                   "--interval", "1", "--duration", f"{self.max_s:.0f}", "--out", str(self.out)]
            for key, value in self.labels.items():
                cmd += [f"--{key.replace('_', '-')}", str(value)]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            self.thread = threading.Thread(target=self._raw_loop, daemon=True)
            self.thread.start()

    def stop(self) -> None:
        """Let `slo scrape` finish its bounded duration (it writes its file at the end)."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=self.max_s + 15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.thread is not None:
            self.stop_event.set()
            self.thread.join(timeout=15)

    def _raw_loop(self) -> None:
        """One sample per interval, the first at once and the last when stopped."""
        t_end = time.monotonic() + self.max_s
        with open(self.out, "w") as fh:
            fh.write(json.dumps({"header": {"scraper": "kvbench.lab.scrapeglue raw", **self.labels}}) + "\n")
            while True:
                for role, urls in self.metrics.items():
                    for url in urls:
                        fh.write(json.dumps({"t": time.time(), "role": role, "url": url,
                                             **_fetch_text(url)}) + "\n")
                fh.flush()
                if self.stop_event.is_set() or time.monotonic() >= t_end:
                    return
                self.stop_event.wait(1.0)


KEPT = ("vllm:num_requests", "vllm:kv_cache_usage_perc", "vllm:nixl_", "vllm:prompt_tokens_by_source",
        "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:num_preemptions")


def kept_lines(text: str) -> str:
    """The families the lab reads (with their HELP/TYPE lines): ~70 of ~700 lines per sample."""
    out = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") and line.count(" ") >= 2 else line
        if name.startswith(KEPT):
            out.append(line)
    return "\n".join(out) + "\n"


def _fetch_text(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return {"text": kept_lines(resp.read().decode(errors="replace"))}
    except OSError as exc:
        return {"gap": repr(exc)[:200]}
