"""Parity sweep against PEFT over target sets, rank mixes, merged/per-module and both CPU backends.

Each adapter under test shares the bank with an all-module adapter, so merged groups (q/k/v,
gate/up) always exist and the adapter under test may target only some of a group's members. A
row whose adapter is silently dropped differs from PEFT by the adapter's whole effect.
"""

import pytest
import torch
from helpers import build_pair, make_batch, peft_names
from lorazor import LoRazorConfig
from lorazor.tiny import AdapterSpec

EVERY = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = {
    "all": EVERY,
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "v_only": ("v_proj",),
    "up_down": ("up_proj", "down_proj"),
}
ROWS = ["y", "x", None, "y"]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("merged", [True, False], ids=["merged", "per_module"])
@pytest.mark.parametrize("ranks", ["same", "mixed"])
@pytest.mark.parametrize("targets", list(TARGETS))
def test_forward_matches_peft(targets, ranks, merged, backend):
    y_rank = 8 if ranks == "same" else 4
    adapters = (AdapterSpec("x", 8, 16, EVERY), AdapterSpec("y", y_rank, 12, TARGETS[targets]))
    config = LoRazorConfig(backend=backend, merge_projections=merged, cuda_graphs=False)
    model, oracle = build_pair("llama", config, adapters=adapters)
    ids, mask = make_batch(len(ROWS), 5, seed=3, pad_rows=(3,))
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, adapter_names=peft_names(ROWS)).logits
        base = oracle(input_ids=ids, attention_mask=mask, adapter_names=peft_names([None] * len(ROWS))).logits
    out = model(ids, mask, ROWS)
    real = mask.bool()
    # The adapter must change the logits (else the comparison below proves nothing) ...
    assert (ref[0][real[0]] - base[0][real[0]]).abs().max() > 1e-2
    # ... and LoRazor must apply exactly that change on every row.
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)


def test_removing_an_adapter_of_another_rank_keeps_the_others_exact():
    # With z (rank 4) the bank mixes ranks and merged groups take the per-module path; once z is
    # removed every slot is rank 0 or 8 and the merged path runs, where y (v only) must still count.
    adapters = (
        AdapterSpec("x", 8, 16, EVERY),
        AdapterSpec("y", 8, 12, ("v_proj",)),
        AdapterSpec("z", 4, 8, ("q_proj",)),
    )
    model, oracle = build_pair("llama", LoRazorConfig(backend="reference"), adapters=adapters)
    ids, mask = make_batch(3, 5, seed=4)
    rows = ["y", "x", None]
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, adapter_names=peft_names(rows)).logits
    torch.testing.assert_close(model(ids, mask, rows), ref, atol=1e-5, rtol=1e-5)
    model.remove_adapter("z")
    torch.testing.assert_close(model(ids, mask, rows), ref, atol=1e-5, rtol=1e-5)
    assert any(group.ran_merged for group in model.merged_groups)
