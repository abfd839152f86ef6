"""The two front doors of the lab: a round-robin proxy and the prefill/decode (P/D) proxy.

Both run in the lab's venv (`python -m kvbench.lab.venv.proxy ...`, aiohttp) and stream the
answer back chunk by chunk, so the client measures TTFT/ITL through the same kind of
hop in both deployments (one proxy each: a fair comparison).

P/D protocol (vLLM's NixlConnector, pull mode): send the request to a prefill instance
with `max_tokens=1`, `stream=false` and `kv_transfer_params={"do_remote_decode": true}`;
its answer carries `kv_transfer_params` (engine id, block ids, side-channel host/port);
send the original request with those params to a decode instance, which pulls the KV
over NIXL and streams the completion back.

Fault hooks (used by `kvbench faults`, idle otherwise): `POST /kvbench/hold {"count": n}`
makes the next n requests wait after prefill answered and before decode is asked;
`GET /kvbench/held` lists them with their params; `POST /kvbench/release
{"id": ..., "patch": {...}}` lets one go on, optionally with patched params. Every
request's steps go to an events JSONL file (`--events`) for the audit.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid

from aiohttp import ClientOSError, ClientSession, ClientTimeout, ServerDisconnectedError, web

from kvbench.lab.venv.args import OneLineParser, number

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


class Events:
    """Append-only JSONL of per-request steps; flushed per line so a crash loses nothing."""

    def __init__(self, path: str | None):
        self.f = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def log(self, rid: str, step: str, **kw) -> None:
        if self.f:
            self.f.write(json.dumps({"t": time.time(), "id": rid, "step": step, **kw}) + "\n")


class Proxy:
    def __init__(self, args):
        self.prefill = itertools.cycle(args.prefill or [])
        self.decode = itertools.cycle(args.decode or [])
        self.backends = itertools.cycle(args.backend or [])
        self.events = Events(args.events)
        self.session: ClientSession | None = None
        self.hold_count = 0
        self.held: dict[str, dict] = {}

    async def start(self, app):
        self.session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10))

    async def close(self, app):
        await self.session.close()

    async def stream_back(self, request, upstream) -> web.StreamResponse:
        """Copy the upstream answer (streamed or not) to the client as it arrives."""
        resp = web.StreamResponse(status=upstream.status)
        resp.content_type = upstream.content_type
        await resp.prepare(request)
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def round_robin(self, request: web.Request) -> web.StreamResponse:
        url = next(self.backends) + request.path_qs
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with self.session.request(request.method, url, data=body, headers=headers) as up:
            return await self.stream_back(request, up)

    async def run_prefill(self, rid: str, path: str, body: dict) -> tuple[int, dict | str]:
        """Prefill with max_tokens=1; one retry when a pooled connection was closed under us.

        The retry covers the keep-alive race (the server closes an idle connection just
        as we reuse it: reset or disconnect before any response byte). It is logged as a
        second prefill_sent, so the audit counts it as the request's one retry.
        """
        req = dict(body, stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        req.pop("stream_options", None)
        url = next(self.prefill)
        for attempt in (1, 2):
            self.events.log(rid, "prefill_sent", url=url, attempt=attempt)
            try:
                async with self.session.post(url + path, json=req, headers={"X-Request-Id": rid}) as up:
                    text = await up.text()
                break
            except (ServerDisconnectedError, ClientOSError) as exc:
                if attempt == 2:
                    raise
                self.events.log(rid, "prefill_retry", error=repr(exc))
        self.events.log(rid, "prefill_done", status=up.status)
        if up.status != 200:
            return up.status, text
        return 200, json.loads(text).get("kv_transfer_params") or {}

    async def maybe_hold(self, rid: str, params: dict) -> dict:
        """Wait here while a fault injection has asked to hold this request."""
        if self.hold_count <= 0:
            return params
        self.hold_count -= 1
        gate = {"params": params, "event": asyncio.Event(), "patch": {}, "since": time.time()}
        self.held[rid] = gate
        self.events.log(rid, "held", params=params)
        await gate["event"].wait()
        self.held.pop(rid, None)
        params = {**params, **gate["patch"]}
        self.events.log(rid, "released", patch=gate["patch"])
        return params

    async def pd(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id") or f"kvb-{uuid.uuid4().hex[:16]}"
        try:
            status, params = await self.run_prefill(rid, request.path, body)
        except Exception as exc:  # prefill unreachable: one clean error to the client
            self.events.log(rid, "prefill_error", error=repr(exc))
            return web.json_response({"error": f"prefill unreachable: {exc!r}"}, status=502)
        if status != 200:
            return web.Response(status=status, text=params, content_type="application/json")
        params = await self.maybe_hold(rid, params)
        url = next(self.decode)
        self.events.log(rid, "decode_sent", url=url)
        try:
            async with self.session.post(url + request.path, json=dict(body, kv_transfer_params=params),
                                         headers={"X-Request-Id": rid}) as up:
                resp = await self.stream_back(request, up)
            self.events.log(rid, "decode_done", status=up.status)
            return resp
        except Exception as exc:
            self.events.log(rid, "decode_error", error=repr(exc))
            raise

    async def hold(self, request):
        self.hold_count = int((await request.json()).get("count", 1))
        return web.json_response({"hold_count": self.hold_count})

    async def list_held(self, request):
        return web.json_response({rid: {"params": g["params"], "since": g["since"]}
                                  for rid, g in self.held.items()})

    async def release(self, request):
        data = await request.json()
        ids = list(self.held) if data.get("id") in (None, "all") else [data["id"]]
        for rid in ids:
            if rid in self.held:
                self.held[rid]["patch"] = data.get("patch") or {}
                self.held[rid]["event"].set()
        return web.json_response({"released": ids})

    async def health(self, request):
        return web.json_response({"ok": True})


def build_app(args) -> web.Application:
    proxy = Proxy(args)
    app = web.Application(client_max_size=64 * 2**20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.close)
    app.router.add_get("/health", proxy.health)
    app.router.add_post("/kvbench/hold", proxy.hold)
    app.router.add_get("/kvbench/held", proxy.list_held)
    app.router.add_post("/kvbench/release", proxy.release)
    if args.mode == "pd":
        for path in COMPLETION_PATHS:
            app.router.add_post(path, proxy.pd)
        app.router.add_route("*", "/{tail:.*}", _first_decode(proxy))
    else:
        app.router.add_route("*", "/{tail:.*}", proxy.round_robin)
    return app


def _first_decode(proxy: Proxy):
    """Non-completion paths (/v1/models ...) of the P/D proxy go to a decode instance."""
    async def handler(request):
        proxy.backends = proxy.decode
        return await proxy.round_robin(request)
    return handler


def parser() -> OneLineParser:
    """The module's command line (a lab test parses the lab's own call with it)."""
    p = OneLineParser(prog="python -m kvbench.lab.venv.proxy")
    p.add_argument("--mode", choices=("rr", "pd"), required=True)
    p.add_argument("--port", type=number(int, 1, 65_535), required=True)
    p.add_argument("--backend", action="append", help="rr: base URL of an instance (repeat)")
    p.add_argument("--prefill", action="append", help="pd: base URL of a prefill instance")
    p.add_argument("--decode", action="append", help="pd: base URL of a decode instance")
    p.add_argument("--events", help="append per-request steps to this JSONL file")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    web.run_app(build_app(args), host="127.0.0.1", port=args.port, print=None,
                access_log=None, shutdown_timeout=2.0)


if __name__ == "__main__":
    main()
