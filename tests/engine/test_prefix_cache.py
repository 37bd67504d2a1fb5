"""Prefix caching: cache on equals cache off, token for token (fp32), and hits only where the same
tokens were computed by the same weights: the same adapter (by name and weights digest) or the
backbone, never StepTrim's released tokens."""

import pytest
import torch
from helpers import PAD, build_pair
from lorazor import LoRazorConfig, LoRazorEngine
from lorazor.engine.blocks import BACKBONE, BlockPool, adapter_identity, block_hashes

GEN = dict(pad_token_id=PAD, eos_token_id=None, do_sample=False)
BS = 4


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama", LoRazorConfig(cuda_graphs=False))


def engine(model, caching=True, **kw):
    return LoRazorEngine(model, **{"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 128,
                                   "block_size": BS, "enable_prefix_caching": caching, **kw})


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (n,), generator=g).tolist()


def finish(eng, ids):
    """Step `eng` until every request of `ids` finished; their outputs in order."""
    done = {}
    while not all(i in done for i in ids):
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[i] for i in ids]


def run(eng, requests):
    return finish(eng, [eng.add_request(**r) for r in requests])


def wave(system, seed, n=6):
    """Requests of three adapters and the backbone, each adapter with its own system prompt."""
    out = []
    for i, adapter in enumerate(["math", "sql", None, "med", "math", "sql"][:n]):
        prompt = system[adapter] + tokens(3 + (seed + i) % 5, seed * 10 + i)
        out.append(dict(prompt_ids=prompt, adapter=adapter, max_new_tokens=5 + i % 3, **GEN))
    return out


SYSTEMS = {a: tokens(13, 100 + k) for k, a in enumerate(["math", "sql", None, "med"])}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["step_by_step", "async"])
def test_two_waves_equal_the_cache_off_engine_and_hit_their_own_prefix(pair, async_scheduling):
    model, _ = pair
    on, off = engine(model, async_scheduling=async_scheduling), engine(model, caching=False)
    for seed in (1, 2):
        requests = wave(SYSTEMS, seed)
        got, want = run(on, requests), run(off, requests)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        if seed == 2:  # the second wave finds each system prompt's 3 full blocks (12 of 13 tokens)
            assert [o.num_cached_tokens for o in got] == [12] * len(requests)
    assert all(o.num_cached_tokens == 0 for o in run(off, wave(SYSTEMS, 3)))
    assert on.pool.hits > 0 and off.pool.hits == 0
    assert on.pool.num_free == on.pool.num_blocks  # cached blocks nobody holds count as free


def test_another_adapter_or_the_backbone_never_hits_an_adapters_prefix(pair):
    model, _ = pair
    eng = engine(model)
    prefix = tokens(16, 7)
    first = run(eng, [dict(prompt_ids=prefix + [5, 6], adapter="math", max_new_tokens=3, **GEN)])[0]
    assert first.num_cached_tokens == 0
    others = run(eng, [dict(prompt_ids=prefix + [9], adapter=a, max_new_tokens=3, **GEN) for a in ("sql", None)])
    assert [o.num_cached_tokens for o in others] == [0, 0]
    again = run(eng, [dict(prompt_ids=prefix + [7, 7, 7], adapter="math", max_new_tokens=3, **GEN)])[0]
    assert again.num_cached_tokens == 16
    # A prompt that is exactly the cached blocks still computes its last token (its logits).
    exact = run(eng, [dict(prompt_ids=prefix, adapter="math", max_new_tokens=3, **GEN)])[0]
    assert exact.num_cached_tokens == 12
    assert exact.token_ids == run(engine(model, caching=False),
                                  [dict(prompt_ids=prefix, adapter="math", max_new_tokens=3, **GEN)])[0].token_ids


def test_the_same_name_with_other_weights_never_reuses_the_old_blocks(pair, tmp_path):
    model, oracle = pair
    oracle.save_pretrained(tmp_path, selected_adapters=["sql", "med"])
    prompt = tokens(17, 11)
    request = dict(prompt_ids=prompt, adapter="swap", max_new_tokens=6, **GEN)
    eng = engine(model)
    model.register_adapter("swap", tmp_path / "sql")
    try:
        as_sql = run(eng, [request])[0]
        assert run(eng, [request])[0].num_cached_tokens == 16  # the same weights: hits
        model.unregister_adapter("swap")
        model.register_adapter("swap", tmp_path / "med")
        as_med = run(eng, [request])[0]
        assert as_med.num_cached_tokens == 0
        assert as_med.token_ids == run(engine(model, caching=False), [dict(request, adapter="med")])[0].token_ids
        assert as_med.token_ids != as_sql.token_ids  # the weights differ (else the test shows nothing)
        model.unregister_adapter("swap")
        model.register_adapter("swap", tmp_path / "sql")  # the old weights again: their blocks again
        assert run(eng, [request])[0].num_cached_tokens == 16
    finally:
        model.unregister_adapter("swap")


def test_a_second_turn_never_reuses_tokens_computed_after_the_release(pair):
    """Turn 1 releases its adapter after 2 decode steps: positions up to prompt + 2 were computed
    with the adapter, the rest by the backbone. Turn 2 resends turn 1's prompt and output; only the
    blocks before the release point may serve it."""
    model, _ = pair
    eng, off = engine(model), engine(model, caching=False)
    prompt = tokens(7, 21)
    turn1 = dict(prompt_ids=prompt, adapter="math", max_new_tokens=10, release=2, **GEN)
    first = run(eng, [turn1])[0]
    assert first.release_step == 2 and first.token_ids == run(off, [turn1])[0].token_ids
    turn2 = dict(prompt_ids=prompt + first.token_ids + tokens(5, 22), adapter="math", max_new_tokens=6, **GEN)
    second = run(eng, [turn2])[0]
    # Positions 0..8 used the adapter (prompt 7 + decode forwards 0 and 1): full blocks 0-3, 4-7.
    assert second.num_cached_tokens == 8
    assert second.token_ids == run(off, [turn2])[0].token_ids
    # Without a release the whole first turn is reusable.
    kept = run(eng, [dict(turn1, release="never")])[0]
    third = run(eng, [dict(turn2, prompt_ids=prompt + kept.token_ids + tokens(5, 22))])[0]
    assert third.num_cached_tokens == (len(prompt) + len(kept.token_ids)) // BS * BS


