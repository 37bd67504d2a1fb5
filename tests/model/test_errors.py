"""Bad input gets a clear error naming the bad value."""

import pytest
import torch
from conftest import DEVICE
from helpers import build_pair, make_batch
from lorazor import AdapterError, LoRazorConfig, LoRazorModel
from lorazor.tiny import AdapterSpec, tiny_peft_model
from peft import LoraConfig, get_peft_model


@pytest.fixture(scope="module")
def model():
    return build_pair("llama")[0]


def test_unknown_adapter_name(model):
    ids, mask = make_batch(2, 4)
    with pytest.raises(KeyError, match="unknown adapter 'physics' at row 1"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math", "physics"], max_new_tokens=2)


def test_adapter_ids_length(model):
    ids, mask = make_batch(3, 4)
    with pytest.raises(ValueError, match="adapter_ids has 2 entries but the batch has 3 rows"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math", None], max_new_tokens=2)


def test_empty_batch(model):
    with pytest.raises(ValueError, match="empty batch"):
        model.generate(torch.zeros(0, 4, dtype=torch.long, device=DEVICE), adapter_ids=[], max_new_tokens=2)


def test_negative_max_new_tokens(model):
    ids, mask = make_batch(1, 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math"], max_new_tokens=-1)


def test_input_longer_than_cache():
    model = build_pair("llama", LoRazorConfig(max_cache_len=8))[0]
    ids, mask = make_batch(1, 6)
    with pytest.raises(ValueError, match="prompt length 6 \\+ max_new_tokens 5 = 11 tokens exceeds max_cache_len=8"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math"], max_new_tokens=5)


def test_right_padding_rejected(model):
    ids, mask = make_batch(2, 4)
    mask[1, -1] = 0
    with pytest.raises(ValueError, match="right padding is not supported"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math", None], max_new_tokens=2)


def test_unknown_generation_argument(model):
    ids, mask = make_batch(1, 4)
    with pytest.raises(TypeError, match="unknown generation arguments \\['temprature'\\]"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math"], max_new_tokens=2, temprature=0.5)


def test_dora_rejected():
    pm = tiny_peft_model("llama", adapters=(AdapterSpec("t1", 4, 8, ("q_proj",)),))
    pm.add_adapter("dora", LoraConfig(r=4, target_modules=["v_proj"], use_dora=True))
    with pytest.raises(AdapterError, match="adapter 'dora' uses DoRA"):
        LoRazorModel.from_peft(pm)


def test_embedding_target_rejected():
    pm = tiny_peft_model("llama", adapters=(AdapterSpec("t1", 4, 8, ("q_proj",)),))
    pm.add_adapter("emb", LoraConfig(r=4, target_modules=["embed_tokens"]))
    with pytest.raises(AdapterError, match="adapter 'emb' targets .*embed_tokens.*not embeddings or conv"):
        LoRazorModel.from_peft(pm)


def test_conv_target_rejected():
    class ConvNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 4, 3)

    pm = get_peft_model(ConvNet(), LoraConfig(r=2, target_modules=["conv"]), adapter_name="c")
    with pytest.raises(AdapterError, match="adapter 'c' targets .*conv.*Conv1d"):
        LoRazorModel.from_peft(pm)


def test_merged_adapter_rejected():
    pm = tiny_peft_model("llama")
    pm.base_model.model.model.layers[0].self_attn.q_proj.merge(adapter_names=["math"])
    with pytest.raises(AdapterError, match="adapters \\['math'\\] are merged into .*q_proj"):
        LoRazorModel.from_peft(pm)


def test_modules_to_save_rejected():
    pm = tiny_peft_model("llama", adapters=(AdapterSpec("t1", 4, 8, ("q_proj",)),))
    pm.add_adapter("head", LoraConfig(r=4, target_modules=["v_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(AdapterError, match="adapter 'head' uses modules_to_save"):
        LoRazorModel.from_peft(pm)


def test_rank_above_max_lora_rank():
    with pytest.raises(AdapterError, match="adapter 'med' has rank 16 > max_lora_rank=8"):
        LoRazorModel.from_peft(tiny_peft_model("llama"), LoRazorConfig(max_lora_rank=8))


def test_batch_with_more_adapters_than_max_loras():
    # More adapters than slots is fine (slots are an LRU cache); one batch using more is not.
    model = LoRazorModel.from_peft(tiny_peft_model("llama"), LoRazorConfig(max_loras=2))
    ids, mask = make_batch(3, 4)
    with pytest.raises(AdapterError, match="this batch uses 3 distinct adapters but there are only max_loras=2"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math", "sql", "med"], max_new_tokens=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(grid="fast"), "grid must be one of"),
        (dict(release="sometimes"), "release must be one of"),
        (dict(max_batch_size=0), "max_batch_size must be a positive int"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(block_m=24), "block_m must be a power of two"),
        (dict(capture_batch_sizes=(16,)), "capture_batch_sizes needs max_cache_len"),
        (
            dict(capture_batch_sizes=(0,), max_cache_len=64),
            "entries must be ints in \\[1, max_batch_size=256\\], got 0",
        ),
        (dict(capture_batch_sizes=(512,), max_cache_len=64), "got 512"),
        (dict(compile="fast"), "compile must be True, False or one of \\('auto', 'on', 'off'\\), got 'fast'"),
        (dict(compile=1), "compile must be .* got 1"),
    ],
)
def test_bad_config_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRazorConfig(**kwargs)


def test_compile_auto_is_resolved_by_the_device_and_forced_values_stay():
    # "auto" (the default) compiles on a CUDA model with the Triton kernels only; on/off force it.
    assert LoRazorConfig().compile == "auto"
    assert LoRazorConfig(compile="on").compile is True and LoRazorConfig(compile="off").compile is False
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert LoRazorConfig().resolve_compile(cpu, "reference").compile is False
    assert LoRazorConfig().resolve_compile(cuda, "triton").compile is True
    assert LoRazorConfig().resolve_compile(cuda, "reference").compile is False
    assert LoRazorConfig(compile=True).resolve_compile(cpu, "reference").compile is True
    model = build_pair("llama", LoRazorConfig())[0]  # compiled on a GPU, eager on the CPU
    assert model.config.compile is (DEVICE.type == "cuda")
    model.reconfigure(compile="off")
    assert model.config.compile is False
    model.reconfigure(compile="auto")
    assert model.config.compile is (DEVICE.type == "cuda")


def test_config_json_round_trip(tmp_path):
    cfg = LoRazorConfig(grid="two_class", max_loras=64, max_lora_rank=16, dtype="bfloat16", cuda_graphs=False,
                        max_cache_len=128, capture_batch_sizes=[1, 16])
    assert cfg.capture_batch_sizes == (1, 16)
    assert LoRazorConfig.from_json(cfg.to_json()) == cfg
    cfg.to_json(tmp_path / "c.json")
    assert LoRazorConfig.from_json(tmp_path / "c.json") == cfg
    with pytest.raises(ValueError, match="unknown LoRazorConfig keys \\['colour'\\]"):
        LoRazorConfig.from_json('{"colour": 1}')


def test_batch_above_max_batch_size():
    model = build_pair("llama", LoRazorConfig(max_batch_size=2))[0]
    ids, mask = make_batch(3, 4)
    with pytest.raises(ValueError, match="batch size 3 exceeds max_batch_size=2"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math"] * 3, max_new_tokens=1)


def test_capture_is_a_no_op_without_cuda_graphs():
    # On the CPU (or with cuda_graphs=False) there is nothing to capture; from_peft must still work.
    model = build_pair("llama", LoRazorConfig(max_cache_len=64, capture_batch_sizes=(4,), cuda_graphs=False))[0]
    assert model.capture([4]) == 0 and model.graphs is None
