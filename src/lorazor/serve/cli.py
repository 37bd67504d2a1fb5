"""`lorazor serve`: build a model and engine from command-line arguments and run the app with uvicorn."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path

from ..config import EngineConfig, LoRazorConfig, add_config_arguments, config_from_args
from .settings import ServerSettings

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error")
# File descriptors kept out of `--limit-concurrency`'s default: the engine's pipes, model files, logs.
RESERVED_FDS = 64
# The `LoRazorConfig` fields `lorazor serve` takes as flags (the rest keep their defaults).
MODEL_FIELDS = ("max_loras", "max_lora_rank", "max_cpu_loras", "dtype", "compile", "quantization")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`lorazor serve`'s flags: what to serve (written here), then one group per configuration
    dataclass, generated from its fields (`LoRazorConfig`'s serving fields, `EngineConfig`,
    `ServerSettings`), then Ray's."""
    p.add_argument("--testbed", action="store_true", help="serve the shipped testbed (CPU; no other arguments needed)")
    p.add_argument("model_positional", nargs="?", metavar="MODEL",
                   help="the base model id or path, as `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("--model", help="base model id or path")
    p.add_argument("--adapter", action="extend", nargs="+", default=[], metavar="NAME=PATH",
                   help="a PEFT adapter folder to register (repeatable)")
    p.add_argument("--lora-modules", action="extend", nargs="+", default=[], metavar="NAME=PATH|JSON",
                   help="adapters to register, as vLLM takes them: name=path, or "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    p.add_argument("--served-model-name", help="name of the base model in requests (default: --model, or 'testbed')")
    p.add_argument("--device", default="auto",
                   help="where the model runs: auto (the GPU when there is one; the testbed: cpu), cpu, cuda, cuda:N")
    p.add_argument("--chat-template", type=Path, help="a Jinja chat template file for tokenizers without one")
    p.add_argument("--release-policy", type=Path, metavar="DIR",
                   help="serve the StepTrim policies saved under DIR (one folder per adapter, as `lorazor "
                        "calibrate` writes them) as every request's default; a request's `release` overrides")
    p.add_argument("--in-process", action="store_true",
                   help="run the engine on a thread of the server's process (default: a process of its own)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    add_config_arguments(p.add_argument_group("model (LoRazorConfig)"), LoRazorConfig, MODEL_FIELDS,
                         help_override={"dtype": "float32, float16, bfloat16, or auto (default: the model's own)",
                                        "quantization": "fp8: the base weights of every decoder projection in fp8 "
                                                        "with per-channel scales (default: none)"})
    add_config_arguments(p.add_argument_group("engine (EngineConfig)"), EngineConfig)
    add_config_arguments(p.add_argument_group("server, security and limits (ServerSettings)"), ServerSettings,
                         defaults={"api_key": os.environ.get("LORAZOR_API_KEY")})
    v = p.add_argument_group("vLLM's flags, for scripts written for `vllm serve`")
    v.add_argument("--enable-lora", action="store_true", help="accepted and ignored: LoRA is always on here")
    v.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="1 only: one engine per GPU (serve on several GPUs with --replicas N)")
    r = p.add_argument_group("replicas on Ray Serve (the ray extra)")
    r.add_argument("--replicas", type=int, default=0,
                   help="run this many engine replicas on Ray Serve behind one endpoint (default: 0, no Ray)")
    r.add_argument("--num-gpus-per-replica", type=float, default=0.0, help="GPUs each replica takes (default: 0)")
    r.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="CPUs each replica takes (default: 1)")
    r.add_argument("--max-adapters-per-replica", type=int,
                   help="adapters a replica is routed as holding (default: --max-loras, else every adapter)")
    r.add_argument("--no-affinity", action="store_true",
                   help="route requests to any replica, ignoring which adapters it holds")
    r.add_argument("--ray-metrics-port", type=int, default=8080,
                   help="port of Ray's Prometheus export of every replica's metrics (default: 8080)")


