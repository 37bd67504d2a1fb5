"""StepTrim release policies against PEFT-built references that switch rows to the backbone."""

import pytest
import torch
from conftest import DEVICE
from helpers import PAD, build_pair, make_batch, peft_names
from lorazor import LearnedRelease, ProfiledRelease
from lorazor.policies import ReleasePolicy

ADAPTERS = ["math", "sql", None, "med", "math", "sql"]
NEW = 10


def peft_release_reference(oracle, ids, mask, adapters, ks, max_new=NEW):
    """Greedy decode with PEFT: row i uses its adapter in prefill and decode forwards d < ks[i]."""
    names = peft_names(adapters)
    tokens, mask = ids.clone(), mask.clone()
    pos = mask.long().cumsum(-1) - 1
    with torch.no_grad():
        out = oracle(input_ids=ids, attention_mask=mask, position_ids=pos.clamp(min=0), adapter_names=names,
                     use_cache=True)
        cache, last_pos = out.past_key_values, pos[:, -1]
        for d in range(max_new):
            tok = out.logits[:, -1].argmax(-1)
            tokens = torch.cat([tokens, tok[:, None]], 1)
            if d == max_new - 1:
                break
            step_names = [n if (k is None or d < k) else "__base__" for n, k in zip(names, ks)]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            last_pos = last_pos + 1
            out = oracle(input_ids=tok[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                         past_key_values=cache, adapter_names=step_names, use_cache=True)
            cache = out.past_key_values
    return tokens


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama")


@pytest.fixture(scope="module")
def batch():
    return make_batch(6, 5, seed=21, pad_rows=(1, 4))


def generate(model, batch, **kw):
    ids, mask = batch
    return model.generate(ids, attention_mask=mask, adapter_ids=ADAPTERS, max_new_tokens=NEW, pad_token_id=PAD,
                          eos_token_id=None, **kw)


def test_reference_differs_between_full_and_prefill_only(pair, batch):
    # Guards the other tests: release must visibly change tokens on this batch.
    _, oracle = pair
    full = peft_release_reference(oracle, *batch, ADAPTERS, [None] * 6)
    prefill_only = peft_release_reference(oracle, *batch, ADAPTERS, [0] * 6)
    assert not torch.equal(full, prefill_only)


@pytest.mark.parametrize(
    "k, release_steps, skip",
    [
        (None, [-1] * 6, 0.0),  # never release: full LoRA
        (0, [0, 0, -1, 0, 0, 0], 1.0),  # prefill only
        (3, [3, 3, -1, 3, 3, 3], 6 / 9),  # 9 decode forwards per row, 3 with LoRA (paper A.4 weighting)
    ],
    ids=["k=None is full LoRA", "k=0 is prefill-only", "k=3 switches after three decode steps"],
)
def test_one_release_length_for_every_adapter(pair, batch, k, release_steps, skip):
    model, oracle = pair
    out = generate(model, batch, release_policy=ProfiledRelease({"math": k, "sql": k, "med": k}))
    assert torch.equal(out.sequences, peft_release_reference(oracle, *batch, ADAPTERS, [k] * 6))
    assert out.release_steps.tolist() == release_steps
    assert out.skip_fraction == pytest.approx(skip)


def test_different_k_per_adapter(pair, batch):
    model, oracle = pair
    policy = ProfiledRelease({"math": 2, "sql": 0, "med": None})
    out = generate(model, batch, release_policy=policy)
    ks = [2, 0, None, None, 2, 0]
    assert torch.equal(out.sequences, peft_release_reference(oracle, *batch, ADAPTERS, ks))


def test_per_request_override(pair, batch):
    model, oracle = pair
    overrides = ["never", 4, None, 0, None, "never"]
    out = generate(model, batch, release_policy=ProfiledRelease({"math": 1, "sql": 1, "med": 1}), release=overrides)
    ks = [None, 4, None, 0, 1, None]
    assert torch.equal(out.sequences, peft_release_reference(oracle, *batch, ADAPTERS, ks))


def _heads(model, tau, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = model.model.config.hidden_size
    return {n: (torch.randn(hidden, generator=g), 0.0, tau) for n in model.adapter_names}


@pytest.mark.parametrize("tau, ks", [(float("-inf"), [None] * 6), (float("inf"), [0] * 6)],
                         ids=["tau=-inf is full LoRA", "tau=+inf is prefill-only"])
def test_learned_tau_extremes(pair, batch, tau, ks):
    model, oracle = pair
    out = generate(model, batch, release_policy=LearnedRelease(_heads(model, tau)))
    assert torch.equal(out.sequences, peft_release_reference(oracle, *batch, ADAPTERS, ks))


class Recording(ReleasePolicy):
    """Wraps a policy and records, per step, its raw decision and the rows still holding adapters."""

    def __init__(self, inner):
        self.inner, self.decisions, self.active = inner, [], []

    def bind(self, *args):
        self.inner.bind(*args)

    def keep(self, step, hidden, state):
        keep = self.inner.keep(step, hidden, state)
        self.decisions.append(keep.clone())
        self.active.append(state.active.clone())
        return keep


def test_learned_release_is_one_way_and_matches_its_release_steps(pair, batch):
    model, oracle = pair
    # tau = 0 on random heads: scores cross the threshold back and forth between steps.
    rec = Recording(LearnedRelease(_heads(model, 0.0, seed=3)))
    out = generate(model, batch, release_policy=rec)
    decisions = torch.stack(rec.decisions)
    assert (decisions[1:] & ~decisions[:-1]).any(), "the test needs a policy that says 'keep' after 'release'"
    active = torch.stack(rec.active).int()
    assert torch.all(active[1:] <= active[:-1]), "a released row got its adapter back"
    ks = [None if (k < 0 or a is None) else k for k, a in zip(out.release_steps.tolist(), ADAPTERS)]
    assert any(k is not None for k in ks)
    assert torch.equal(out.sequences, peft_release_reference(oracle, *batch, ADAPTERS, ks))


def test_learned_heads_are_one_batched_gather(pair):
    model, _ = pair
    heads = _heads(model, 0.0, seed=1)
    policy = LearnedRelease(heads)
    policy.bind(model.adapter_names, model.bank.num_slots, torch.device("cpu"))
    h = torch.randn(4, model.model.config.hidden_size)
    slot = torch.tensor([0, 2, -1, 1], dtype=torch.int32)
    policy.bind(model.adapter_names, model.bank.num_slots, h.device)
    scores = policy.scores(h, slot)
    names = model.adapter_names
    expected = [h[0] @ heads[names[0]][0], h[1] @ heads[names[2]][0], 0.0, h[3] @ heads[names[1]][0]]
    torch.testing.assert_close(scores, torch.tensor(expected))


def test_bad_policy_arguments(pair, batch):
    model, _ = pair
    with pytest.raises(ValueError,
                       match=r"release length for adapter 'math' must be None or an int in \[0, 2147483647\], got -1"):
        ProfiledRelease({"math": -1})
    with pytest.raises(KeyError, match="unknown adapters \\['physics'\\]"):
        generate(model, batch, release_policy=ProfiledRelease({"physics": 1}))
    with pytest.raises(ValueError,
                       match=r"release\[1\] must be None, 'never' or an int in \[0, 2147483647\], got 'soon'"):
        generate(model, batch, release_policy=ProfiledRelease({}), release=[None, "soon", None, None, None, None])


def test_policies_save_and_load_beside_adapters(pair, batch, tmp_path):
    from lorazor import LoRazorConfig, load_release_policy, save_release_policy

    model, oracle = pair
    profiled = ProfiledRelease({"math": 2, "sql": 0, "med": None})
    save_release_policy(profiled, tmp_path / "p")
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["math", "med", "sql"]
    loaded = load_release_policy(tmp_path / "p")
    assert loaded.lengths == profiled.lengths
    learned = LearnedRelease(_heads(model, 0.0, seed=3))
    save_release_policy(learned, tmp_path / "l")
    assert not list((tmp_path / "l").rglob("*.pt")) and not list((tmp_path / "l").rglob("*.bin"))
    again = load_release_policy(tmp_path / "l")
    a = generate(model, batch, release_policy=learned)
    b = generate(model, batch, release_policy=again)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.release_steps, b.release_steps)
    # A loaded policy becomes the model's default when the config asks for release.
    model.config = LoRazorConfig(release="profiled")
    try:
        model.load_release_policy(tmp_path / "p")
        out = generate(model, batch)
        ks = [2, 0, None, None, 2, 0]
        assert torch.equal(out.sequences, peft_release_reference(oracle, *batch, ADAPTERS, ks))
    finally:
        model.config = LoRazorConfig()
        model.release_policy = None


def test_loading_a_missing_policy_names_the_path(tmp_path):
    from lorazor import load_release_policy

    with pytest.raises(FileNotFoundError, match="no \\*/release_policy.json under"):
        load_release_policy(tmp_path)


@pytest.mark.parametrize("with_policy", [False, True], ids=["overrides_only", "policy"])
def test_compiled_release_decision_matches_eager(with_policy):
    # The compiled decode step applies StepTrim's one-way decision through torch.compile: it must
    # release the same rows at the same steps as the eager ops, with int and 0-d tensor steps.
    from lorazor.policies.base import ReleaseState

    g = torch.Generator().manual_seed(3)
    B = 11
    slot = torch.randint(-1, 4, (B,), generator=g).to(DEVICE)
    overrides = [None, 2, "never", None, 0, None, 5, None, None, 1, None]
    states = [ReleaseState.create(slot.clone(), overrides) for _ in range(2)]
    for step in range(7):
        keep = (torch.rand(B, generator=g) < 0.8).to(DEVICE) if with_policy else None
        at = torch.tensor(step, device=DEVICE) if step % 2 else step
        maps = [state.advance(at, keep, compiled=compiled) for state, compiled in zip(states, (False, True))]
        assert torch.equal(maps[0], maps[1]), step
        for field in ("active", "release_step"):
            assert torch.equal(getattr(states[0], field), getattr(states[1], field)), (step, field)
    assert (states[1].release_step >= 0).any() and states[1].active.any()  # some released, some kept
