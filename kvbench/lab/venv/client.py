"""A streaming client that keeps every chunk: the fault audit's eyes.

Runs in the lab venv (aiohttp): `python -m kvbench.lab.venv.client REQUESTS.json --endpoint URL
--out CHUNKS.jsonl`. Each request is sent at its scheduled offset (open loop), at most
`--concurrency` in flight, with `stream`, `return_token_ids` and `ignore_eos`, so every
chunk names the token ids it carries. One JSON line per request records: the schedule,
the send time, every chunk (arrival time, token ids, text, finish_reason, or the error
object the server sent), the HTTP status and how the stream ended.

Bounded on purpose: loopback endpoints only, a per-request deadline, a fixed request list.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlparse

import aiohttp

from kvbench.lab.venv.args import OneLineParser, number

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_event(line: bytes) -> dict | str | None:
    """One SSE line -> decoded JSON, the string "[DONE]", or None for blank/comment lines."""
    text = line.decode(errors="replace").strip()
    if not text.startswith("data:"):
        return None
    data = text[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return {"unparsed": data}


def chunk_record(t: float, event: dict) -> dict:
    """What the audit needs from one streamed event."""
    if "error" in event or "unparsed" in event:
        return {"t": t, "error": event.get("error", event.get("unparsed"))}
    choice = (event.get("choices") or [{}])[0] if event.get("choices") else {}
    return {"t": t, "token_ids": choice.get("token_ids") or [], "text": choice.get("text", ""),
            "finish_reason": choice.get("finish_reason"), "usage": event.get("usage")}


async def run_one(session, endpoint: str, req: dict, t0: float, deadline_s: float) -> dict:
    rec = {"id": req["id"], "scheduled_s": req["send_at_s"], "chunks": [], "status": None,
           "end": None, "done_marker": False}
    body = {"model": req["model"], "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    rec["sent_s"] = time.monotonic() - t0
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(endpoint + "/v1/completions", json=body,
                                    headers={"X-Request-Id": req["id"]}) as resp:
                rec["status"] = resp.status
                if resp.status != 200:
                    rec["error_body"] = (await resp.text())[:2000]
                    rec["end"] = "http_error"
                    return rec
                async for line in resp.content:
                    event = parse_event(line)
                    if event == "[DONE]":
                        rec["done_marker"] = True
                    elif event is not None:
                        rec["chunks"].append(chunk_record(time.monotonic() - t0, event))
        rec["end"] = "eof"
    except TimeoutError:
        rec["end"] = "timeout"
    except aiohttp.ClientError as exc:
        rec["end"] = "connection_error"
        rec["error_body"] = repr(exc)
    finally:
        rec["finished_s"] = time.monotonic() - t0
    return rec


async def run_all(endpoint: str, requests: list[dict], concurrency: int, deadline_s: float,
                  out_path: str) -> None:
    sem = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    wall0 = time.time()

    async def scheduled(session, req):
        await asyncio.sleep(max(0.0, req["send_at_s"] - (time.monotonic() - t0)))
        async with sem:
            return await run_one(session, endpoint, req, t0, deadline_s)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        results = await asyncio.gather(*(scheduled(session, r) for r in requests))
    with open(out_path, "w") as fh:
        for rec in results:
            fh.write(json.dumps({**rec, "t0_unix": wall0}) + "\n")


def parser() -> OneLineParser:
    """The module's command line (a lab test parses the lab's own call with it)."""
    p = OneLineParser(prog="python -m kvbench.lab.venv.client")
    p.add_argument("requests", help="JSON list of {id, model, prompt, max_tokens, send_at_s}")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--concurrency", type=number(int, 1, 100_000), default=16)
    p.add_argument("--deadline-s", type=number(float, 0, 1e7, lo_open=True), default=120.0)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    host = urlparse(args.endpoint).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"client: refusing non-loopback endpoint {args.endpoint}")
    with open(args.requests) as fh:
        requests = json.load(fh)
    asyncio.run(run_all(args.endpoint, requests, args.concurrency, args.deadline_s, args.out))


if __name__ == "__main__":
    main()
