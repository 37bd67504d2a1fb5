"""LoRazor on Ray Serve: replicas of the engine behind one OpenAI endpoint, routed by adapter.

    client --HTTP--> Serve proxy --> LoRazorRouter (ingress) --handle, multiplexed_model_id=adapter-->
        LoRazorReplica x N: `lorazor serve`'s own app (its engine process, routes, errors, streams)

- The router reads the request's `model` field and calls the replicas with Serve's
  `multiplexed_model_id` set to the adapter, so Serve sends it to a replica that already holds that
  adapter (`@serve.multiplexed`, LRU over `max_adapters_per_replica`); backbone requests carry no id
  and are balanced over every replica.
- Each replica runs the same app as `lorazor serve` (`serve.cli.build`) in process (`asgi.call`):
  every route, error body, API key check and SSE stream is that code, not a copy. It adds the header
  `x-lorazor-replica` to every response and mirrors its request metrics into Ray's metrics export.
- A replica that dies answers its open requests with an OpenAI error (503 before the response
  started, an SSE error event and `[DONE]` after); Serve restarts it and routes new requests to
  the others meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ..serve.protocol import ApiError
from .asgi import Lifespan, call

log = logging.getLogger("lorazor.ray")
REPLICA_HEADER = b"x-lorazor-replica"
# Seconds between two reads of a replica's engine gauges for Ray's metrics export.
GAUGE_PERIOD_S = 2.0
# Requests the router relays at once (it only forwards; the replicas bound the real work).
ROUTER_MAX_ONGOING = 4096
# Response headers the router does not copy (its own response sets them).
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


def serve_args(options: dict | argparse.Namespace) -> argparse.Namespace:
    """`lorazor serve` arguments from a Namespace or a dict of flag names (`max-loras` or
    `max_loras`) to values, validated by the command's own parser (a YAML config's `args`): True
    turns a flag on, False off (`--no-...` where the flag is on by default), a list repeats its
    values."""
    if isinstance(options, argparse.Namespace):
        return options
    parser = serve_parser()
    defaults = vars(parser.parse_args([]))
    argv = []
    for key, value in options.items():
        dest = key.replace("-", "_")
        if dest not in defaults:
            raise ValueError(f"unknown lorazor serve argument {key!r}")
        flag = "--" + dest.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            if defaults[dest] is not False:  # a --flag/--no-flag pair whose default is on or unset
                argv.append("--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    try:
        return parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as err:
        raise ValueError(f"invalid lorazor serve arguments {options!r}: {err}") from err


def serve_parser() -> argparse.ArgumentParser:
    from ..serve.cli import add_arguments

    parser = argparse.ArgumentParser(prog="lorazor.ray.build_app", exit_on_error=False)
    add_arguments(parser)
    return parser


class RayMetricsMirror:
    """The replica's request metrics, also recorded in Ray's metrics (exported with the `ray_`
    prefix and a `replica` tag by every node's metrics agent)."""

    def __init__(self, replica: str, model_name: str):
        from ray.util import metrics

        tags = ("replica", "model_name")
        self.tags = {"replica": replica, "model_name": model_name}
        self.finished = metrics.Counter("lorazor_request_success", "Finished requests", tags + ("finished_reason",))
        self.prompt = metrics.Counter("lorazor_prompt_tokens", "Prompt tokens", tags)
        self.generated = metrics.Counter("lorazor_generation_tokens", "Generated tokens", tags)
        self.lora_steps = metrics.Counter("lorazor_lora_decode_steps", "Decode steps that ran an adapter", tags)
        self.ttft = metrics.Histogram("lorazor_time_to_first_token_seconds", "Time to first token",
                                      [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0], tags)
        self.running = metrics.Gauge("lorazor_num_requests_running", "Requests running", tags)
        self.waiting = metrics.Gauge("lorazor_num_requests_waiting", "Requests waiting", tags)
        self.kv = metrics.Gauge("lorazor_kv_cache_usage_perc", "KV-cache usage", tags)
        self.loads = metrics.Gauge("lorazor_lora_adapter_loads", "Adapter loads into GPU slots so far", tags)
        # Residency, as the server's /metrics has it (for routers that read where adapters live).
        self.loaded = metrics.Gauge("lorazor_lora_adapter_loaded", "1 for each adapter and level it is resident at",
                                    tags + ("adapter_name", "level"))
        self.gpu_loaded = metrics.Gauge("lorazor_num_gpu_loaded_lora_adapters", "Adapters in GPU slots", tags)
        self.max_gpu = metrics.Gauge("lorazor_max_gpu_lora_adapters", "GPU adapter slots (max_loras)", tags)
        from ..adapters.registry import LOAD_BUCKETS

        self.load_seconds = metrics.Histogram("lorazor_lora_adapter_load_seconds", "Host time to load an adapter "
                                              "into a GPU slot, by source", list(LOAD_BUCKETS), tags + ("source",))
        self._loads_seen = 0
        self._levels: set = set()  # (adapter, level) pairs set to 1 at the last poll

    def observe(self, out, prompt_tokens: int) -> None:
        self.finished.inc(1, {**self.tags, "finished_reason": out.finish_reason or "abort"})
        self.prompt.inc(prompt_tokens, self.tags)
        if out.num_tokens:
            self.generated.inc(out.num_tokens, self.tags)
        if out.lora_decode_steps:
            self.lora_steps.inc(out.lora_decode_steps, self.tags)
        if out.ttft is not None:
            self.ttft.observe(out.ttft, self.tags)

    def observe_left(self, prompt_tokens: int, generated: int, arrival_time: float) -> None:
        self.finished.inc(1, {**self.tags, "finished_reason": "abort"})

    def set_gauges(self, stats: dict) -> None:
        self.running.set(stats["running"], self.tags)
        self.waiting.set(stats["waiting"], self.tags)
        self.kv.set(stats["kv_blocks_used"] / max(stats["kv_blocks_total"], 1), self.tags)
        self.loads.set(stats["adapter_loads"], self.tags)
        levels = {(name, level) for name, flags in stats["residency"].items()
                  for level, resident in zip(("gpu", "cpu"), flags) if resident}
        for name, level in levels | self._levels:  # a level left since the last poll reads 0
            self.loaded.set(1 if (name, level) in levels else 0, {**self.tags, "adapter_name": name, "level": level})
        self._levels = levels
        self.gpu_loaded.set(sum(on_gpu for on_gpu, _ in stats["residency"].values()), self.tags)
        self.max_gpu.set(stats["max_loras"], self.tags)
        for number, source, seconds in stats["load_times"]["recent"]:
            if number > self._loads_seen:
                self.load_seconds.observe(seconds, {**self.tags, "source": source})
        self._loads_seen = max(self._loads_seen, stats["load_times"]["total"])


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def keep_internal_grpc_on_loopback(host: str) -> None:
    """Ray Serve (2.60) starts every replica's inter-deployment gRPC server on all interfaces
    (`"[::]:0"`, hard-coded in `ray/serve/_private/replica.py`), though its single-node mode puts
    every other Ray process on 127.0.0.1. Where this node's Ray address and the operator's `--host`
    are both loopback, bind that server to 127.0.0.1 too. Called in the replica's process, before
    Serve starts the server (it does once the constructor returns); a cluster of several nodes
    (a node address that is not loopback) keeps Ray's default."""
    try:
        from ray.serve._private import replica
    except ImportError:  # another Ray layout: nothing to adjust
        return
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "lorazor_loopback", False) or host not in LOOPBACK_HOSTS:
        return
    if not ray.is_initialized() or ray.util.get_node_ip_address() != "127.0.0.1":
        return

    def loopback(server, address):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return bind(server, address)

    loopback.lorazor_loopback = True
    replica.add_port_to_grpc_server = loopback


