"""Regressions for silently wrong answers and unclear errors found by adversarial testing.

Each test here failed (a wrong answer, a crash deep inside torch, or a silent acceptance) before
the fix it guards.
"""

import json
import pickle
import threading

import pytest
import torch
from helpers import EOS, PAD, build_pair, make_batch, peft_generate
from lorazor import AdapterError, LearnedRelease, LoRazorConfig, LoRazorModel, ProfiledRelease
from lorazor import load_release_policy, save_release_policy
from lorazor.model.guard import ModelBusyError, ModelClosedError
from lorazor.tiny import tiny_peft_model
from transformers import LogitsProcessor

GEN = dict(max_new_tokens=6, pad_token_id=PAD, eos_token_id=EOS)
ROWS = ["math", "sql", None, "med"]


@pytest.fixture()
def pair():
    return build_pair("llama", LoRazorConfig(max_loras=4))


@pytest.fixture(scope="module")
def model():
    return build_pair("llama")[0]


# ---- item 2: the concurrency contract ----------------------------------------------------------
class CallsBack(LogitsProcessor):
    """A logits processor that tries to change the model in the middle of a generate."""

    def __init__(self, action):
        self.action, self.error = action, None

    def __call__(self, input_ids, scores):
        if self.error is None:
            try:
                self.action()
            except Exception as err:  # recorded, then re-checked by the test
                self.error = err
        return scores


@pytest.mark.parametrize("action", ["remove", "add", "generate", "reconfigure"])
def test_changes_from_inside_a_generate_are_refused_and_rows_stay_exact(pair, tmp_path, action):
    model, oracle = pair
    oracle.save_pretrained(tmp_path, selected_adapters=["sql"])
    ids, mask = make_batch(4, 5, seed=1)
    calls = {
        "remove": lambda: model.remove_adapter("math"),
        "add": lambda: model.add_adapter(tmp_path / "sql", name="sql2"),
        "generate": lambda: model.generate(ids, attention_mask=mask, adapter_ids=ROWS, **GEN),
        "reconfigure": lambda: model.reconfigure(grid="full"),
    }
    proc = CallsBack(calls[action])
    out = model.generate(ids, attention_mask=mask, adapter_ids=ROWS, logits_processor=[proc], **GEN)
    assert isinstance(proc.error, ModelBusyError) and "while generate is running" in str(proc.error)
    assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, ROWS, max_new_tokens=6))
    assert model.adapter_names == ["math", "sql", "med"]  # nothing changed


def test_two_threads_sharing_a_model_both_get_exact_tokens(pair):
    model, oracle = pair
    batches = [make_batch(4, 5, seed=s, pad_rows=(1,)) for s in (2, 3)]
    rows = [ROWS, ["med", None, "sql", "math"]]
    want = [peft_generate(oracle, i, m, r, max_new_tokens=6) for (i, m), r in zip(batches, rows)]
    got, errors = {}, []

    def work(k):
        try:
            for _ in range(3):
                ids, mask = batches[k]
                got.setdefault(k, []).append(model.generate(ids, attention_mask=mask, adapter_ids=rows[k], **GEN))
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in (0, 1):
        assert all(torch.equal(o.sequences, want[k]) for o in got[k])


def test_adapter_removal_from_another_thread_waits_for_the_running_generate(pair):
    model, oracle = pair
    ids, mask = make_batch(4, 5, seed=4)
    started, removed = threading.Event(), threading.Event()

    class Slow(LogitsProcessor):
        def __call__(self, input_ids, scores):
            started.set()
            # The other thread's removal must not land while this batch runs.
            assert not removed.wait(0.05)
            return scores

    remover = threading.Thread(target=lambda: (started.wait(), model.remove_adapter("math"), removed.set()))
    remover.start()
    out = model.generate(ids, attention_mask=mask, adapter_ids=ROWS, logits_processor=[Slow()], **GEN)
    remover.join()
    assert removed.is_set() and "math" not in model.adapter_names
    assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, ROWS, max_new_tokens=6))


