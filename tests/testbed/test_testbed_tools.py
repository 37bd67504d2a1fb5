"""The testbed's tool-calling task and chat template (`lorazor.testbed.tool_task`, `tokenizer.CHAT_TEMPLATE`)."""

import json

import pytest

from lorazor.testbed import ASSETS, load_tokenizer
from lorazor.testbed.tokenizer import CHAT_TEMPLATE
from lorazor.testbed.tool_task import TOOLS, openai_messages, parse_call, tool_task


def test_the_shipped_tokenizer_carries_the_template_the_adapter_was_trained_with():
    assert load_tokenizer().chat_template == CHAT_TEMPLATE


def test_a_chat_without_tools_is_its_messages_contents_as_before():
    tok = load_tokenizer()
    messages = [{"role": "user", "content": "Problem: Tom has 3 apples.\nSolution:"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == messages[0]["content"]


def test_tools_calls_and_results_render_turn_by_turn_as_the_server_hands_them():
    from lorazor.serve.protocol import ChatMessage
    from lorazor.serve.tools import template_messages

    example = next(e for e in tool_task().split("test") if e["kind"] == "answer")
    wire = [ChatMessage(**m) for m in openai_messages(example["messages"])]
    served = load_tokenizer().apply_chat_template(template_messages(wire), tools=TOOLS, tokenize=False,
                                                  add_generation_prompt=True)
    assert served == example["prompt"]  # what the server renders is what the adapter was trained on
    lines = served.split("\n")
    assert lines[0].startswith("Tools: get_weather(city, unit), get_time(city)")
    assert lines[1].startswith("User: ") and lines[2].startswith("Assistant: <tool_call>{")
    assert lines[3].startswith("Result: {") and lines[4] == "Assistant:"


@pytest.mark.parametrize("split", ["train", "test"])
def test_references_score_true_and_wrong_calls_false(split):
    task = tool_task()
    examples = task.split(split)[:200]
    assert {e["kind"] for e in examples} == {"call", "answer", "plain"}
    for e in examples:
        assert task.score(e["reference"], e), e
    call = next(e for e in examples if e["kind"] == "call")
    assert parse_call(call["reference"]) == (call["name"], call["arguments"])
    wrong = dict(call["arguments"], **{next(iter(call["arguments"])): "elsewhere"})
    assert not task.score(' <tool_call>' + json.dumps({"name": call["name"], "arguments": wrong}) + '</tool_call>',
                          call)
    assert not task.score(call["reference"] * 2, call)  # two calls where one was asked


def test_the_test_split_holds_phrasing_value_pairs_training_never_shows():
    task = tool_task()
    seen = {(e["messages"][0]["content"]) for e in task.split("train")}
    asks = [e["messages"][0]["content"] for e in task.split("test") if e["kind"] != "plain"]
    assert asks and not set(asks) & seen


def test_the_tools_adapter_ships_at_rank_16():
    config = json.loads((ASSETS / "adapters" / "tools" / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["base_model_name_or_path"] == "backbone"
