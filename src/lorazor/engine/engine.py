"""LoRazorEngine: continuous batching over a LoRazorModel with a paged KV cache.

    engine = LoRazorEngine(model, max_num_seqs=64, max_num_batched_tokens=1024, num_kv_blocks=512)
    rid = engine.add_request(prompt_ids, adapter="math", max_new_tokens=64)
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput per request that got a token or finished
            ...
    outputs = engine.generate([{"prompt_ids": ids, "adapter": "sql"}, ...])   # offline

Requests join and leave at every step: a step packs the running requests' decode tokens and the
next prefill chunks of new ones into one forward: `schedule -> load -> forward -> device picks ->
read back` (`scheduler.py`, `step_inputs.py`, then the runner's `PagedSteps`: the device side of
every step, on the same `ModelRunner` `generate()` uses). With async scheduling (the default on a
GPU) the engine queues step n+1 before it reads step n back, so the host's work overlaps the GPU's.
Each request keeps its own sampling settings (HF's semantics, as in `LoRazorModel.generate`) and its
own StepTrim policy, decided on the device as `generate()` decides.
On the GPU the attention reads the paged pool with a Triton kernel and every step replays a CUDA
graph (`runner/paged_graphs.py`); on the CPU everything runs the pure-torch reference.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig

from ..config import EngineConfig
from ..model.hf_generation import ResolvedConfigs
from .admission import check_length, prepare_request
from .background import BackgroundLoop
from .blocks import BlockPool
from .request import Request, RequestOutput, Status
from .scheduler import Scheduler
from .step_inputs import TableRows, picks_of, prepare

# The engine's defaults live in one place: `EngineConfig` (these names stay for callers of old).
DEFAULT_MAX_NUM_SEQS = EngineConfig.max_num_seqs
DEFAULT_MAX_NUM_BATCHED_TOKENS = EngineConfig.max_num_batched_tokens
# KV blocks on the CPU when `num_kv_blocks` is not given (on the GPU: `gpu_memory_utilization`).
DEFAULT_CPU_BLOCKS = 256
# Default `max_model_len` cap (the block-table width follows it).
DEFAULT_MAX_MODEL_LEN = 4096
# GPU memory left outside the KV pool when it is sized automatically: activations, graphs, logits.
GPU_HEADROOM_BYTES = 3 << 30
# Waiting requests whose adapters are loaded ahead, while the step before their admission runs.
PREFETCH_LOOKAHEAD = 8

if TYPE_CHECKING:
    from ..model import LoRazorModel

log = logging.getLogger("lorazor.engine")


def check_engine_supports(hf_config) -> None:
    """Refuse a model whose config (its `config.json`, before any weight is read) needs what the
    engine's steps do not do."""
    cap = getattr(hf_config, "attn_logit_softcapping", None)
    if cap is not None:
        raise NotImplementedError(
            f"the engine's paged attention has no attention-logit softcapping, which this "
            f"{getattr(hf_config, 'model_type', '?')} model uses (attn_logit_softcapping={cap}): "
            "use LoRazorModel.generate for it")


