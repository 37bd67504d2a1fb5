"""`lorazor serve`: build a model and engine from command-line arguments and run the app with uvicorn."""

from __future__ import annotations

import argparse
import functools
import logging
import time
from pathlib import Path

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--testbed", action="store_true", help="serve the shipped testbed (CPU; no other arguments needed)")
    p.add_argument("--model", help="base model id or path")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="a PEFT adapter folder to register (repeatable)")
    p.add_argument("--served-model-name", help="name of the base model in requests (default: --model, or 'testbed')")
    p.add_argument("--max-loras", type=int, help="GPU adapter slots")
    p.add_argument("--max-lora-rank", type=int, help="the largest adapter rank")
    p.add_argument("--max-cpu-loras", type=int, help="host copies of adapters kept for fast reloads")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--chat-template", type=Path, help="a Jinja chat template file for tokenizers without one")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, help="KV cache blocks (default: from free GPU memory; 256 on the CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, help="the longest prompt + output a request may have")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the free GPU memory the KV pool takes when --num-kv-blocks is not given")
    p.add_argument("--in-process", action="store_true",
                   help="run the engine on a thread of the server's process (default: a process of its own)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def adapter_paths(args: argparse.Namespace) -> dict[str, str]:
    adapters = {}
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--adapter takes NAME=PATH, got {spec!r}")
        adapters[name] = path
    return adapters


def load_tokenizer(args: argparse.Namespace):
    """The served model's tokenizer: the testbed's, or the one beside `--model`."""
    if args.testbed:
        from lorazor.testbed import load_tokenizer as testbed_tokenizer

        return testbed_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.model)


def build_engine(args: argparse.Namespace):
    """(engine, tokenizer) for parsed arguments, step graphs captured (in the engine's process)."""
    from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    adapters = adapter_paths(args)
    config = LoRazorConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                           max_cpu_loras=args.max_cpu_loras, dtype=args.dtype)
    if args.testbed:
        from lorazor.testbed import load

        model = LoRazorModel.from_peft(load()[0], config)
        for name, path in adapters.items():
            model.register_adapter(name, path)
    else:
        model = LoRazorModel.from_pretrained(args.model, adapters=adapters, config=config)
    engine = LoRazorEngine(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                           gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len)
    # On the GPU every step graph is captured before the first request (no-op on the CPU).
    start = time.perf_counter()
    captured = engine.warm_up()
    if captured:
        logging.getLogger("lorazor.serve").info("captured %d step graphs in %.1f s", captured,
                                                time.perf_counter() - start)
    return engine, load_tokenizer(args)


def build(args: argparse.Namespace):
    """(app, served model name) for parsed arguments."""
    from .app import build_app
    from .engine_process import EngineProcess

    if args.testbed and args.model:
        raise SystemExit("--testbed and --model exclude each other")
    if not args.testbed and not args.model:
        raise SystemExit("lorazor serve needs --model PATH_OR_ID or --testbed")
    adapter_paths(args)  # a malformed --adapter stops here, before any model loads
    name = args.served_model_name or ("testbed" if args.testbed else args.model)
    if args.in_process:
        engine, tokenizer = build_engine(args)
    else:
        engine, tokenizer = EngineProcess(functools.partial(build_engine, args)), load_tokenizer(args)
    template = args.chat_template.read_text() if args.chat_template else None
    return build_app(engine, tokenizer, model_name=name, chat_template=template), name


def main(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    app, name = build(args)
    logging.getLogger("lorazor.serve").info("serving %r on http://%s:%d/v1", name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