class LoRazorReplicaBase:
    """One replica: `lorazor serve`'s app over its own engine, driven in process."""

    def __init__(self, options: dict | argparse.Namespace):
        from ..serve.cli import build

        args = serve_args(options)
        keep_internal_grpc_on_loopback(args.host)
        if args.device == "auto" and ray.is_initialized() and not ray.get_gpu_ids():
            args.device = "cpu"  # a replica given no GPU stays off the host's GPUs
        logging.basicConfig(level=args.log_level.upper())
        self.app, self.model_name = build(args)
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id if context is not None else "local"
        self.mirror = RayMetricsMirror(self.replica, self.model_name)
        self.app.state.metrics.mirror = self.mirror
        self.lifespan = Lifespan(self.app)
        self._started: asyncio.Future | None = None
        self._gauges: asyncio.Task | None = None

    async def _ready(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self.lifespan.startup())
            self._gauges = asyncio.get_running_loop().create_task(self._poll_gauges())
        await self._started

    async def _poll_gauges(self) -> None:
        engine = self.app.state.engine
        while True:
            try:
                self.mirror.set_gauges(await engine.stats())
            except Exception:  # a dead engine: its requests already say so
                return
            await asyncio.sleep(GAUGE_PERIOD_S)

    async def hold_adapter(self, name: str) -> str:
        """Serve's multiplexed load (wrapped in `replica_deployment`): the adapter is registered with
        every replica's engine, which moves its weights into a GPU slot when a request first needs
        them; this only tells Serve which adapters this replica serves, so it routes them here."""
        return name

    async def handle_http(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        """One HTTP request through the app: yields `(status, headers)`, then body chunks."""
        await self._ready()
        adapter = serve.get_multiplexed_model_id()
        if adapter:
            await self.hold_adapter(adapter)
        first = True
        async for item in call(self.app, method, path, query, headers, body):
            if first:
                status, response_headers = item
                yield status, response_headers + [(REPLICA_HEADER, self.replica.encode())]
                first = False
            else:
                yield item

    async def __del__(self):
        if self._gauges is not None:
            self._gauges.cancel()
        await self.lifespan.shutdown()


def replica_deployment(max_adapters_per_replica: int):
    """The replica deployment class, its multiplexed adapter set bounded by `max_adapters_per_replica`
    (a decoration-time constant in Serve, hence a class per value)."""

    class LoRazorReplica(LoRazorReplicaBase):
        @serve.multiplexed(max_num_models_per_replica=max_adapters_per_replica)
        async def hold_adapter(self, name: str) -> str:
            return await LoRazorReplicaBase.hold_adapter(self, name)

    return serve.deployment(name="LoRazorReplica")(LoRazorReplica)


@serve.deployment(name="LoRazorRouter")
class LoRazorRouter:
    """The ingress: routes each HTTP request to a replica by its adapter and relays the response."""

    def __init__(self, replicas, base_model: str, affinity: bool = True, host: str = "127.0.0.1"):
        keep_internal_grpc_on_loopback(host)
        self.replicas, self.base_model, self.affinity = replicas, base_model, affinity

    def adapter_of(self, request: Request, body: bytes) -> str:
        """The adapter a request names in its JSON `model` field ("" for the backbone or none)."""
        if request.method != "POST" or not body.lstrip().startswith(b"{"):
            return ""
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            return ""  # the replica answers the malformed body with its own 400
        return model if isinstance(model, str) and model != self.base_model else ""

    async def __call__(self, request: Request):
        body = await request.body()
        adapter = self.adapter_of(request, body) if self.affinity else ""
        handle = self.replicas.options(stream=True, multiplexed_model_id=adapter)
        responses = handle.handle_http.remote(request.method, request.url.path, request.url.query.encode(),
                                              list(request.headers.raw), body)
        try:
            status, headers = await responses.__anext__()
        except Exception as err:  # the replica died or could not be reached before answering
            log.warning("request %s %s failed on its replica: %s", request.method, request.url.path, err)
            responses.cancel()
            return JSONResponse(ApiError(503, f"the replica serving this request failed ({type(err).__name__}); "
                                              "retry: another replica serves it", kind="service_unavailable").body(),
                                status_code=503)
        kept = [(k, v) for k, v in headers if k.lower() not in HOP_HEADERS]
        streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in kept)

        async def relay():
            finished = False
            try:
                async for chunk in responses:
                    yield chunk
                finished = True
            except Exception as err:  # the replica died mid-response
                log.warning("replica failed mid-response: %s", err)
                if streaming:
                    error = ApiError(503, f"the replica serving this stream failed ({type(err).__name__})",
                                     kind="service_unavailable")
                    yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
            finally:
                if not finished:
                    responses.cancel()

        response = StreamingResponse(relay(), status_code=status)
        response.raw_headers = kept
        return response