def test_generate_after_unpatch_raises():
    model, _ = build_pair("llama")
    ids, mask = make_batch(2, 4)
    model.unpatch()
    with pytest.raises(ModelClosedError, match="cannot generate: this LoRazorModel was unpatched"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math", None], max_new_tokens=2)
    with pytest.raises(ModelClosedError):
        model(ids, mask, ["math", None])


# ---- item 4: names are never paths -------------------------------------------------------------
@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".hidden", "", "a\\b", "x" * 200])
def test_path_like_adapter_names_are_refused(pair, tmp_path, name):
    model, oracle = pair
    oracle.save_pretrained(tmp_path, selected_adapters=["sql"])
    with pytest.raises(AdapterError, match="invalid adapter name"):
        model.add_adapter(tmp_path / "sql", name=name)
    with pytest.raises(AdapterError, match="invalid adapter name"):
        save_release_policy(ProfiledRelease({name: 2}), tmp_path / "policies")
    with pytest.raises(AdapterError, match="invalid adapter name"):
        load_release_policy(tmp_path / "policies", adapters=[name])
    assert not (tmp_path / "escape").exists()


# ---- item 5: values that were silently accepted ------------------------------------------------
def test_boolean_max_new_tokens_is_refused(model):
    ids, mask = make_batch(1, 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got True"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math"], max_new_tokens=True)


def test_boolean_config_sizes_are_refused():
    with pytest.raises(ValueError, match="max_batch_size must be a positive int or None, got True"):
        LoRazorConfig(max_batch_size=True)


@pytest.mark.parametrize("tau", [float("nan"), "0.5", None])
def test_learned_head_with_a_non_number_tau_is_refused(tau):
    with pytest.raises(ValueError, match="tau="):
        LearnedRelease({"math": (torch.zeros(64), 0.0, tau)})


def test_adapter_whose_tensors_disagree_with_its_rank_is_refused(pair, tmp_path):
    model, oracle = pair
    oracle.save_pretrained(tmp_path, selected_adapters=["sql"])
    cfg_path = tmp_path / "sql" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["r"] = 2  # the tensors are rank 4
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="disagree with the config's r=2"):
        model.add_adapter(tmp_path / "sql", name="sql2")


