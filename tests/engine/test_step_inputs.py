"""`prepare`: a step's host lists, checked token by token against their definitions on random
chunks (starting mid-block, crossing blocks, running from the prompt into recomputed decode
positions, released and never-released requests, backbone rows)."""

import random
from types import SimpleNamespace

import pytest
from lorazor.engine.request import Request
from lorazor.engine.scheduler import Chunk
from lorazor.engine.step_inputs import TableRows, prepare
from lorazor.runner.block_tables import BlockTables

PAGE = 16


def reference(request, start, n):
    """Per token: (id, position, adapter name or None, pool position), from the definitions."""
    out = []
    for p in range(start, start + n):
        decode = p - len(request.prompt)
        uses = request.adapter is not None and (decode < 0 or request.release_step < 0 or decode < request.release_step)
        out.append((request.tokens[p], p, request.adapter if uses else None,
                    request.block_table[p // PAGE] * PAGE + p % PAGE))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_prepared_lists_equal_their_token_by_token_definitions(seed):
    rng = random.Random(seed)
    plan = SimpleNamespace(max_new_tokens=1000)
    names = ["a", "b", "c"]
    registry = SimpleNamespace(make_resident=lambda distinct: None,
                               bank=SimpleNamespace(slot_of={"a": 0, "b": 3, "c": 5}))
    tables = TableRows(8)
    free_blocks = list(range(500))
    rng.shuffle(free_blocks)
    chunks, expected = [], []
    for i in range(8):
        prompt = [rng.randrange(3, 90) for _ in range(rng.randrange(1, 70))]
        request = Request(f"r{i}", prompt, rng.choice(names + [None]), plan)
        request.output = [rng.randrange(3, 90) for _ in range(rng.randrange(0, 40))]
        request.tokens = prompt + request.output
        request.release_step = rng.choice([-1, 0, 3, 10])
        total = len(request.tokens)
        request.block_table = [free_blocks.pop() for _ in range(-(-total // PAGE))]
        start = rng.randrange(0, total)
        n = 1 if rng.random() < 0.3 else rng.randrange(1, total - start + 1)
        chunks.append(Chunk(request, start, n))
        expected += reference(request, start, n)
    inputs = prepare(registry, PAGE, tables, chunks)
    slot_of = registry.bank.slot_of
    assert inputs.ids == [e[0] for e in expected]
    assert inputs.positions == [e[1] for e in expected]
    assert inputs.slots == [-1 if e[2] is None else slot_of[e[2]] for e in expected]
    assert inputs.slot_mapping == [e[3] for e in expected]
    assert inputs.num_adapters == len({e[2] for e in expected} - {None})
    ends = [sum(c.num_tokens for c in chunks[:k + 1]) - 1 for k in range(len(chunks))]
    assert inputs.last == ends
    assert [c[1:] for c in inputs.chunks] == [(c.start, c.num_tokens) for c in chunks]
    assert inputs.decode_only == all(c.num_tokens == 1 for c in chunks)
    # The table cells the step hands the runner give each request's row exactly its block table.
    device_tables = BlockTables(8, 64, 999, "cpu")
    device_tables.write(inputs.table_writes)
    for chunk, (row, _, _) in zip(chunks, inputs.chunks):
        table = chunk.request.block_table
        assert device_tables.upload()[row, :len(table)].tolist() == table
    # A request that gains a block hands over that cell alone.
    request = chunks[0].request
    request.block_table.append(free_blocks.pop())
    again = prepare(registry, PAGE, tables, [Chunk(request, request.num_tokens - 1, 1)])
    assert again.table_writes == [(request.table_row, len(request.block_table) - 1, request.block_table[-1:])]
