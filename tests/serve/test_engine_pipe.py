"""The rows that carry the engine process's outputs to the server: named fields, every one of them."""

import dataclasses
import pickle

from lorazor.engine import RequestOutput, TokenPrefix
from lorazor.serve.engine_process import pack, unpack


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
