"""A byte-level BPE tokenizer for testbed v2, trained on its corpus and the tasks' training text,
so answers are tens of tokens as in the paper (not hundreds of characters)."""

from __future__ import annotations

# The testbed's tasks are plain prompts: a chat is its messages' contents one after another, so a
# single user message is the very prompt a completion gets (and gets the same answer). A chat with tools, or with
# tool calls and results in it (the "tools" adapter's format, `tool_task.py`), is rendered turn by turn:
# the functions' signatures on one line (a tiny model copies better from a short prompt), "User:",
# "Assistant:" (a call in Hermes' `<tool_call>` form), "Result:".
CHAT_TEMPLATE = (
    "{%- set ns = namespace(tools=tools is defined and tools is not none and tools | length > 0) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' or (m['tool_calls'] is defined and m['tool_calls']) -%}{%- set ns.tools = true -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if not ns.tools -%}"
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{%- else -%}"
    "Tools:"
    "{%- for tool in (tools or []) -%}"
    "{%- set f = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set p = f['parameters'] if f['parameters'] is defined and f['parameters'] else {} -%}"
    "{{ ',' if not loop.first }} {{ f['name'] }}({{ (p['properties'] if p['properties'] is defined else {}) | list "
    "| join(', ') }})"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ '\\n' }}Assistant:"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] -%}"
    "{%- for c in m['tool_calls'] %} <tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor -%}"
    "{%- else %} {{ m['content'] }}{% endif -%}"
    "{%- elif m['role'] == 'tool' -%}{{ '\\n' }}Result: {{ m['content'] }}"
    "{%- elif m['role'] == 'system' -%}{{ '\\n' }}{{ m['content'] }}"
    "{%- else -%}{{ '\\n' }}User: {{ m['content'] }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\n' }}Assistant:{%- endif -%}"
    "{%- endif -%}"
)

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
VOCAB_SIZE = 4096


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    """A `PreTrainedTokenizerFast` (pad 0, bos 1, eos 2, unk 3, left padding) learned from `texts`
    (an iterable of strings). Deterministic for the same texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                 unk_token="<unk>")
    hf.padding_side = "left"
    return hf