class LoRazorEngine:
    """Continuous batching with a paged KV cache, chunked prefill, per-request adapters and StepTrim.

    Args:
        model: the `LoRazorModel` to serve (every adapter registered with it can be requested).
        config: an `EngineConfig` (`lorazor.config`: seats, tokens per step, the KV pool, async
            scheduling, prefix caching; every field documented there); None: its defaults.
        **settings: `EngineConfig` fields that override `config`'s, e.g.
            `LoRazorEngine(model, max_num_seqs=64, enable_prefix_caching=False)`.

    With async scheduling `step()` returns the step before's outputs, and a request that stops is
    found one step late (that step's token for it is dropped). With prefix caching a request
    prefills only the part of its prompt no earlier request computed with the same weights
    (`RequestOutput.num_cached_tokens`).
    """

    def __init__(self, model: LoRazorModel, config: EngineConfig | None = None, **settings: object):
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        config = self.config = (config or EngineConfig()).replace(**settings)
        self.model = model
        runner = self.runner = model.runner
        check_engine_supports(runner.hf_model.config)
        block_size, num_kv_blocks = config.block_size, config.num_kv_blocks
        if num_kv_blocks is None:
            per_block = runner.kv_bytes_per_token() * block_size
            if model.device.type == "cuda":
                headroom = GPU_HEADROOM_BYTES + runner.step_workspace_bytes(config.max_num_batched_tokens)
                free = torch.cuda.mem_get_info(model.device)[0] * config.gpu_memory_utilization - headroom
                num_kv_blocks = max(int(free // per_block), 1)
            else:
                num_kv_blocks = DEFAULT_CPU_BLOCKS
        max_pos = runner.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        max_model_len = config.max_model_len
        if max_model_len is None:
            max_model_len = min(max_pos, DEFAULT_MAX_MODEL_LEN)
        elif max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}")
        window = runner.sliding_window
        if window is not None and max_model_len > window:
            raise NotImplementedError(f"the engine's attention has no sliding window: max_model_len={max_model_len} "
                                      f"exceeds the model's sliding_window={window}; pass max_model_len<={window}")
        self.max_model_len = max_model_len
        seats, tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.pool = BlockPool(num_kv_blocks, block_size, enable_caching=config.enable_prefix_caching)
        # The device side of every step (KV pool, block tables, graphs, bound policies): the runner's.
        self.steps = runner.paged_steps(model.bank, num_kv_blocks, block_size, seats, tokens,
                                        -(-max_model_len // block_size))
        self.table_rows = TableRows(seats)
        self.scheduler = Scheduler(self.pool, seats, tokens, model.bank.num_slots, on_free=self.table_rows.release,
                                   adapter_ready=model.registry.host_ready)
        self.requests: dict[str, Request] = {}
        self._configs = ResolvedConfigs(runner.hf_model)  # HF's settings resolution, once per distinct settings
        self._loads_at_start = model.registry.loads
        self._ids = itertools.count()
        self._background: BackgroundLoop | None = None
        # Off the GPU the host computes the steps itself: nothing could overlap.
        self.async_scheduling = model.device.type == "cuda" if config.async_scheduling is None \
            else config.async_scheduling
        self._in_flight = None  # the launched step not read back yet (async scheduling)
        self._early: list[RequestOutput] = []  # outputs of a step read back inside `_launch`

    @property
    def cache(self):
        """The paged KV pool (`runner.PagedKVCache`)."""
        return self.steps.cache

    @property
    def graphs(self):
        """The step graphs (`runner.PagedDecodeGraphs`), or None where steps run eagerly."""
        return self.steps.graphs

    def warm_up(self, batch_sizes=None) -> int:
        """Capture the step CUDA graphs now (every batch bucket up to `max_num_seqs`, or those of
        `batch_sizes`, and every token bucket of steps with prefill chunks), so no step captures
        later; returns how many were captured (0 without graphs: on the CPU, or with the
        `active_rows` / `two_class` grids, steps run eagerly)."""
        graphs = self.steps.graphs
        if graphs is None:
            return 0
        start = time.perf_counter()
        if self.model.config.compile:  # say it before the wait, not after: a cold start looks hung
            dirs = self.model.runner.compiled_layers.cache_dirs
            log.info("warm-up: compiling the step graphs; with empty compile caches this takes minutes, with "
                     "those a run left (inductor: %s, triton: %s) seconds", dirs["inductor"], dirs["triton"])
        with self.model.guard.hold("capture the engine's graphs"):
            captured = self.steps.warm_up(batch_sizes)
        log.info("warm-up: captured %d step graphs in %.1f s (decode steps, %s: %.1f s; steps with prefill: %.1f s)",
                 captured, time.perf_counter() - start, "compiled" if self.model.config.compile else "eager",
                 graphs.capture_seconds, graphs.packed.capture_seconds)
        return captured

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int] | torch.Tensor, adapter: str | None = None,
                    generation_config: GenerationConfig | None = None, release: int | str | None = None,
                    request_id: str | None = None, generator: torch.Generator | None = None,
                    arrival_time: float | None = None, **kwargs) -> str:
        """Queue a request; returns its id. Everything is checked here, so a bad request is refused
        before it touches the running ones.

        Args:
            prompt_ids: the prompt's token ids (a list or a 1-D tensor).
            adapter: a registered adapter name, or None for the backbone.
            generation_config: HF generation settings, as for `LoRazorModel.generate`; `kwargs`
                override its fields (`max_new_tokens`, `do_sample`, `temperature`, `eos_token_id`,
                `stop_strings` with `tokenizer=`, ...). `num_return_sequences` must be 1.
                `release_policy=`: this request's StepTrim policy (`ProfiledRelease`,
                `LearnedRelease` or your own `ReleasePolicy`), instead of the model's default.
                `structured_output=`: a constraint on the output (`runner/grammar.py`): a dict with
                exactly one of `json` (a JSON schema), `json_object` (True), `regex`, `choice` (a
                list of strings) or `grammar` (xgrammar's EBNF), or a `StructuredOutput`; needs
                `tokenizer=`. Every token is drawn from what the grammar allows next; the request
                finishes "stop" once the grammar is complete, "length" at `max_new_tokens`.
                `cache_salt=`: a string mixed into the hash of every KV block this request
                computes (vLLM's name): requests with different salts never share prefix-cache
                blocks, those with the same salt do. A gateway sets one per tenant to close the
                side channel of `num_cached_tokens` (docs/serving.md, "Security").
            release: None (the policy decides), "never", or a release length k >= 0.
            request_id: a unique id; None: a fresh one.
            generator: a seeded `torch.Generator` for this request's sampling.
            arrival_time: when the request arrived (`time.monotonic()`), if before this call; TTFT
                counts from it.
        """
        request = self.prepare_request(prompt_ids, adapter, generation_config, release, request_id, generator,
                                       **kwargs)
        return self.queue_request(request, arrival_time)

    def queue_request(self, request: Request, arrival_time: float | None = None) -> str:
        """Queue a request built by `prepare_request` (its id is checked again: it may have been
        taken since); returns its id."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.adapter is not None:  # the adapter as it is now, on this thread: the one that will run
            self.model.registry.acquire(request.adapter, request.adapter_digest)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def prepare_request(self, prompt_ids, adapter: str | None = None, generation_config=None, release=None,
                        request_id: str | None = None, generator: torch.Generator | None = None, **kwargs) -> Request:
        """Check a request and build it without queueing it (`add_request`'s checks, nothing changed):
        `admission.prepare_request`."""
        return prepare_request(self, prompt_ids, adapter, generation_config, release, request_id, generator, **kwargs)

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ValueError when a request of this size can never run (`admission.check_length`)."""
        check_length(self, prompt_len, max_new_tokens)

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request and free its KV blocks; returns its final output."""
        if request_id not in self.requests:
            raise KeyError(f"unknown or finished request {request_id!r}")
        request = self.requests[request_id]
        self._finish(request, "abort")
        return request.report([])

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request; returns their final outputs. The step in flight, if
        any, is dropped (its requests are among them)."""
        outputs = [self.abort(request_id) for request_id in list(self.requests)]
        self._in_flight = None
        return outputs

    def step_or_abort_all(self) -> list[RequestOutput]:
        """`step()` for servers: a step that raises even though its launch failures were isolated
        (`step` retries without the requests that cause them) is logged and aborts every request,
        so no stream waits forever on it."""
        try:
            return self.step()
        except Exception:
            log.exception("engine step failed: aborting every request")
            return self.abort_all()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def adapter_loads(self) -> int:
        """Adapter weights copied into GPU slots since this engine was built (requests' loads and
        prefetches; loads while the model was built do not count)."""
        return self.model.registry.loads - self._loads_at_start

    # ---- steps ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output per request that got a token or finished.

        A step is four phases: schedule (which requests, how many tokens each), load (their
        adapters into GPU slots), launch (the forward and the device's picks, queued without a host
        sync), postprocess (a launched step read back into outputs, `outputs.py`). With async
        scheduling the step launched here is read back by the next call, so the outputs are those
        of the step before, and a call with nothing new to run reads the last one back.

        A step whose launch raises is retried without the requests that make it fail
        (`_launch_isolating`): those end with finish reason "error", the others go on with the
        tokens they would get alone. Only a failure outside any request's launch (reading a step
        back) leaves the running requests' state unknown: `step_or_abort_all` then aborts them."""
        with self.model.guard.hold("run an engine step"):
            previous, self._in_flight = self._in_flight, None
            chunks, previous, outputs = self._schedule(previous)
            chunks, failed = self._load(chunks)
            outputs += failed
            if not chunks:
                if previous is None and self.requests and not failed:
                    if self.model.registry.read_ahead.wait(timeout=0.05):
                        return outputs  # every waiting request waits for its adapter's folder to be read
                    raise RuntimeError(f"{len(self.requests)} requests wait but none can be scheduled")
                return outputs + self._postprocess(previous)
            try:
                launched = self._launch(chunks, previous)
            except Exception as err:
                return outputs + self._take_early() + self._launch_isolating(chunks, previous, err)
            outputs += self._take_early()  # `previous`, if it had to be read before this step's picks
            if self.async_scheduling and launched.overlappable:
                self._in_flight = launched
                return outputs + self._postprocess(previous)
            return outputs + self._postprocess(previous, launched)

    def _schedule(self, previous):
        """(chunks, the step in flight or None once read back, outputs read back): the scheduler's
        choice; where it must preempt, the step in flight is read back first."""
        chunks = self.scheduler.schedule(preempt=previous is None)
        outputs = []
        if chunks is None:  # preemption needed: the running requests' tokens must be on the host first
            outputs, previous = self._postprocess(previous), None
            chunks = self.scheduler.schedule()
        now = time.monotonic()
        for chunk in chunks:
            if chunk.request.scheduled_time is None:
                chunk.request.scheduled_time = now
        return chunks, previous, outputs

    def _load(self, chunks):
        """(the chunks that can run, the outputs of requests that cannot): the step's adapters put in
        GPU slots, the compute stream waiting for their copies. An adapter whose weights fail to
        load is marked broken, and only the requests that use it end (finish reason "error", with
        the reason); every other request of the step runs."""
        registry = self.model.registry
        # Released rows run as backbone rows (step_inputs.py): their adapters need no slot.
        names = list(dict.fromkeys(c.request.adapter for c in chunks if c.request.uses_adapter_at(c.start)))
        failed = registry.load_each(names)
        ended = []
        if failed:
            for name, reason in failed.items():
                log.error("adapter %r failed to load: %s; failing its requests", name, reason)
            ended = [r for r in list(self.requests.values()) if r.adapter in failed]
            for request in ended:
                request.error = f"adapter {request.adapter!r} failed to load: {failed[request.adapter]}"
                self._finish(request, "error")
            chunks = [c for c in chunks if c.request.status is not Status.FINISHED]
        registry.make_resident([name for name in names if name not in failed])
        return chunks, [request.report([]) for request in ended]

    def _postprocess(self, *steps) -> list[RequestOutput]:
        """The outputs of launched steps, in order (None, or a step already read back: skipped): the
        scheduler finishes the requests that stop; the engine then forgets them."""
        outputs = [out for step in steps if step is not None and step.values_host is None
                   for out in self.scheduler.update_from_output(step)]
        self._forget_finished()
        return outputs

    def _take_early(self) -> list[RequestOutput]:
        outputs, self._early = self._early, []
        return outputs

    def _launch(self, chunks, previous):
        """Queue the step's forward and its device picks (no host sync); `previous`: the step in
        flight, whose tokens some decode rows take as input. The requests' state changes only once
        everything is queued, so a launch that raises can be retried (its forward rewrites the same
        KV positions with the same values)."""
        inputs = prepare(self.model.registry, self.steps.block_size, self.table_rows, chunks)
        logits, hidden = self.steps.forward(inputs, previous)
        picks = picks_of(chunks, self.model.bank.slot_of)
        constrained = [i for i in picks.rows if chunks[i].request.constraint is not None]
        if constrained:
            if previous is not None:
                # A grammar's mask for this token needs the request's last token: read the step before
                # back now, while the GPU runs this step's forward (the other rows keep the overlap).
                self._early += self._postprocess(previous)
            picks.constrained_rows = [i for i in constrained if chunks[i].request.status is Status.RUNNING
                                      and not chunks[i].request.constraint.done]
            picks.constraints = [chunks[i].request.constraint for i in picks.constrained_rows]
        launched = self.steps.pick(picks, logits, hidden)
        for request, where, err in launched.failures:
            request.fail(where, err)
        for chunk in chunks:
            if chunk.request.status is Status.FINISHED:  # ended by the step read back early: its blocks are freed
                continue
            chunk.request.num_computed += chunk.num_tokens
            self.scheduler.cache_blocks(chunk.request)
        for request in launched.requests:
            request.pending += 1
        self._prefetch_waiting(chunks)
        return launched

    def _launch_isolating(self, chunks, previous, err: Exception) -> list[RequestOutput]:
        """The step's launch raised `err`: find the requests that make it fail by launching halves
        of the step (bisecting), end each such request with finish reason "error", and run the
        others. Each part is read back at once (the parts share the graphs' output buffers), so
        this step does not overlap the next; the step in flight is read back first."""
        log.warning("engine step of %d requests failed (%s: %s); retrying in parts to find the requests that "
                    "cause it", len(chunks), type(err).__name__, err)
        outputs = self._postprocess(previous)
        parts = [[c for c in chunks if c.request.status is Status.RUNNING]]
        while parts:
            part = parts.pop()
            if not part:
                continue
            try:
                launched = self._launch(part, None)
            except Exception as part_err:
                if len(part) > 1:
                    half = len(part) // 2
                    parts += [part[half:], part[:half]]  # the first half runs first
                    continue
                request = part[0].request
                log.error("request %s: the engine step fails on it: %s: %s", request.request_id,
                          type(part_err).__name__, part_err)
                request.fail("engine step", part_err)
                self._finish(request, "error")
                outputs.append(request.report([]))
                continue
            outputs += self._postprocess(launched)
        return outputs

    def _prefetch_waiting(self, chunks) -> None:
        """Start loading the adapters of the next waiting requests into free or idle GPU slots, on
        the side stream while this step computes, so their first step does not wait for the copy.
        Slots of running requests and of this step are never evicted."""
        if not any(r.adapter is not None for r in itertools.islice(self.scheduler.waiting, PREFETCH_LOOKAHEAD)):
            return  # nothing to prefetch: skip the per-request work below (most decode steps)
        registry = self.model.registry
        busy = {c.request.adapter for c in chunks if c.request.uses_adapter_at(c.start)}
        busy |= {r.adapter for r in self.scheduler.running if r.holds_adapter}
        room = self.model.bank.num_slots - len(busy)
        wanted = []
        for request in itertools.islice(self.scheduler.waiting, PREFETCH_LOOKAHEAD):
            name = request.adapter
            if (name is not None and name not in busy and name not in wanted and len(wanted) < room
                    and registry.host_ready(name)):  # a folder to read: read ahead on the host thread
                wanted.append(name)
        if any(name not in registry.bank.slot_of for name in wanted):
            # A failing load marks its adapter broken; its requests end when they are scheduled.
            registry.load_each(wanted, protected=busy)

    def _finish(self, request: Request, reason: str) -> None:
        """End a request outside a step's read-back (abort, a failed load or launch)."""
        self.scheduler.finish(request, reason)
        self._forget_finished()

    def _forget_finished(self) -> None:
        """Drop the requests the scheduler finished and give their adapters back to the registry."""
        for request in self.scheduler.take_finished():
            del self.requests[request.request_id]
            if request.adapter is not None:
                self.model.registry.release(request.adapter)

    # ---- offline and streaming ------------------------------------------------------------------
    def generate(self, requests: list[dict], progress: bool = False) -> list[RequestOutput]:
        """Run a list of requests (each a dict of `add_request` arguments) to the end; outputs in order.
        Requests queued before keep running alongside; their outputs are not returned here. A bad
        request raises before any step, and this call's requests queued before it are taken back
        (none is left to run with no one to read it)."""
        ids = []
        try:
            for r in requests:
                ids.append(self.add_request(**r))
        except Exception:
            for request_id in ids:
                self.abort(request_id)
            raise
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests")
        while len(done) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

    @property
    def background(self) -> BackgroundLoop:
        """The thread that runs this engine's steps for asyncio code (`stream`, `lorazor serve`).
        Once it has started, change the engine only through `await engine.background.call(fn)`."""
        if self._background is None:
            self._background = BackgroundLoop(self)
        return self._background

    def stream(self, prompt_ids, **kwargs):
        """`async for out in engine.stream(ids, adapter=..., max_new_tokens=...)`: this request's
        outputs as they come (`add_request`'s arguments). Steps run on `background`'s thread, so
        the event loop stays free while they compute; concurrent streams share them. A consumer
        that falls behind gets its pending outputs merged; one that stops early aborts its request.
        Bad input raises here, before anything is queued."""
        arrival_time = kwargs.pop("arrival_time", None)
        return self.background.stream(self.prepare_request(prompt_ids, **kwargs), arrival_time)