def build_app(options: dict | argparse.Namespace) -> serve.Application:
    """The Serve application for `lorazor serve` arguments (a Namespace, or a dict of flag names to
    values, as a `serve run` YAML config's `args` gives them): `replicas` replicas of the engine, each
    with `num_gpus_per_replica` GPUs, behind the adapter-affinity router.

    Also usable as Serve's application builder: `serve run lorazor.ray:build_app model=... replicas=2`.
    """
    args = serve_args(options)
    from ..serve.cli import adapter_paths

    adapters = adapter_paths(args)
    per_replica = args.max_adapters_per_replica or args.max_loras or max(len(adapters), 4 if args.testbed else 1)
    # Serve's default of 5 ongoing requests per replica would cap a continuous-batching engine far
    # below its batch: let each replica take twice its batch (the rest waits in its scheduler).
    options = dict(ray_actor_options={"num_gpus": args.num_gpus_per_replica, "num_cpus": args.num_cpus_per_replica},
                   max_ongoing_requests=2 * args.max_num_seqs)
    if args.replicas:  # else Serve's default, or the config file's num_replicas / autoscaling_config
        options["num_replicas"] = args.replicas
    replica = replica_deployment(per_replica).options(**options)
    name = args.served_model_name or ("testbed" if args.testbed else args.model)
    # Only `lorazor serve`'s own arguments travel to the replicas (not the top-level command's).
    dests = set(vars(serve_parser().parse_args([])))
    own = argparse.Namespace(**{k: v for k, v in vars(args).items() if k in dests})
    return LoRazorRouter.options(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=ROUTER_MAX_ONGOING).bind(
        replica.bind(own), name, not args.no_affinity, args.host)
