"""`LoRazorEngine.stream` and its background loop: steps on one thread, calls between steps, merged
outputs for slow consumers, aborts, failures and shutdown."""

import asyncio
import contextlib

import pytest
from helpers import build_pair
from lorazor import LoRazorConfig
from test_engine import ADAPTERS, GEN, engine, peft_tokens, prompts


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama", LoRazorConfig(cuda_graphs=False))


async def collect(stream, delay: float = 0.0):
    """Every output of a stream; `delay` seconds of "client work" after each."""
    outs = []
    async for out in stream:
        outs.append(out)
        await asyncio.sleep(delay)
    return outs


def test_slow_consumer_gets_merged_outputs_and_every_token(pair):
    model, oracle = pair
    eng = engine(model)
    ps = prompts(4, seed=21)

    async def slow(stream):
        """Read one output, then nothing until the request has finished in the engine: everything
        after the first output must come as one merged output."""
        outs = [await stream.__anext__()]
        while outs[0].request_id in eng.requests:
            await eng.background.call(lambda: None)
        await eng.background.call(lambda: None)  # the last step's outputs are delivered before this returns
        outs += [out async for out in stream]
        return outs

    async def run():
        fast = [collect(eng.stream(p, adapter=a, max_new_tokens=12, **GEN)) for p, a in zip(ps[:3], ADAPTERS)]
        return await asyncio.gather(*fast, slow(eng.stream(ps[3], adapter="med", max_new_tokens=12, **GEN)))

    results = asyncio.run(run())
    for outs, p, a in zip(results, ps, ADAPTERS[:3] + ["med"]):
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == peft_tokens(oracle, p, a, 12)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert len(results[3]) == 2  # 12 tokens in two outputs: the backlog came as one
    assert eng.pool.num_free == eng.pool.num_blocks


def test_bad_input_raises_at_the_call_and_queues_nothing(pair):
    model, _ = pair
    eng = engine(model)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.stream([], adapter="math", max_new_tokens=3, **GEN)
    with pytest.raises(KeyError, match="unknown adapter 'nope'"):
        eng.stream([5, 6], adapter="nope", max_new_tokens=3, **GEN)
    assert not eng.requests


def test_consumer_that_leaves_aborts_and_frees_blocks(pair):
    model, _ = pair
    eng = engine(model)

    async def run():
        async with contextlib.aclosing(eng.stream(prompts(1)[0], adapter="sql", max_new_tokens=50, **GEN)) as stream:
            async for out in stream:
                break  # the client went away after its first token: closing the stream aborts it
        await eng.background.call(lambda: None)  # the abort was queued first (calls run in order)
        return out

    first = asyncio.run(run())
    assert not first.finished
    assert not eng.requests and eng.pool.num_free == eng.pool.num_blocks
    assert model.registry.in_use["sql"] == 0


def test_failed_step_ends_every_stream_and_the_engine_serves_on(pair, monkeypatch):
    model, oracle = pair
    eng = engine(model)
    real_step, calls = eng.step, []

    def step_that_fails_once():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(eng, "step", step_that_fails_once)
    ps = prompts(3, seed=5)

    async def run(batch):
        return await asyncio.gather(*(collect(eng.stream(p, adapter=a, max_new_tokens=6, **GEN))
                                      for p, a in zip(ps, batch)))

    failed = asyncio.run(run(ADAPTERS[:3]))
    assert all(outs[-1].finished and outs[-1].finish_reason == "abort" for outs in failed)
    assert eng.pool.num_free == eng.pool.num_blocks
    again = asyncio.run(run(ADAPTERS[:3]))
    assert [outs[-1].token_ids for outs in again] == [peft_tokens(oracle, p, a, 6) for p, a in zip(ps, ADAPTERS)]


def test_stop_aborts_in_flight_streams(pair):
    model, _ = pair
    eng = engine(model)

    async def run():
        task = asyncio.ensure_future(collect(eng.stream(prompts(1)[0], adapter="math", max_new_tokens=60, **GEN)))
        while not eng.requests:
            await asyncio.sleep(0.005)
        aborted = await eng.background.call(eng.background.abort_all)
        eng.background.stop(abort=False)
        return aborted, await task

    aborted, outs = asyncio.run(run())
    assert aborted == 1 and outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) < 60
    assert eng.pool.num_free == eng.pool.num_blocks


def test_two_streams_with_one_request_id(pair):
    """The second stream is refused and the first one, already running, keeps its outputs."""
    model, oracle = pair
    eng = engine(model)
    p = prompts(1, seed=8)[0]

    async def run():
        first = eng.stream(p, adapter="math", max_new_tokens=6, request_id="same", **GEN)
        second = eng.stream(p, adapter="sql", max_new_tokens=6, request_id="same", **GEN)
        got = asyncio.ensure_future(collect(first))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="request_id 'same' is already in use"):
            await collect(second)
        return await got

    outs = asyncio.run(asyncio.wait_for(run(), 60))  # before the fix, the first stream lost its queue and hung
    assert outs[-1].token_ids == peft_tokens(oracle, p, "math", 6)
