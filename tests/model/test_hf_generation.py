"""`generate` follows HF's generate: every GenerationConfig field HF's decoder-only greedy or sampling
honours gives PEFT's tokens on a mixed-adapter batch, or is refused with an error naming it."""

import pytest
import torch
from helpers import EOS, PAD, build_pair, make_batch, peft_names
from lorazor import LoRazorOutput
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

ROWS = ["math", None, "sql", "med"]
NEW = 8


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama")


@pytest.fixture(scope="module")
def batch():
    return make_batch(len(ROWS), 6, seed=21, pad_rows=(1, 3))


def ours(model, batch, rows=ROWS, **kw):
    ids, mask = batch
    kw = {"max_new_tokens": NEW, "pad_token_id": PAD, "eos_token_id": EOS, **kw}
    return model.generate(ids, attention_mask=mask, adapter_ids=rows, **kw)


def theirs(oracle, batch, rows=ROWS, **kw):
    ids, mask = batch
    kw = {"max_new_tokens": NEW, "pad_token_id": PAD, "eos_token_id": EOS, **kw}
    with torch.no_grad():
        return oracle.generate(input_ids=ids, attention_mask=mask, adapter_names=peft_names(rows), **kw)


def plain_tokens(oracle, batch):
    out = theirs(oracle, batch, do_sample=False)
    return sorted(set(out[:, batch[0].shape[1]:].flatten().tolist()) - {PAD, EOS})


# Greedy: each setting must change PEFT's own tokens (so the comparison can fail) and LoRazor must
# produce exactly PEFT's tokens with it. `None` settings are built from PEFT's plain greedy tokens.
GREEDY = {
    "max_length": dict(max_length=10, max_new_tokens=None),
    "min_length": None,
    "min_new_tokens": None,
    "eos_token_id_list": None,
    "repetition_penalty": dict(repetition_penalty=1.8),
    "repetition_penalty_pad_is_likely": None,
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_eos_token_id": dict(forced_eos_token_id=7),
    "sequence_bias": None,
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(1, 3.0), eos_token_id=9),
    "max_time": dict(max_time=0.0),
}


def greedy_setting(name, oracle, batch):
    setting = GREEDY[name]
    if setting is not None:
        return setting
    seen = plain_tokens(oracle, batch)
    first = theirs(oracle, batch, do_sample=False)[:, batch[0].shape[1]].tolist()
    # An EOS that row 0 emits first: without a minimum it stops at once.
    early_eos = [EOS, first[0]]
    return {
        "min_length": dict(min_length=batch[0].shape[1] + 4, eos_token_id=early_eos),
        "min_new_tokens": dict(min_new_tokens=4, eos_token_id=early_eos),
        "eos_token_id_list": dict(eos_token_id=[EOS, seen[0], seen[1]]),
        "repetition_penalty_pad_is_likely": dict(repetition_penalty=1.8, pad_token_id=first[0]),
        "bad_words_ids": dict(bad_words_ids=[[seen[0]], [seen[1]]]),
        "suppress_tokens": dict(suppress_tokens=seen[:3]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=sorted(set(first))),
        "sequence_bias": dict(sequence_bias=[[[seen[0]], -20.0], [[seen[-1]], 8.0]]),
    }[name]


@pytest.mark.parametrize("name", list(GREEDY))
def test_greedy_field_matches_peft(pair, batch, name):
    model, oracle = pair
    setting = greedy_setting(name, oracle, batch)
    setting = {k: v for k, v in setting.items()}
    want = theirs(oracle, batch, do_sample=False, **setting)
    if name != "repetition_penalty_pad_is_likely":
        assert not torch.equal(want, theirs(oracle, batch, do_sample=False)), f"{name} changes nothing here"
    got = ours(model, batch, do_sample=False, **setting).sequences
    assert torch.equal(got, want)


SAMPLING = {
    "hf_defaults": dict(),  # HF samples with top_k=50 unless told otherwise
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8, top_k=0),
    "min_p": dict(min_p=0.1, top_k=0),
    "typical_p": dict(typical_p=0.7),
    "epsilon_cutoff": dict(epsilon_cutoff=0.02),
    "eta_cutoff": dict(eta_cutoff=0.02),
    "num_return_sequences": dict(num_return_sequences=2),
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_seeded_sampling_field_matches_peft(pair, batch, name):
    model, oracle = pair
    n = SAMPLING[name].get("num_return_sequences", 1)
    peft_rows = [r for r in ROWS for _ in range(n)]  # PEFT wants adapter_names already expanded
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        want = theirs(oracle, batch, rows=peft_rows, do_sample=True, **SAMPLING[name])
        torch.manual_seed(seed)
        got = ours(model, batch, do_sample=True, **SAMPLING[name]).sequences
        assert torch.equal(got, want), f"seed {seed}"


