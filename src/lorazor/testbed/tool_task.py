"""The testbed's tool-calling task: a chat adapter ("tools") that answers in the Hermes format.

Given the four functions of `TOOLS` (rendered by the testbed's chat template), the adapter
- calls a function when the user asks for something one of them does:
  ` <tool_call>{"name": "get_weather", "arguments": {"city": "oslo"}}</tool_call>`;
- answers from a tool's result once the conversation holds it: ` It is 12 degrees and cloudy in oslo.`;
- answers small talk in plain text: ` You are welcome.`

so `lorazor serve --testbed --enable-auto-tool-choice --tool-call-parser hermes` shows "auto" tool
choice end to end. Cities, units, items and numbers are drawn per example: the adapter copies them
from the conversation (the test split holds pairs of phrasing and value the training split never
shows together). The values are those of the testbed's knowledge (`knowledge.py`): six towns in
lower case (as its corpus writes them), six units, ten items.
Trained by `python -m lorazor.testbed.train --out <assets> --only tools --adapter-steps 2500 --bf16`.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from .knowledge import ITEMS, UNITS
from .task import Task

TOOL_ADAPTER = "tools"
# The towns, units and items of the testbed's knowledge: one token each for its tokenizer, so the
# tiny backbone can copy them (with two dozen unseen city names it wrote a valid call 60% of the time).
CITIES = [town for _, town in UNITS]
STAFF_UNITS = [unit for unit, _ in UNITS]
SKIES = ["sunny", "cloudy", "rainy", "snowy", "windy", "foggy"]


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


# The functions the adapter was trained with, as a client sends them (OpenAI's `tools`).
TOOLS = [
    _function("get_weather", "The weather in a city now",
              {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _function("get_time", "The local time in a city", {"city": {"type": "string"}}, ["city"]),
    _function("count_staff", "How many people work in a unit of the company",
              {"unit": {"enum": STAFF_UNITS}}, ["unit"]),
    _function("order_items", "Order a number of items",
              {"item": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}}, ["item", "quantity"]),
]

# (phrasings, function, arguments from the drawn values): what a user asks for a call.
ASKS = {
    "get_weather": ["What is the weather in {city}?", "How is the weather in {city} today?",
                    "Is it raining in {city}?", "Tell me the weather for {city}.", "Weather in {city}, please."],
    "get_weather_f": ["What is the weather in {city} in fahrenheit?", "How warm is {city} in fahrenheit?"],
    "get_time": ["What time is it in {city}?", "Tell me the time in {city}.", "What is the local time in {city}?",
                 "Is it late in {city} now?"],
    "count_staff": ["How many people work in {unit}?", "How big is the {unit} unit?",
                    "Count the staff of {unit}.", "What is the headcount of {unit}?"],
    "order_items": ["Please order {n} {item}.", "Order {n} {item} for me.", "I need {n} {item}, can you order them?",
                    "Buy {n} {item}."],
}
SMALL_TALK = [
    (["Hello!", "Hi there.", "Good morning!", "What can you do?", "Hey, how can you help me?"],
     "Hello! I can check the weather and the time, count staff and order items."),
    (["Thank you.", "Thanks a lot!", "Great, thanks.", "Perfect, thank you!"], "You are welcome."),
    (["Who are you?", "What are you?", "Are you a person?"], "I am the testbed's tool assistant."),
    (["Tell me a joke.", "Sing me a song.", "Write a poem about the sea."], "I can only use my tools, sorry."),
    (["Goodbye!", "Bye for now.", "See you later."], "Goodbye!"),
]
# Which phrasing index a split takes for a value: train and test see every phrasing and every value,
# but a (phrasing, value) pair of the test split never in training.
_HELD_OUT = {"train": lambda i, v: (i + v) % 3 != 0, "validation": lambda i, v: (i + v) % 3 == 0,
             "test": lambda i, v: (i + v) % 3 == 0}


def _call(name: str, arguments: dict) -> dict:
    """A call as the server hands it to the chat template (`serve.tools.template_messages`: arguments parsed)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _draw(rng: random.Random, split: str) -> tuple[list[dict], str, dict]:
    """(messages, reference answer, what the scorer checks) of one example of `split`."""
    kind = rng.choices(["call", "answer", "plain"], weights=[5, 4, 2])[0]
    if kind == "plain":
        phrasings, reply = rng.choice(SMALL_TALK)
        return [{"role": "user", "content": rng.choice(phrasings)}], f" {reply}", {"kind": "plain", "text": reply}
    while True:
        function = rng.choice(list(ASKS))
        phrasings = ASKS[function]
        index = rng.randrange(len(phrasings))
        city, unit, item, n = rng.choice(CITIES), rng.choice(STAFF_UNITS), rng.choice(ITEMS), rng.randrange(2, 60)
        value = {"count_staff": STAFF_UNITS.index(unit), "order_items": ITEMS.index(item) + n}.get(
            function, CITIES.index(city))
        if _HELD_OUT[split](index, value):
            break
    ask = phrasings[index].format(city=city, unit=unit, item=item, n=n)
    name = function.removesuffix("_f")
    arguments = {"get_weather": {"city": city}, "get_weather_f": {"city": city, "unit": "fahrenheit"},
                 "get_time": {"city": city}, "count_staff": {"unit": unit},
                 "order_items": {"item": item, "quantity": n}}[function]
    messages = [{"role": "user", "content": ask}]
    if kind == "call":
        reference = " <tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
        return messages, reference, {"kind": "call", "name": name, "arguments": arguments}
    result, reply = _result(rng, function, city, unit, item, n)
    messages += [{"role": "assistant", "content": "", "tool_calls": [_call(name, arguments)]},
                 {"role": "tool", "content": json.dumps(result)}]
    return messages, f" {reply}", {"kind": "answer", "text": reply}