def test_a_small_pool_evicts_cached_blocks_to_admit_a_long_prompt(pair):
    model, _ = pair
    eng, off = engine(model, num_kv_blocks=20), engine(model, caching=False, num_kv_blocks=20)
    small = [dict(prompt_ids=tokens(9, 30 + i), adapter=a, max_new_tokens=4, **GEN)
             for i, a in enumerate(["math", "sql", None, "med"])]
    run(eng, small)
    assert eng.pool.num_cached > 0 and eng.pool.num_free == eng.pool.num_blocks
    long = dict(prompt_ids=tokens(70, 40), adapter="sql", max_new_tokens=6, **GEN)  # 19 of the 20 blocks
    assert run(eng, [long])[0].token_ids == run(off, [long])[0].token_ids
    assert run(eng, small[:1])[0].num_cached_tokens == 0  # its blocks were evicted for the long one
    assert eng.pool.num_free == eng.pool.num_blocks


def test_preemption_with_shared_blocks_equals_cache_off(pair):
    model, _ = pair
    shared = tokens(12, 50)
    requests = [dict(prompt_ids=shared + tokens(4 + i, 60 + i), adapter="math" if i % 2 else None,
                     max_new_tokens=14, **GEN) for i in range(6)]
    eng, off = engine(model, num_kv_blocks=24), engine(model, caching=False, num_kv_blocks=24)
    warm = run(eng, [dict(requests[0], max_new_tokens=1), dict(requests[1], max_new_tokens=1)])
    assert [o.num_cached_tokens for o in warm] == [0, 0]
    got = run(eng, requests)
    assert eng.scheduler.num_preemptions > 0  # the pool is too small for all six at once
    assert [o.token_ids for o in got] == [o.token_ids for o in run(off, requests)]
    assert [o.num_cached_tokens for o in got[:2]] == [12, 16]  # the warm-up computed 16 and 17 prompt tokens
    assert eng.pool.num_free == eng.pool.num_blocks


def test_aborting_a_request_whose_blocks_are_shared_leaves_the_others_intact(pair):
    model, _ = pair
    shared = tokens(16, 70)
    eng, off = engine(model), engine(model, caching=False)
    run(eng, [dict(prompt_ids=shared + [3], adapter="sql", max_new_tokens=1, **GEN)])
    a = eng.add_request(shared + [4, 5], adapter="sql", max_new_tokens=12, **GEN)
    b = eng.add_request(shared + [6], adapter="sql", max_new_tokens=12, **GEN)
    for _ in range(3):
        eng.step()
    shared_block = eng.requests[a].block_table[0]
    assert shared_block == eng.requests[b].block_table[0] and eng.pool.refs[shared_block] == 2
    assert eng.abort(a).finish_reason == "abort"
    assert eng.pool.refs[shared_block] == 1
    rest = finish(eng, [b])[0]
    assert rest.num_cached_tokens == 16
    assert rest.token_ids == run(off, [dict(prompt_ids=shared + [6], adapter="sql", max_new_tokens=12, **GEN)]
                                 )[0].token_ids
    assert eng.pool.num_free == eng.pool.num_blocks


def test_the_block_pool_counts_references_and_evicts_least_recently_freed():
    pool = BlockPool(4, 2)
    ident = adapter_identity("a", b"digest")
    hashes = block_hashes([], [1, 2, 3, 4, 5], 2, ident, 2)
    assert hashes != block_hashes([], [1, 2, 3, 4, 5], 2, BACKBONE, 2)  # identity is part of the key
    assert hashes[0] != block_hashes([], [1, 2], 2, adapter_identity("a", b"other"), 1)[0]
    t1 = []
    assert pool.allocate(t1, [], 5) and t1 == [0, 1, 2]
    for block, h in zip(t1, hashes):
        pool.cache(block, h)
    pool.free(t1)
    assert pool.num_free == 4 and pool.lookup(hashes) == [0, 1]
    t2 = []
    assert pool.allocate(t2, pool.lookup(hashes), 6)  # both hits, then one fresh block
    assert t2[:2] == [0, 1] and pool.refs[0] == 1 and pool.num_free == 1
    t3 = []
    assert not pool.allocate(t3, pool.lookup(hashes), 8) and t3 == []  # too few blocks: nothing changes
    assert pool.refs[0] == 1 and pool.num_free == 1
    assert pool.allocate(t3, pool.lookup(hashes), 6)  # shared hits and the last free block
    assert pool.refs[0] == 2 and pool.refs[1] == 2 and pool.num_free == 0
    pool.free(t2)
    pool.free(t3)
    assert pool.num_free == 4 and pool.refs == [0, 0, 0, 0]
    t4 = []
    pool.allocate(t4, [], 4)  # uncached blocks go first; cached ones are evicted last
    assert set(t4) == {2, 3} and pool.lookup(hashes) == [0, 1]
    t5 = []
    pool.allocate(t5, [], 2)  # now a cached block must be evicted: its hash goes
    assert pool.lookup(hashes) != [0, 1]
    off = BlockPool(4, 2, enable_caching=False)
    off.cache(0, hashes[0])
    assert off.lookup(hashes) == []