def test_num_return_sequences_returns_n_rows_per_prompt(pair, batch):
    model, _ = pair
    out = ours(model, batch, do_sample=True, num_return_sequences=3, release=[None, None, 2, "never"])
    assert out.sequences.shape[0] == 3 * len(ROWS)
    assert out.release_steps.shape[0] == 3 * len(ROWS)


def test_scores_and_logits_match_peft(pair, batch):
    model, oracle = pair
    kw = dict(do_sample=False, output_scores=True, output_logits=True, return_dict_in_generate=True,
              repetition_penalty=1.3)
    want = theirs(oracle, batch, **kw)
    got = ours(model, batch, **kw)
    assert isinstance(got, ModelOutput) and got[0] is got.sequences
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == got.sequences.shape[1] - batch[0].shape[1]
    for a, b in zip(got.scores + got.logits, want.scores + want.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


class StopAfter(StoppingCriteria):
    """Stops a row once it has generated `token`."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_match_peft(pair, batch):
    model, oracle = pair
    token = plain_tokens(oracle, batch)[0]
    want = theirs(oracle, batch, do_sample=False, stopping_criteria=[StopAfter(token)], max_new_tokens=12)
    assert not torch.equal(want, theirs(oracle, batch, do_sample=False, max_new_tokens=12))
    got = ours(model, batch, do_sample=False, stopping_criteria=[StopAfter(token)], max_new_tokens=12)
    assert torch.equal(got.sequences, want)


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_sees_what_hf_streams(pair, batch):
    model, oracle = pair
    mine, hf = Recorder(), Recorder()
    got = ours(model, batch, do_sample=False, streamer=mine)
    want = theirs(oracle, batch, do_sample=False, streamer=hf)
    assert torch.equal(got.sequences, want)
    assert mine.ended and hf.ended and len(mine.puts) == len(hf.puts)
    assert all(torch.equal(a, b) for a, b in zip(mine.puts, hf.puts))


class AddInPlace(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores[:, 5] += 100.0
        return scores


def test_in_place_logits_processor_in_fp32(pair, batch):
    model, oracle = pair
    got = ours(model, batch, do_sample=False, logits_processor=[AddInPlace()])
    want = theirs(oracle, batch, do_sample=False, logits_processor=[AddInPlace()])
    assert torch.equal(got.sequences, want)


def test_generation_config_object_and_kwargs(pair, batch):
    model, oracle = pair
    cfg = GenerationConfig(
        max_new_tokens=5, do_sample=False, pad_token_id=PAD, eos_token_id=EOS, repetition_penalty=1.4
    )
    ids, mask = batch
    got = model.generate(ids, attention_mask=mask, adapter_ids=ROWS, generation_config=cfg, no_repeat_ngram_size=2)
    with torch.no_grad():
        want = oracle.generate(
            input_ids=ids,
            attention_mask=mask,
            adapter_names=peft_names(ROWS),
            generation_config=cfg,
            no_repeat_ngram_size=2,
        )
    assert torch.equal(got.sequences, want)


def test_adapter_ids_none_is_the_backbone(pair, batch):
    model, oracle = pair
    got = ours(model, batch, rows=None, do_sample=False)
    assert torch.equal(got.sequences, theirs(oracle, batch, rows=[None] * len(ROWS), do_sample=False))


@pytest.mark.parametrize("setting, message", [
    (dict(num_beams=2), "generation mode 'beam_search' .* is not supported"),
    (dict(penalty_alpha=0.6, top_k=4), "is not supported: LoRazor runs greedy search and sampling"),
    (dict(guidance_scale=1.5), "guidance_scale=1.5 is not supported"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions=True is not supported"),
    (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states=True is not supported"),
])
def test_unsupported_settings_are_refused(pair, batch, setting, message):
    model, _ = pair
    with pytest.raises(NotImplementedError, match=message):
        ours(model, batch, **setting)


def test_unknown_arguments_are_refused(pair, batch):
    model, _ = pair
    with pytest.raises(TypeError, match="unknown generation arguments \\['assistant_model'\\]"):
        ours(model, batch, assistant_model=object())


def test_output_is_a_model_output_with_release_accounting(pair, batch):
    model, _ = pair
    out = ours(model, batch, do_sample=False)
    assert isinstance(out, LoRazorOutput) and isinstance(out, ModelOutput)
    assert out.release_steps.shape == (len(ROWS),) and 0.0 <= out.skip_fraction <= 1.0


@pytest.fixture(scope="module")
def testbed():
    import copy

    from lorazor import LoRazorModel
    from lorazor.testbed import load

    peft_model, tokenizer, tasks = load()
    oracle = copy.deepcopy(peft_model)
    return LoRazorModel.from_peft(peft_model), oracle, tokenizer, tasks


def prompts_of(tasks):
    return [tasks["sql"].split("test")[0]["prompt"], tasks["science"].split("test")[1]["prompt"],
            tasks["math"].split("test")[2]["prompt"]]


def test_stop_strings_match_hf(testbed):
    model, oracle, tokenizer, tasks = testbed
    prompts, rows = prompts_of(tasks), ["sql", "science", None]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    kw = dict(
        max_new_tokens=40,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        stop_strings=[" FROM", "e ", "Step 3"],
        tokenizer=tokenizer,
    )
    with torch.no_grad():
        want = oracle.generate(**enc, adapter_names=peft_names(rows), **kw)
        plain = oracle.generate(**enc, adapter_names=peft_names(rows), max_new_tokens=40, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    assert want.shape[1] < plain.shape[1]  # the stop strings end generation early here
    got = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], adapter_ids=rows, **kw)
    assert torch.equal(got.sequences, want)


def test_stop_strings_without_tokenizer_is_a_clear_error(testbed):
    model, _, tokenizer, tasks = testbed
    enc = tokenizer(prompts_of(tasks)[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="stop strings"):
        model.generate(enc["input_ids"], adapter_ids=["sql"], max_new_tokens=4, stop_strings=["x"])


def test_text_streamer_prints_what_hf_prints(testbed, capsys):
    from transformers import TextStreamer

    model, oracle, tokenizer, tasks = testbed
    enc = tokenizer(prompts_of(tasks)[:1], return_tensors="pt")
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        oracle.generate(**enc, adapter_names=["sql"], streamer=TextStreamer(tokenizer), **kw)
    want = capsys.readouterr().out
    model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], adapter_ids=["sql"],
                   streamer=TextStreamer(tokenizer), **kw)
    assert capsys.readouterr().out == want and len(want) > len(prompts_of(tasks)[0])


def test_generate_text_returns_hf_new_text(testbed):
    model, oracle, tokenizer, tasks = testbed
    prompts, rows = prompts_of(tasks), ["sql", "science", "math"]
    texts = model.generate_text(prompts, rows, tokenizer=tokenizer, max_new_tokens=30, do_sample=False)
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = oracle.generate(**enc, adapter_names=rows, max_new_tokens=30, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert texts == tokenizer.batch_decode(ref[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert all(isinstance(t, str) for t in texts)


def test_min_new_tokens_runs_one_min_length_processor_and_matches_peft(pair, batch):
    from lorazor.model.hf_generation import plan_generation, resolve_config
    from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

    model, oracle = pair
    ids, mask = batch
    config, flags = resolve_config(model.model, None, dict(max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=EOS))
    plan = plan_generation(model.model, config, flags, ids, mask)
    kinds = [type(p) for p in plan.processors]
    assert kinds.count(MinNewTokensLengthLogitsProcessor) == 1 and MinLengthLogitsProcessor not in kinds
    # min_length alone is kept (with min_new_tokens given, HF overrides min_length with it).
    config, flags = resolve_config(model.model, None, dict(max_new_tokens=NEW, min_length=12, eos_token_id=EOS))
    assert MinLengthLogitsProcessor in [
        type(p) for p in plan_generation(model.model, config, flags, ids, mask).processors
    ]
    first = theirs(oracle, batch, do_sample=False)[:, ids.shape[1]].tolist()
    setting = dict(min_new_tokens=5, eos_token_id=[EOS, first[0]])
    assert torch.equal(ours(model, batch, do_sample=False, **setting).sequences,
                       theirs(oracle, batch, do_sample=False, **setting))


def test_forward_with_adapter_ids_none_is_the_backbone(pair, batch):
    model, oracle = pair
    ids, mask = batch
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, adapter_names=peft_names([None] * len(ROWS))).logits
    torch.testing.assert_close(model(ids, mask)[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)


def test_num_return_sequences_past_max_batch_size_is_refused(batch):
    from lorazor import LoRazorConfig

    model = build_pair("llama", LoRazorConfig(max_batch_size=6))[0]
    with pytest.raises(ValueError, match="4 prompts x num_return_sequences=2 rows exceed max_batch_size=6"):
        ours(model, batch, do_sample=True, num_return_sequences=2)


def test_max_new_tokens_alone_logs_no_length_warning(pair, batch):
    from unittest import mock

    from transformers.generation import utils as hf_utils

    model, _ = pair
    with mock.patch.object(hf_utils.logger, "warning") as warning:
        ours(model, batch, do_sample=False)
    assert not any("seem to have been set" in str(c) for c in warning.call_args_list)
