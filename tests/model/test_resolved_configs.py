"""The engine resolves each request's generation settings once per distinct settings
(`ResolvedConfigs`): what it hands out must equal HF's own resolution every time, and follow the
model's configs when they change."""

import pytest
import torch
from lorazor.model.hf_generation import ResolvedConfigs, resolve_config
from lorazor.tiny import tiny_config
from transformers import AutoModelForCausalLM

SETTINGS = [
    dict(max_new_tokens=5, pad_token_id=0),
    dict(max_new_tokens=5, do_sample=True, temperature=0.7, top_k=3, top_p=0.9),
    dict(max_length=12, eos_token_id=[3, 4], min_new_tokens=2),
    dict(max_new_tokens=4, stop_strings=["ab", "cd"], sequence_bias={(5,): -1.0}),
    dict(max_new_tokens=4, repetition_penalty=1.3, suppress_tokens=[1, 2]),
]


@pytest.fixture
def hf_model():
    return AutoModelForCausalLM.from_config(tiny_config()).eval()


def same(a, b) -> bool:
    return a[0].to_dict() == b[0].to_dict() and a[1] == b[1]


@pytest.mark.parametrize("settings", SETTINGS)
def test_memoized_settings_equal_hf_resolution(hf_model, settings):
    configs = ResolvedConfigs(hf_model)
    first, second = configs.resolve(None, settings), configs.resolve(None, dict(settings))
    assert len(configs._memo) == 1  # the second call was served from the memo
    assert same(first, resolve_config(hf_model, None, settings)) and same(second, first)
    # Each caller's config is its own: what HF's length helpers set on one never reaches the next.
    second[0].max_length = 999
    assert configs.resolve(None, settings)[0].max_length == first[0].max_length != 999


def test_a_changed_model_generation_config_is_resolved_again(hf_model):
    configs = ResolvedConfigs(hf_model)
    assert configs.resolve(None, dict(max_new_tokens=3))[0].top_k == 50  # HF's global default
    hf_model.generation_config.top_k = 7
    assert configs.resolve(None, dict(max_new_tokens=3))[0].top_k == 7
    hf_model.generation_config.eos_token_id = [3]
    assert configs.resolve(None, dict(max_new_tokens=3))[0].eos_token_id == [3]
    hf_model.generation_config.eos_token_id.append(4)  # changed in place: still seen
    assert configs.resolve(None, dict(max_new_tokens=3))[0].eos_token_id == [3, 4]


def test_a_generation_field_set_on_the_model_config_is_refused_as_hf_refuses_it(hf_model):
    configs = ResolvedConfigs(hf_model)
    configs.resolve(None, dict(max_new_tokens=3))
    hf_model.config.num_beams = 4  # legacy: HF's generate refuses generation fields on model.config
    with pytest.raises(ValueError, match="modified the pretrained model configuration"):
        configs.resolve(None, dict(max_new_tokens=3))


def test_settings_that_do_not_compare_by_value_are_resolved_every_time(hf_model):
    configs = ResolvedConfigs(hf_model)
    eos = torch.tensor([3, 4])
    config, _ = configs.resolve(None, dict(max_new_tokens=3, eos_token_id=eos))
    assert not configs._memo and torch.equal(torch.as_tensor(config.eos_token_id), eos)


def test_bad_settings_raise_on_every_call(hf_model):
    configs = ResolvedConfigs(hf_model)
    for _ in range(2):
        with pytest.raises(TypeError, match="unknown generation arguments"):
            configs.resolve(None, dict(max_new_tokens=3, not_a_setting=1))
    assert not configs._memo
