"""LoRazor on Ray Serve (the `ray` extra): replicas of the engine behind one OpenAI endpoint, with
adapter-affinity routing through Serve's model multiplexing. See docs/scaling.md.

- `build_app(args)`: the Serve application, for your own Ray cluster (`serve run` / a YAML config).
- `run_local(args)`: `lorazor serve --replicas N`: Ray started in this process on 127.0.0.1, Serve's
  HTTP on `--host:--port`, until SIGINT or SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

__all__ = ["build_app", "run_local"]

log = logging.getLogger("lorazor.ray")
# Ray's single-node mode: every Ray process binds and connects to 127.0.0.1. Without it, on Linux,
# Ray turns `_node_ip_address="127.0.0.1"` into the host's network address and its processes talk
# over that address (checked with ray 2.60). Read when `ray` is first imported.
LOOPBACK_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def build_app(options):
    """See `deployment.build_app`."""
    from .deployment import build_app as build

    return build(options)


def run_local(args) -> int:
    """Serve `lorazor serve` arguments on `args.replicas` replicas in a local Ray instance; returns
    the exit status once stopped by SIGINT or SIGTERM."""
    for key, value in LOOPBACK_ONLY_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import ray
        from ray import serve
    except ImportError as err:
        raise SystemExit(f"lorazor serve --replicas needs the ray extra ({err}): pip install 'lorazor[ray]'") from err
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Logical CPUs: each replica (and its engine process) and the router get one, however many cores.
    cpus = max(os.cpu_count() or 1, int(args.replicas * args.num_cpus_per_replica) + 2)
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=cpus,
             _metrics_export_port=args.ray_metrics_port, configure_logging=False)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(args), name="lorazor", route_prefix="/")
        log.info("serving on http://%s:%d/v1 with %d replicas (adapter affinity %s); Ray's metrics of every "
                 "replica on http://127.0.0.1:%d/metrics", args.host, args.port, args.replicas,
                 "off" if args.no_affinity else "on", args.ray_metrics_port)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