def vllm_compatible(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """vLLM's habits where they cost nothing: `serve MODEL`, `--dtype auto`, `--enable-lora` (a
    note), `--tensor-parallel-size 1`; anything else of theirs is refused naming what is supported."""
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            parser.error(f"two models given: {args.model_positional!r} and --model {args.model!r}")
        args.model = args.model_positional
    if args.dtype == "auto":
        args.dtype = None  # the model's own dtype, as vLLM's auto
    if args.tensor_parallel_size != 1:
        parser.error(f"--tensor-parallel-size {args.tensor_parallel_size}: LoRazor runs one engine per GPU "
                     "(--tensor-parallel-size 1); serve on several GPUs with --replicas N")
    if args.enable_lora:
        print("lorazor serve: note: --enable-lora is accepted for vLLM's scripts; LoRA is always on here",
              file=sys.stderr)


def check_args(args: argparse.Namespace) -> None:
    """The checks that need no model and no heavy import, run before anything loads: what to serve,
    the adapters' names and folders, the policy folder (each answered in well under a second)."""
    if args.testbed and args.model:
        refuse("--testbed and --model exclude each other")
    if not args.testbed and not args.model:
        refuse("lorazor serve needs a model: --model PATH_OR_ID (or `lorazor serve MODEL`), or --testbed")
    check_adapter_folders(adapter_paths(args))
    if args.release_policy is not None and not args.release_policy.is_dir():
        refuse(f"--release-policy {str(args.release_policy)!r} is not a folder")


def adapter_paths(args: argparse.Namespace) -> dict[str, str]:
    """NAME -> PATH from `--adapter` and `--lora-modules` (name=path or vLLM's JSON form)."""
    adapters: dict[str, str] = {}
    specs = [("--adapter", spec) for spec in args.adapter] + [("--lora-modules", spec) for spec in args.lora_modules]
    for flag, spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
                name, path = entry["name"], entry["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise SystemExit(f'{flag} takes NAME=PATH or {{"name": ..., "path": ...}}, got {spec!r}') from err
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"{flag} takes NAME=PATH, got {spec!r}")
        if name in adapters:
            raise SystemExit(f"adapter {name!r} is given twice ({flag})")
        adapters[name] = path
    return adapters


def check_adapter_folders(adapters: dict[str, str]) -> None:
    """Refuse, before any model loads, an adapter whose name is invalid or whose path is no local
    folder with a PEFT config (a Hub id `owner/name` that is no local path is left to the loader)."""
    from lorazor.adapters.names import CONFIG_FILE, adapter_name_problem

    for name, path in adapters.items():
        problem = adapter_name_problem(name)
        if problem:
            refuse(problem)
        folder = Path(path).expanduser()
        hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
        if not folder.exists():
            if not hub_id:
                refuse(f"adapter {name!r}: {path} does not exist (no such local folder)")
            continue
        if not folder.is_dir():
            refuse(f"adapter {name!r}: {path} is not a folder")
        if not (folder / CONFIG_FILE).is_file():
            refuse(f"adapter {name!r}: {path} has no {CONFIG_FILE} (not a PEFT adapter folder)")


def serving_device(args: argparse.Namespace):
    """The torch device `--device` names; `auto` is the first GPU when there is one (the testbed: the CPU)."""
    import torch

    spec = args.device
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and not args.testbed else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as err:
        raise SystemExit(f"--device takes auto, cpu, cuda or cuda:N, got {spec!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device takes auto, cpu, cuda or cuda:N, got {spec!r}")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise SystemExit(f"--device {spec!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def load_tokenizer(args: argparse.Namespace):
    """The served model's tokenizer: the testbed's, or the one beside `--model`."""
    if args.testbed:
        from lorazor.testbed import load_tokenizer as testbed_tokenizer

        return testbed_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.model)


def build_engine(args: argparse.Namespace):
    """(engine, tokenizer) for parsed arguments, step graphs captured (in the engine's process)."""
    from lorazor import LoRazorEngine, LoRazorModel, load_release_policy

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    log = logging.getLogger("lorazor.serve")
    adapters = adapter_paths(args)
    device = serving_device(args)
    policy = load_release_policy(args.release_policy) if args.release_policy else None
    config = config_from_args(LoRazorConfig, args, MODEL_FIELDS, release=policy.kind if policy is not None else "none")
    if args.testbed:
        from lorazor.testbed import load

        # The four task adapters and the tool-calling one (`lorazor.testbed.tool_task`, rank 16).
        model = LoRazorModel.from_peft(load(with_tools=True)[0].to(device), config)
        for name, path in adapters.items():
            model.register_adapter(name, path)
    else:
        # Loaded straight onto the device (HF's device_map), not through host memory first.
        placement = {} if device.type == "cpu" else {"device_map": str(device)}
        model = LoRazorModel.from_pretrained(args.model, adapters=adapters, config=config, **placement)
    if policy is not None:
        model.load_release_policy(args.release_policy)
    engine = LoRazorEngine(model, config_from_args(EngineConfig, args))
    # On the GPU every step graph is captured before the first request (no-op on the CPU); the
    # engine logs how many and how long.
    engine.warm_up()
    log.info("engine ready: %s", describe(engine, policy))
    return engine, load_tokenizer(args)


def describe(engine, policy) -> str:
    """The served configuration in one line, for the startup log."""
    model = engine.model
    bank = model.bank
    names = model.adapter_names
    release = "none (per request only)" if policy is None else f"{policy.kind} for {sorted(_policy_adapters(policy))}"
    return (f"device {model.device}, dtype {model.config.dtype or 'model default'}; {len(names)} adapters "
            f"{names[:8]}{' ...' if len(names) > 8 else ''}; {bank.num_slots} GPU slots (max_loras), max rank "
            f"{bank.r_max}; KV cache {engine.pool.num_blocks} blocks x {engine.pool.block_size} tokens; "
            f"max_model_len {engine.max_model_len}; max_num_seqs {engine.scheduler.max_num_seqs}, "
            f"max_num_batched_tokens {engine.scheduler.max_num_batched_tokens}; decode step "
            f"{'compiled' if model.config.compile else 'eager'}, "
            f"{'async' if engine.async_scheduling else 'step-by-step'} scheduling; prefix caching "
            f"{'on' if engine.pool.enable_caching else 'off'}; release policy: {release}")


def _policy_adapters(policy) -> list[str]:
    return list(getattr(policy, "lengths", None) or getattr(policy, "heads", None) or [])


def settings_of(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from the flags; a bad one stops the command with one line (exit 2)."""
    if args.api_key is not None and not args.api_key.strip():
        # An empty key (flag or $LORAZOR_API_KEY) would turn authentication off without a word.
        refuse("the API key is empty (--api-key or $LORAZOR_API_KEY): give a key, or unset it to serve without one")
    try:
        return config_from_args(ServerSettings, args)
    except ValueError as err:
        refuse(str(err))


def check_configs(args: argparse.Namespace) -> None:
    """Refuse bad model and engine flags in one line, before any model loads."""
    try:
        config_from_args(LoRazorConfig, args, MODEL_FIELDS)
        config_from_args(EngineConfig, args)
    except ValueError as err:
        refuse(str(err))


def refuse(message: str):
    print(f"lorazor serve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_model(model: str) -> None:
    """Refuse an unsupported or missing model from its config.json, in one line, before any weight
    is read (and before the engine's process starts)."""
    from transformers import AutoConfig

    from lorazor.engine import check_engine_supports
    from lorazor.model.build import check_before_loading

    try:
        check_before_loading(model, LoRazorConfig(), {})
        check_engine_supports(AutoConfig.from_pretrained(model))
    except (NotImplementedError, ValueError, OSError) as err:
        refuse(str(err))


def build(args: argparse.Namespace, on_engine_dead=None):
    """(app, served model name) for parsed arguments."""
    from .app import build_app
    from lorazor.engine import EngineProcess

    from .engines import process_hooks

    check_args(args)  # a malformed --adapter, a missing folder or --device stops here, before any model loads
    serving_device(args)
    check_configs(args)
    if args.model:
        check_model(args.model)
    settings = settings_of(args)
    name = args.served_model_name or ("testbed" if args.testbed else args.model)
    if args.in_process:
        from lorazor.lora.types import AdapterError

        try:
            engine, tokenizer = build_engine(args)
        except (AdapterError, NotImplementedError) as err:  # one line, as without --in-process
            refuse(str(err))
    else:
        engine, tokenizer = EngineProcess(functools.partial(process_hooks, build_engine, args)), load_tokenizer(args)
    template = args.chat_template.read_text() if args.chat_template else None
    app = build_app(engine, tokenizer, model_name=name, chat_template=template, settings=settings,
                    on_engine_dead=on_engine_dead)
    return app, name


def require_serve_extra() -> None:
    """Stop with the install line when the `serve` extra is missing."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"lorazor serve needs the serve extra (missing: {', '.join(missing)}): "
                         "pip install 'lorazor[serve]'")


def main(args: argparse.Namespace) -> int:
    """Run the server until it is stopped; returns 1 if it stopped because the engine died."""
    require_serve_extra()
    if args.replicas:
        raise SystemExit("lorazor serve --replicas runs on Ray: start it with the `lorazor` command (lorazor.cli)")
    import uvicorn

    from .guards import GuardedH11Protocol, RepeatFilter, raise_open_file_limit

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    log = logging.getLogger("lorazor.serve")
    repeat = RepeatFilter()
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(repeat)
    files = raise_open_file_limit()
    limit = args.limit_concurrency or max(files - RESERVED_FDS, 16)
    server: list = []
    died: list = []

    def engine_dead():
        died.append(True)
        if server:
            server[0].should_exit = True

    try:
        app, name = build(args, on_engine_dead=engine_dead)
    except RuntimeError as err:  # the engine failed to build: its reason in one line, the traceback logged
        log.debug("%s", err)
        lines = [line for line in str(err).splitlines() if line.strip()]
        last = re.sub(r"^(?:[A-Za-z_][\w.]*\.)?(?:AdapterError|ValueError|NotImplementedError|OSError|KeyError): ", "",
                      lines[-1]) if lines else str(err)  # the reason, without the exception's internal class path
        refuse(f"{last} (--log-level debug shows the traceback)")
    protocol = type("HTTPProtocol", (GuardedH11Protocol,), {"HEADER_TIMEOUT_S": args.header_timeout})
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, http=protocol,
                            limit_concurrency=limit, timeout_keep_alive=args.timeout_keep_alive,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server.append(uvicorn.Server(config))
    log.info("serving %r on http://%s:%d/v1 (API key: %s; runtime adapter loading: %s; at most %d connections; "
             "base weights: %s)", name, args.host, args.port, "required" if args.api_key else "none",
             "on" if args.enable_runtime_lora else "off", limit,
             "fp8 (--quantization fp8)" if args.quantization == "fp8" else (args.dtype or "the model's dtype"))
    # uvicorn handles SIGINT and SIGTERM while it runs (stop accepting, let running requests finish
    # for --shutdown-timeout seconds, then cancel them; the app's shutdown aborts what is left in the
    # engine), then raises the signal again with the handler it found: for SIGTERM that must be a
    # normal stop too, not death by the signal.
    previous = signal.signal(signal.SIGTERM, _stop_by_signal)
    try:
        server[0].run()
    except KeyboardInterrupt:  # the signal again, once uvicorn has shut down gracefully: a normal stop
        log.info("stopped")
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_helper_processes()
    if died:
        log.error("exiting: the engine process died")
        return 1
    return 0


def _stop_by_signal(signum, frame):
    raise KeyboardInterrupt


def stop_helper_processes() -> None:
    """End multiprocessing's resource tracker (started with the engine's process) and reap it:
    left to exit after this process, it would stay a zombie where nothing reaps orphans."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        try:
            stop()
        except (OSError, ChildProcessError):  # already gone
            pass
