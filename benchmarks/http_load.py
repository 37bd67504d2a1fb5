"""The client side of an HTTP open loop, shared by `bench_serving.py` and `serving_replicas.py`:
Poisson arrivals sent from client processes, each answer streamed, TTFT and TPOT measured."""

from __future__ import annotations

import asyncio
import json
import time

import engine_workload as wl


async def send_all(url: str, requests: list[dict], offsets, start: float) -> list[tuple]:
    """Send request i at `start + offsets[i]` (monotonic clock) and stream its answer; per request
    (sent, first chunk, last chunk, completion tokens)."""
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def one(offset, request):
            await asyncio.sleep(max(start + offset - time.monotonic(), 0))
            sent = time.monotonic()
            first = end = None
            tokens = 0
            body = dict(model=request["adapter"] or "base", prompt=request["prompt_ids"],
                        max_tokens=request["max_new_tokens"], temperature=0, stream=True, release=request["release"],
                        stream_options={"include_usage": True})
            async with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.monotonic()
                    first = first or now
                    end = now
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return sent, first, end, tokens

        return await asyncio.gather(*(one(o, r) for o, r in zip(offsets, requests)))


def client_process(url: str, requests: list[dict], offsets: list[float], start: float) -> list[tuple]:
    """One client process's share of the arrivals (run in a child process)."""
    return asyncio.run(send_all(url, requests, offsets, start))


def http_open_loop(pool, url: str, requests: list[dict], offsets) -> dict:
    """The open loop over HTTP, its arrivals dealt round-robin to the client processes of `pool`, so
    parsing the streams does not compete with the server for this process's GIL (real clients are
    other processes). TTFT runs from the send to the first streamed chunk; TPOT from there to the
    last chunk, per token."""
    shards = pool._max_workers
    start = time.monotonic() + 0.5  # every client process is up before the first arrival
    futures = [pool.submit(client_process, url, requests[i::shards], [float(o) for o in offsets[i::shards]], start)
               for i in range(shards)]
    results = [r for f in futures for r in f.result()]
    ttft = [f - s for s, f, _, _ in results]
    tpot = [(e - f) / (n - 1) for _, f, e, n in results if n > 1]
    end = max(e for _, _, e, _ in results)
    return dict(completed=len(results), achieved_req_s=len(results) / (end - start),
                **{f"ttft_{k}": v for k, v in wl.percentiles(ttft).items()},
                **{f"tpot_{k}": v for k, v in wl.percentiles(tpot).items()})
