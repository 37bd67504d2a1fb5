"""The rows that carry the engine process's outputs to the server: named fields, every one of them."""

import dataclasses
import pickle

from lorazor.engine import RequestOutput, TokenPrefix
from lorazor.engine.process import pack, unpack


def test_a_row_carries_every_output_field_by_name_and_the_tokens_are_rebuilt():
    fields = [f.name for f in dataclasses.fields(RequestOutput)]
    values = dict(request_id="r", new_token_ids=[7, 8], finished=True, finish_reason="stop", release_step=3,
                  decode_steps=5, lora_decode_steps=3, arrival_time=1.0, first_token_time=1.5, finish_time=2.0,
                  error="e", new_logprobs=[(-0.1, [(7, -0.1)])], scheduled_time=1.2, num_cached_tokens=16)
    assert set(values) | {"tokens"} == set(fields)  # a new field must be added here (and then travels)
    row = pickle.loads(pickle.dumps(pack(RequestOutput(tokens=TokenPrefix([5, 6, 7, 8]), **values))))
    assert isinstance(row, dict) and "tokens" not in row
    received = [5, 6]  # what the server had of this request before this row
    out = unpack(row, received)
    assert out.token_ids == [5, 6, 7, 8] and received == [5, 6, 7, 8]
    assert {k: getattr(out, k) for k in values} == values


def test_both_engine_kinds_implement_the_engine_client_the_routes_use():
    """`ServerState.engine` is an `EngineClient`: the in-process engine and the engine process both
    provide each of its members (a member one of them lacks fails here, not in a route)."""
    import inspect

    from lorazor.engine import EngineProcess

    from lorazor.serve.engines import EngineClient, LocalEngine

    members = [n for n in dir(EngineClient) if not n.startswith("_")] + list(EngineClient.__annotations__)
    for kind in (LocalEngine, EngineProcess):
        source = inspect.getsource(kind)  # members set on the instance (`self.info = ...`) count too
        missing = [n for n in members if not hasattr(kind, n) and f"self.{n}" not in source]
        assert not missing, (kind, missing)
        for name in ("generate", "register_adapter", "unregister_adapter", "stats", "shutdown"):
            wanted = list(inspect.signature(getattr(EngineClient, name)).parameters)
            assert list(inspect.signature(getattr(kind, name)).parameters)[:len(wanted)] == wanted, (kind, name)


def test_shutdown_of_a_process_that_died_unseen_ends_quietly():
    """The engine process died and the reader thread has not seen it yet (`_dead` still unset): the
    stop message's broken pipe marks it dead and shutdown ends without raising (the app's shutdown
    once failed on this race: a BrokenPipeError turned EngineDeadError)."""
    import asyncio
    import multiprocessing
    import threading
    import types

    from lorazor.engine import EngineProcess

    recv_end, send_end = multiprocessing.Pipe(duplex=False)
    recv_end.close()  # the process's end is gone: a send breaks the pipe
    engine = EngineProcess.__new__(EngineProcess)  # no process started: the state of one that died
    joined = []
    engine.process = types.SimpleNamespace(exitcode=-9, join=lambda timeout: joined.append(timeout),
                                           is_alive=lambda: False, kill=lambda: None)
    engine._send_end, engine._send_lock, engine._dead = send_end, threading.Lock(), None
    engine._streams, engine._replies, engine.on_dead = {}, {}, []

    async def shutdown():
        engine._stopped = asyncio.get_running_loop().create_future()
        return await engine.shutdown(timeout=5)

    assert asyncio.run(shutdown()) == 0
    assert joined and not engine.alive and "exited (code -9)" in str(engine._dead)