# ---- item 6: errors that name the bad value ----------------------------------------------------
def test_all_zero_mask_row(model):
    ids, mask = make_batch(2, 4)
    mask[1] = 0
    with pytest.raises(ValueError, match="attention_mask row 1 is all 0"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math", None], max_new_tokens=2)


def test_float_input_ids(model):
    ids, mask = make_batch(2, 4)
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got dtype torch.float32"):
        model.generate(ids.float(), attention_mask=mask, adapter_ids=["math", None], max_new_tokens=2)


@pytest.mark.parametrize("bad", [-1, 96, 1000])
def test_token_ids_outside_the_vocabulary(model, bad):
    ids, mask = make_batch(2, 4)
    ids[1, 2] = bad
    with pytest.raises(ValueError, match=f"token id {bad} \\(row 1\\), outside the vocabulary \\[0, 96\\)"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math", None], max_new_tokens=2)


def test_merged_and_unloaded_model():
    plain = tiny_peft_model("llama").merge_and_unload()
    with pytest.raises(TypeError, match="from_peft needs a peft.PeftModel .* merge_and_unload"):
        LoRazorModel.from_peft(plain)


def test_profiled_release_given_a_list():
    with pytest.raises(TypeError, match="lengths must be a dict adapter name -> k"):
        ProfiledRelease([("math", 2)])


@pytest.mark.parametrize("weight, message", [
    (torch.zeros(32), "weight size 32 but the model's hidden size is 64"),
    (torch.zeros(1, 64), "needs a 1-D float weight \\[H\\], got \\(1, 64\\)"),
])
def test_learned_head_of_the_wrong_shape(model, weight, message):
    ids, mask = make_batch(1, 4)
    with pytest.raises(ValueError, match=message):
        policy = LearnedRelease({"math": (weight, 0.0, 0.0)})
        model.generate(ids, attention_mask=mask, adapter_ids=["math"], max_new_tokens=2, release_policy=policy)


def test_release_policy_given_a_dict(model):
    ids, mask = make_batch(1, 4)
    with pytest.raises(TypeError, match="release_policy must be a ReleasePolicy .* got dict"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math"], max_new_tokens=2, release_policy={"math": 2})


@pytest.mark.parametrize("content, message", [
    ("{not json", "release_policy.json is not valid JSON"),
    ('{"kind": "profiled"}', "release_policy.json has no 'k' field"),
    ('[1, 2]', "release_policy.json must hold a JSON object .* got a list"),
    ('{"k": 2}', "release_policy.json has no 'kind' field"),
])
def test_bad_policy_files(tmp_path, content, message):
    (tmp_path / "math").mkdir()
    (tmp_path / "math" / "release_policy.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        load_release_policy(tmp_path)


def test_pickle_renamed_to_safetensors_head(tmp_path):
    save_release_policy(LearnedRelease({"math": (torch.ones(64), 0.5, 0.0)}), tmp_path)
    (tmp_path / "math" / "release_head.safetensors").write_bytes(pickle.dumps({"weight": [1.0]}))
    with pytest.raises(ValueError, match="release_head.safetensors is not a valid safetensors file"):
        load_release_policy(tmp_path)


def test_pickle_renamed_to_safetensors_adapter(pair, tmp_path):
    model, oracle = pair
    oracle.save_pretrained(tmp_path, selected_adapters=["sql"])
    (tmp_path / "sql" / "adapter_model.safetensors").write_bytes(pickle.dumps({"w": [1.0]}))
    with pytest.raises(AdapterError, match="adapter_model.safetensors is not a valid safetensors file"):
        model.add_adapter(tmp_path / "sql", name="sql2")


def test_adapter_trained_for_another_model_size(pair, tmp_path):
    model, _ = pair
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from lorazor.tiny import tiny_config

    cfg = tiny_config("llama")
    cfg.hidden_size, cfg.intermediate_size = 32, 48
    other = get_peft_model(AutoModelForCausalLM.from_config(cfg),
                           LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), adapter_name="big")
    other.save_pretrained(tmp_path)
    with pytest.raises(AdapterError, match="adapter 'big' was trained for another model"):
        model.add_adapter(tmp_path / "big")


def test_adapter_folder_without_config_or_weights(pair, tmp_path):
    model, _ = pair
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        model.add_adapter(tmp_path, name="empty")


def test_generate_without_max_new_tokens_uses_hf_default(model):
    ids, mask = make_batch(1, 4)
    out = model.generate(ids, attention_mask=mask, adapter_ids=["math"], pad_token_id=PAD)
    assert out.sequences.shape[1] == 4 + 20


def test_triton_backend_on_cpu_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the Triton backend")
    with pytest.raises(ValueError, match="backend='triton' needs a CUDA device, but the model is on cpu"):
        LoRazorModel.from_peft(tiny_peft_model("llama"), LoRazorConfig(backend="triton"))


def test_from_peft_twice_on_one_peft_model_raises_until_unpatched():
    peft_model = tiny_peft_model("llama")
    first = LoRazorModel.from_peft(peft_model)
    with pytest.raises(RuntimeError, match="already patched by another LoRazorModel: call its unpatch\\(\\) first"):
        LoRazorModel.from_peft(peft_model)
    first.unpatch()
    second = LoRazorModel.from_peft(peft_model)
    assert len(second.bank.modules) > 0


def test_default_policy_of_the_wrong_hidden_size_is_refused(tmp_path):
    model = build_pair("llama", LoRazorConfig(release="learned"))[0]
    save_release_policy(LearnedRelease({"math": (torch.zeros(32), 0.0, 0.0)}), tmp_path)
    model.load_release_policy(tmp_path)
    ids, mask = make_batch(1, 4)
    with pytest.raises(ValueError, match="weight size 32 but the model's hidden size is 64"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math"], max_new_tokens=2)
