"""Registration refuses adapter folders that would serve garbage or silently serve the base model:
non-finite weights or alpha, no tensors, part of the tensors its target_modules select, or
target_modules that match nothing in the model (as PEFT refuses them)."""

import json
import math
import shutil

import pytest
import torch
from lorazor import AdapterError, LoRazorModel
from lorazor.testbed import ASSETS
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def model():
    from lorazor.testbed import load

    return LoRazorModel.from_peft(load()[0])


@pytest.fixture
def folder(tmp_path):
    """A copy of the testbed's sql adapter that a test may damage."""
    path = tmp_path / "adapter"
    shutil.copytree(ASSETS / "adapters" / "sql", path)
    return path


def tensors_of(folder):
    return load_file(str(folder / "adapter_model.safetensors"))


def rewrite(folder, tensors=None, **config):
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    if config:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg.update(config)
        (folder / "adapter_config.json").write_text(json.dumps(cfg))


def test_the_intact_copy_registers(model, folder):
    model.register_adapter("intact", folder)
    model.unregister_adapter("intact")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(model, folder, value):
    tensors = tensors_of(folder)
    key = sorted(k for k in tensors if "lora_B" in k)[3]
    tensors[key][0, 0] = value
    rewrite(folder, tensors)
    with pytest.raises(AdapterError, match="non-finite"):
        model.register_adapter("bad", folder)
    assert "bad" not in model.adapter_names


def test_a_file_damaged_after_registration_fails_at_load(model, folder):
    model.register_adapter("later", folder)
    try:
        tensors = tensors_of(folder)
        for key in tensors:
            tensors[key].fill_(float("nan"))
        rewrite(folder, tensors)
        failed = model.registry.load_each(["later"])
        assert "changed on disk since it was registered" in failed["later"]  # refused before any value is used
    finally:
        model.unregister_adapter("later")


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), 0, -4, True, 1e30])
def test_bad_lora_alpha_is_refused(model, folder, alpha):
    text = (folder / "adapter_config.json").read_text()
    cfg = json.loads(text)
    cfg["lora_alpha"] = alpha
    (folder / "adapter_config.json").write_text(json.dumps(cfg))  # NaN / Infinity as Python writes them
    with pytest.raises(AdapterError, match="lora_alpha"):
        model.register_adapter("bad", folder)


def test_no_tensors_is_refused(model, folder):
    rewrite(folder, {})
    with pytest.raises(AdapterError, match="holds no LoRA tensors"):
        model.register_adapter("bad", folder)


def test_half_the_tensors_is_refused(model, folder):
    tensors = tensors_of(folder)
    kept = {k: v for k, v in tensors.items() if ".layers.0." in k or ".layers.1." in k}
    assert 0 < len(kept) < len(tensors)
    rewrite(folder, kept)
    with pytest.raises(AdapterError, match="has no weights for .* modules its target_modules select"):
        model.register_adapter("bad", folder)


def test_target_modules_matching_nothing_are_refused(model, folder):
    rewrite(folder, target_modules=["c_attn", "c_fc"])
    with pytest.raises(AdapterError, match="match none of this model's LoRA target modules"):
        model.register_adapter("bad", folder)


def test_layers_to_transform_is_followed(model, folder):
    """An adapter that targets two layers only and holds exactly their tensors is complete."""
    tensors = tensors_of(folder)
    kept = {k: v for k, v in tensors.items() if ".layers.0." in k or ".layers.1." in k}
    rewrite(folder, kept, layers_to_transform=[0, 1])
    model.register_adapter("two_layers", folder)
    model.unregister_adapter("two_layers")


def test_a_peft_model_with_nan_weights_is_refused():
    from lorazor.testbed import load

    peft_model = load()[0]
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B.sql" in name:
                param.fill_(math.nan)
    with pytest.raises(AdapterError, match="'sql'.*non-finite"):
        LoRazorModel.from_peft(peft_model)
