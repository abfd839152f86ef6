"""Capture real Prometheus text from a running vLLM of every role, for tests and docs.

`kvbench lab capture-metrics --out-dir tests/data/metrics` brings up each deployment in
turn, sends a small fixed set of completions (prompts of several lengths, so the NIXL
histograms spread over buckets), and writes `vllm-<version>-<role>.txt` for the roles
aggregated, prefill and decode: the exact /metrics body, below a header of `#` comment
lines (ignored by Prometheus text parsers) that says how it was captured.
"""

from __future__ import annotations

import json
import platform
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvbench.lab.config import parse_lab
from kvbench.lab.stack import deploy
from kvbench.lab.stack import env as labenv
from kvbench.lab.stack.procs import stop_on_exit
from kvbench.records.write import write_new_file

WORDS = "import os sys json time def class return if else for in while with as try except".split()


def prompt(i: int, n_words: int) -> str:
    """A deterministic prompt of about n_words words, different for every i."""
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n_words))


def post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def send_load(endpoint: str, n: int) -> None:
    bodies = [{"model": deploy.SERVED_NAME, "prompt": prompt(i, 40 + 60 * (i % 8)), "max_tokens": 16,
               "temperature": 0, "ignore_eos": True} for i in range(n)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda b: post_json(endpoint + "/v1/completions", b), bodies))


def header(role: str, url: str, n: int) -> str:
    lines = [
        f"Real /metrics text of a vLLM {labenv.VLLM_VERSION} (CPU build) {role} instance, captured by",
        f"`kvbench lab capture-metrics --requests {n}` on {time.strftime('%Y-%m-%d', time.gmtime())}",
        f"({platform.machine()}, nixl {labenv.NIXL_VERSION}, tiny random Llama: 4 layers, 2 KV heads,",
        "head_dim 64, bf16), after n completions of 40..460 words with max_tokens 16 through the",
        f"deployment's proxy (disaggregated: NixlConnector over UCX tcp,sm,self). Source: GET {url}.",
        "Everything below the header is the response body, unchanged.",
    ]
    return "".join(f"# {ln}\n" for ln in lines)


def capture_metrics(out_dir: Path, n: int) -> int:
    cfg = parse_lab({})
    model = deploy_model(cfg)
    for name in deploy.DEPLOYMENTS:
        started: list = []
        with stop_on_exit(started):
            st = deploy.bring_up(cfg, name, model, out_dir / ".capture-logs", started)
            send_load(st.endpoint, n)
            time.sleep(2.0)  # let the engines publish their last stats interval
            for role, urls in st.metrics_endpoints.items():
                with urllib.request.urlopen(urls[0], timeout=10) as resp:
                    body = resp.read().decode()
                path = out_dir / f"vllm-{labenv.VLLM_VERSION}-{role}.txt"
                write_new_file(path, header(role, urls[0], n) + body)
                print(path)
    return 0


def deploy_model(cfg):
    from kvbench.lab.stack.deploy import model_for

    return model_for(cfg)
