"""One OpenAI response out of its engine requests: `n` choices per prompt, a list of prompts, text
deltas with stop sequences held back, log-probabilities, usage, and errors.

A response's choices are independent engine requests (choice i of prompt p has index p * n + i and,
when the request is seeded, seed + index), started together before anything is sent: a request
the engine refuses is a 4xx for the whole response, never a broken stream. Once streaming, a failure
(the engine gone, an adapter that failed to load) is sent as an `error` event followed by `[DONE]`,
which OpenAI's clients raise as an `APIError`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from ..engine import EngineDeadError
from .engines import REQUEST_ERRORS
from .protocol import ApiError
from .text import FINISH_REASONS, IncrementalText, visible_text

log = logging.getLogger("lorazor.serve")


# The request field an engine refusal is about, by the name its message starts with or holds
# (the engine speaks HF's names; the client sent OpenAI's).
ENGINE_PARAMS = (("adapter", "model"), ("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"),
                 ("stop_strings", "stop"), ("logit_bias", "logit_bias"), ("repetition_penalty", "repetition_penalty"),
                 ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                 ("cache_salt", "cache_salt"), ("logprobs", "logprobs"), ("release", "release"),
                 ("prompt", "prompt"), ("max_model_len", "max_tokens"))


def param_of(message: str) -> str | None:
    """The OpenAI request field an engine error message is about, or None."""
    head = message.split(":", 1)[0]
    for needle, param in ENGINE_PARAMS:
        if needle in head:
            return param
    return next((param for needle, param in ENGINE_PARAMS if needle in message), None)


@dataclass
class Choice:
    """One engine request of a response."""

    index: int
    prompt_ids: list[int]
    args: dict  # plain engine arguments (`sampling.generation_kwargs` + prompt, adapter, seed)
    echo: str = ""  # completions' `echo`: the prompt text, sent before the completion


class Response:
    """The choices of one completions or chat request, run on `engine` and answered in OpenAI's shapes.

    Args:
        chat: chat completion shapes (else text completion).
        logprobs: None, or the top log-probabilities per token to report.
        metrics: `ServerMetrics` that records each finished or abandoned choice.
    """

    def __init__(self, engine, tokenizer, metrics, model: str, chat: bool, stops: list[str], logprobs: int | None,
                 include_usage: bool, tools=None):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.model, self.chat, self.stops, self.logprobs = model, chat, stops, logprobs
        self.include_usage = include_usage
        # A chat request with tools (`tools.ToolPlan`): its text becomes tool calls once finished.
        self.tools = tools if tools is not None and tools.mode is not None else None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    # ---- starting --------------------------------------------------------------------------------
    async def start(self, choices: list[Choice]) -> list:
        """Queue every choice; a refused one aborts those already queued and raises ApiError (400)."""
        streams = []
        try:
            for choice in choices:
                streams.append(await self.engine.generate(f"{self.id}-{choice.index}", choice.args))
        except REQUEST_ERRORS as err:
            for stream in streams:
                await stream.aclose()
            message = str(err).strip('"')
            raise ApiError(400, message, param=param_of(message)) from err
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        return streams

    async def deltas(self, choice: Choice, stream):
        """(text delta, RequestOutput, logprob entries) as one choice's tokens arrive; the last has
        `finished`. Records the choice in the metrics when it finishes or its consumer leaves."""
        sent = ""
        decoded = IncrementalText(self.tokenizer)
        out = None
        pending: list = []  # logprob entries of tokens whose text is held back
        observed = False
        try:
            async for out in stream:
                if self.logprobs is not None and out.new_logprobs:
                    pending += list(zip(out.new_token_ids, out.new_logprobs))
                text = visible_text(decoded.update(out.tokens, out.finished), self.stops, out.finished)
                if not text.startswith(sent):  # the final full decode differs from the increments
                    text = sent
                if len(text) > len(sent) or out.finished:
                    if out.finished:
                        self.metrics.observe(out, len(choice.prompt_ids))
                        observed = True
                    yield text[len(sent):], out, pending
                    sent, pending = text, []
        finally:
            if not observed:
                arrival = out.arrival_time if out is not None else time.monotonic()
                self.metrics.observe_left(len(choice.prompt_ids), out.num_tokens if out else 0, arrival)
            await stream.aclose()  # a client that went away aborts its request

    # ---- shapes ----------------------------------------------------------------------------------
    def _token_logprobs(self, entries, offset: int):
        """OpenAI's `logprobs` object for (token, (logprob, top)) entries; completions' text offsets
        count from `offset`."""
        if self.logprobs is None:
            return None
        decode = lambda t: self.tokenizer.decode([t])  # noqa: E731
        if self.chat:
            def item(token, logprob):
                text = decode(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}
            return {"content": [dict(item(t, lp), top_logprobs=[item(i, v) for i, v in top])
                                for t, (lp, top) in entries]}
        tokens = [decode(t) for t, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in entries],
                "top_logprobs": [{decode(i): v for i, v in top} or None for _, (_, top) in entries],
                "text_offset": offsets}

    def _choice(self, index: int, text: str, finish, logprobs, delta: bool, calls: list | None = None) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        key = "delta" if delta else "message"
        message = {"role": "assistant", "content": text}
        if calls:  # streamed calls carry their index in the list (the client reassembles by it)
            message["tool_calls"] = [dict(c, index=k) for k, c in enumerate(calls)] if delta else calls
        return {"index": index, key: message, "logprobs": logprobs, "finish_reason": finish}

    def _tool_calls(self, text: str, out) -> tuple[str | None, list, str]:
        """(content, tool calls, finish reason) of a finished chat choice under `self.tools`. As in
        vLLM, the calls are parsed whatever ended the output: one cut by max_tokens keeps the calls
        it completed (a cut one does not parse and stays in the text's place)."""
        finish = FINISH_REASONS[out.finish_reason]
        if self.tools is None:
            return text, [], finish
        content, calls = self.tools.calls(text)
        return content, calls, "tool_calls" if calls else finish

    @staticmethod
    def _usage(choices: list[Choice], outs: list) -> dict:
        """OpenAI's usage: each prompt counts once, however many choices it has (as OpenAI counts),
        with the prompt tokens the prefix cache served (the most any of its choices found)."""
        prompts: dict = {}
        for choice, out in zip(choices, outs):
            cached = prompts.get(id(choice.prompt_ids), (0, 0))[1]
            prompts[id(choice.prompt_ids)] = (len(choice.prompt_ids), max(cached, out.num_cached_tokens))
        prompt_tokens = sum(n for n, _ in prompts.values())
        completion_tokens = sum(out.num_tokens for out in outs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompts.values())}}

    @staticmethod
    def _extension(outs) -> dict:
        """LoRazor's StepTrim fields: the first choice's, as a single-choice response has them."""
        out = outs[0]
        skip = 0.0 if out.decode_steps == 0 else 1.0 - out.lora_decode_steps / out.decode_steps
        return {"release_step": out.release_step, "skip_fraction": skip}

    @staticmethod
    def _failure(out) -> ApiError | None:
        if out.finish_reason == "error":
            return ApiError(500, out.error or "the request failed in the engine", kind="server_error")
        return None

    # ---- answers ---------------------------------------------------------------------------------
    async def full(self, choices: list[Choice]) -> dict:
        """The whole response body (no streaming)."""
        streams = await self.start(choices)
        parts = await asyncio.gather(*(self._collect(c, s) for c, s in zip(choices, streams)))
        for _, out, _ in parts:
            if (err := self._failure(out)) is not None:
                raise err
        shaped = []
        for c, (text, out, entries) in zip(choices, parts):
            content, calls, finish = self._tool_calls(c.echo + text, out)
            shaped.append(self._choice(c.index, content, finish, self._token_logprobs(entries, len(c.echo)), False,
                                       calls))
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": shaped,
                "usage": self._usage(choices, [o for _, o, _ in parts]),
                "lorazor": self._extension([o for _, o, _ in parts])}
        return body

    async def _collect(self, choice: Choice, stream):
        text, out, entries = "", None, []
        async for delta, out, pending in self.deltas(choice, stream):
            text += delta
            entries += pending
        return text, out, entries

    async def streamed(self, choices: list[Choice]) -> StreamingResponse:
        """Server-sent events: chunks as tokens arrive, an error event if the request fails, `[DONE]`."""
        streams = await self.start(choices)
        return StreamingResponse(self._events(choices, streams), media_type="text/event-stream")

    def _chunk(self, choices: list[dict], **extra) -> str:
        body = {"id": self.id, "object": f"{self.object}.chunk" if self.chat else self.object,
                "created": self.created, "model": self.model, "choices": choices, **extra}
        if self.include_usage and "usage" not in body:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    async def _events(self, choices: list[Choice], streams):
        finished = {}
        offsets = {c.index: len(c.echo) for c in choices}
        held = {c.index: "" for c in choices}  # with tools: the text, sent once it is known to be no call
        try:
            for choice in choices:
                if choice.echo:
                    yield self._chunk([self._choice(choice.index, choice.echo, None, None, True)])
            async for choice, (delta, out, pending) in _merged(
                    [self.deltas(c, s) for c, s in zip(choices, streams)], choices):
                if (err := self._failure(out)) is not None:
                    raise err
                finish = FINISH_REASONS[out.finish_reason] if out.finished else None
                extra = {}
                if out.finished:
                    finished[choice.index] = out
                    extra["lorazor"] = self._extension([out])
                logprobs = self._token_logprobs(pending, offsets[choice.index])
                offsets[choice.index] += len(delta)
                calls = None
                if self.tools is not None:  # whether the text is a call is known at the end
                    held[choice.index] += delta
                    if not out.finished:
                        continue
                    delta, calls, finish = self._tool_calls(held[choice.index], out)
                yield self._chunk([self._choice(choice.index, delta, finish, logprobs, True, calls)], **extra)
            if self.include_usage:
                yield self._chunk([], usage=self._usage(choices, [finished[c.index] for c in choices]))
        except Exception as err:  # after the 200 went out: an error event, as OpenAI's streams send one
            if isinstance(err, ApiError):
                failure = err
            elif isinstance(err, EngineDeadError):
                failure = ApiError(503, str(err), kind="service_unavailable")
            else:
                log.exception("stream %s failed", self.id)
                failure = ApiError(500, f"internal error ({type(err).__name__}); the server logged the details",
                                   kind="server_error")
            yield f"data: {json.dumps(failure.body())}\n\n"
        yield "data: [DONE]\n\n"


async def _merged(generators, choices):
    """(choice, item) from several async generators as each produces; one generator runs inline."""
    if len(generators) == 1:
        async for item in generators[0]:
            yield choices[0], item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice, generator):
        try:
            async for item in generator:
                await queue.put((choice, item))
            await queue.put((choice, done))
        except BaseException as err:  # handed to the consumer, which stops everything
            await queue.put((choice, err))

    tasks = [asyncio.create_task(pump(c, g)) for c, g in zip(choices, generators)]
    try:
        remaining = len(tasks)
        while remaining:
            choice, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