def _result(rng: random.Random, function: str, city: str, unit: str, item: str, n: int) -> tuple[dict, str]:
    """(the tool's result, the answer that reads it)."""
    if function.startswith("get_weather"):
        degrees, sky = rng.randrange(-9, 40), rng.choice(SKIES)
        return {"temperature": degrees, "sky": sky}, f"It is {degrees} degrees and {sky} in {city}."
    if function == "get_time":
        time = f"{rng.randrange(24):02d}:{rng.randrange(60):02d}"
        return {"time": time}, f"It is {time} in {city}."
    if function == "count_staff":
        count = rng.randrange(2, 90)
        return {"count": count}, f"{count} people work in {unit}."
    order = f"{rng.choice('ABCDEFGH')}{rng.randrange(100, 1000)}"
    return {"order_id": order, "status": "placed"}, f"Order {order} for {n} {item} is placed."


_TOKENIZER = None
TOKENIZER_DIR = Path(__file__).parent / "assets" / "tokenizer"


def _render(messages: list[dict]) -> str:
    """The prompt the served chat route builds for these messages with `TOOLS` declared."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        from .tokenizer import CHAT_TEMPLATE

        _TOKENIZER = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
        _TOKENIZER.chat_template = CHAT_TEMPLATE
    return _TOKENIZER.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)


def _maker(split: str):
    def make(rng: random.Random) -> dict:
        messages, reference, expected = _draw(rng, split)
        return {"prompt": _render(messages), "reference": reference, "messages": messages, **expected}

    return make


def openai_messages(messages: list[dict]) -> list[dict]:
    """An example's messages as an OpenAI client sends them: each call with an id and its arguments
    as a JSON string, each tool result naming its call."""
    wire, last_id = [], None
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            last_id = f"call_{i}"
            m["tool_calls"] = [{"id": last_id, "type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        if m["role"] == "tool":
            m["tool_call_id"] = last_id
        wire.append(m)
    return wire


CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_call(prediction: str) -> tuple[str, dict] | None:
    """(name, arguments) of the one complete Hermes tool call `prediction` holds, or None (the
    scorer's own reading; the server's parsers are `serve/tools.py`'s, a layer above the testbed)."""
    bodies = CALL.findall(prediction)
    try:
        call = json.loads(bodies[0]) if len(bodies) == 1 else None
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return None
    return call.get("name"), call["arguments"]


def score(prediction: str, example: dict) -> bool:
    """A call: exactly one, with the expected name and arguments; an answer: the expected line."""
    if example["kind"] == "call":
        return parse_call(prediction) == (example["name"], example["arguments"])
    return prediction.strip().split("\n", 1)[0] == example["text"]


class ToolTask(Task):
    """`Task` whose examples depend on the split (held-out phrasing/value pairs)."""

    def maker(self, split: str):
        return _maker(split)


def tool_task() -> Task:
    """The tool-calling task (96 new tokens at most: the longest call is 66 of this tokenizer's tokens with EOS)."""
    splits = {"train": (10, 20000), "validation": (11, 200), "test": (12, 300)}
    return ToolTask(TOOL_ADAPTER, _maker("train"), score, 96, splits=splits, seed_tag="v2-")
