"""Quickstart: a multi-adapter PeftModel served by LoRazor in one mixed batch.

    python examples/quickstart.py
"""

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from lorazor import LoRazorConfig, LoRazorModel, ProfiledRelease

# A tiny random Llama; with a real checkpoint use AutoModelForCausalLM.from_pretrained(...).
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=0)
base = AutoModelForCausalLM.from_config(config).eval()

# Two adapters of different rank and targets (init_lora_weights=False: random, non-zero B).
peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                             init_lora_weights=False), adapter_name="summarize")
peft_model.add_adapter("translate", LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"],
                                               init_lora_weights=False))

model = LoRazorModel.from_peft(peft_model, LoRazorConfig(grid="exact"))

input_ids = torch.randint(3, 128, (3, 6))
attention_mask = torch.ones_like(input_ids)
attention_mask[1, :2] = 0  # left padding
out = model.generate(input_ids, attention_mask=attention_mask, adapter_ids=["summarize", "translate", None],
                     max_new_tokens=10, pad_token_id=0)
print(out.sequences)

# StepTrim: "translate" rows release their adapter after 2 decode steps.
out = model.generate(input_ids, attention_mask=attention_mask, adapter_ids=["summarize", "translate", None],
                     max_new_tokens=10, pad_token_id=0, release_policy=ProfiledRelease({"translate": 2}))
print("release steps:", out.release_steps.tolist(), "decode LoRA skipped:", f"{out.skip_fraction:.0%}")
