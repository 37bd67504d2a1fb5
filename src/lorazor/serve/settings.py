"""`ServerSettings`: the server's settings in one frozen dataclass, whose fields `lorazor serve`'s
flags are generated from (`lorazor.config.add_config_arguments`, help text from the docs below)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from ..config import int_in_range

# Tool-call formats `--tool-call-parser` takes (`serve/tools.py`; a literal here: the command line
# reads this module without importing the server).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# How a request's unregistered adapter name may be resolved (vLLM's filesystem resolver).
RESOLVERS = ("filesystem",)


@dataclass(frozen=True)
class ServerSettings:
    """What the operator allows and how the HTTP server runs (defaults: the safe choice).

    Attributes:
        host: address to bind: loopback only unless you say otherwise.
        port: the port to listen on.
        api_key: key clients must send as `Authorization: Bearer KEY` (default: $LORAZOR_API_KEY; none
            if unset); an empty key is refused.
        enable_runtime_lora: allow `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
        lora_root: runtime loads only from folders under this one (their files too).
        lora_resolver: "filesystem": a request naming an adapter that is not registered but is a
            folder directly under `lora_root` registers and loads it, then is served (needs
            `enable_runtime_lora` and `lora_root`; the registration checks and the cap apply).
        max_registered_loras: the most adapters registered at once (runtime loads beyond it: 400).
        max_prompt_bytes: the longest prompt in UTF-8 bytes (all chat messages together); request
            bodies may be 4x that plus 64 KiB.
        max_request_bytes: the largest request body; None: 4 x max_prompt_bytes + 64 KiB.
        limit_concurrency: connections and requests at once before new ones get a 503; None: the
            open-file limit less 64.
        timeout_keep_alive: seconds an idle keep-alive connection stays open.
        header_timeout: seconds a new connection may take to send its request head.
        body_timeout: seconds a request's body may take to arrive after its head (then 408 and the
            connection is closed).
        shutdown_timeout: on SIGTERM or Ctrl-C, seconds running requests may finish before they are
            aborted.
        enable_auto_tool_choice: parse tool calls from the model's own output when a chat request
            has tools and tool_choice "auto" (vLLM's flag; needs tool_call_parser).
        tool_call_parser: the model family's tool-call format for "auto": hermes (Hermes, Qwen),
            llama3_json (Llama 3.x) or mistral.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    enable_runtime_lora: bool = False
    lora_root: Path | None = None
    lora_resolver: str | None = None
    max_registered_loras: int = 256
    max_prompt_bytes: int = 1 << 20
    max_request_bytes: int | None = None
    limit_concurrency: int | None = None
    timeout_keep_alive: int = 5
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    shutdown_timeout: float = 30.0
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: give a key, or None to serve without one")
        for name in ("max_registered_loras", "max_prompt_bytes", "port", "max_request_bytes", "limit_concurrency",
                     "timeout_keep_alive"):
            value = getattr(self, name)
            if value is None and name in ("max_request_bytes", "limit_concurrency"):
                continue
            if not int_in_range(value, 0 if name == "port" else 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("header_timeout", "body_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.lora_resolver is not None:
            if self.lora_resolver not in RESOLVERS:
                raise ValueError(f"lora_resolver must be one of {RESOLVERS}, got {self.lora_resolver!r}")
            if not self.enable_runtime_lora or self.lora_root is None:
                raise ValueError(f"lora_resolver {self.lora_resolver!r} needs enable_runtime_lora and lora_root "
                                 "(--enable-runtime-lora --lora-root DIR)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser "
                             f"{'|'.join(TOOL_CALL_PARSERS)})")
        if self.lora_root is not None:
            root = Path(self.lora_root)
            if not root.is_dir():
                raise ValueError(f"lora_root {str(root)!r} is not a folder")
            object.__setattr__(self, "lora_root", root.resolve())

    @property
    def body_limit(self) -> int:
        return self.max_request_bytes or 4 * self.max_prompt_bytes + (64 << 10)
