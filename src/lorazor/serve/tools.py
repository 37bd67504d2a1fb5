"""Tool calling on chat completions, as vLLM does it.

- `tool_choice` "required" or a named function: the output is decoded under a grammar built from
  the functions' `parameters` schemas, so every call parses and its arguments validate: a named
  function's output is its arguments object; "required" outputs a JSON array of
  `{"name": ..., "parameters": {...}}` (one item unless `parallel_tool_calls`), each item an
  `anyOf` over the functions.
- "auto" (with `--enable-auto-tool-choice`): the model writes free text in its own format, parsed
  after the fact by the `--tool-call-parser`: `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`,
  Hermes and Qwen), `llama3_json` (`{"name", "parameters"}` objects, optionally after
  `<|python_tag|>`, separated by `;`) or `mistral` (`[TOOL_CALLS]` and a JSON list, or
  `[TOOL_CALLS]name[ARGS]{...}`).
- "none", or no tools: plain text. The tools are rendered by the chat template whatever the choice.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .settings import TOOL_CALL_PARSERS  # noqa: F401 (the parsers' names, where the settings check them)
# A function without `parameters` takes an object of anything (OpenAI's default).
ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    """How one chat request's output becomes tool calls.

    Attributes:
        mode: "named", "required" or "auto" (None: plain text).
        names: the declared functions' names; parser: the auto parser's name.
        function: the named function (mode "named").
    """

    mode: str | None = None
    names: list[str] = field(default_factory=list)
    parser: str | None = None
    function: str | None = None

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(the message's content, its tool calls in OpenAI's shape) from a finished output."""
        if self.mode == "named":
            return None, [tool_call(self.function, text)] if _is_object(text) else []
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []
            return None, [tool_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items
                          if isinstance(i, dict) and i.get("name") in self.names and isinstance(i.get("parameters"),
                                                                                                dict)]
        if self.mode == "auto":
            content, found = PARSERS[self.parser](text)
            calls = [tool_call(name, json.dumps(args, ensure_ascii=False)) for name, args in found
                     if name in self.names and isinstance(args, dict)]
            return (content or None) if calls else text, calls
        return text, []


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def plan_tools(request, enable_auto: bool, parser: str | None) -> tuple[ToolPlan, dict | None]:
    """(the request's `ToolPlan`, the structured-output spec its tool choice imposes, or None).

    Raises:
        ValueError (a 400 naming `tool_choice`): "auto" tools without `--enable-auto-tool-choice`.
    """
    from .protocol import FieldError, NamedToolChoice

    tools = request.tools or []
    names = [t.function.name for t in tools]
    choice = request.tool_choice
    if not tools or choice == "none":
        return ToolPlan(), None
    if isinstance(choice, NamedToolChoice):
        function = next(t.function for t in tools if t.function.name == choice.function.name)
        spec = {"json": function.parameters or ANY_OBJECT, **({"strict": True} if function.strict else {})}
        return ToolPlan("named", names, function=function.name), spec
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": t.function.parameters or ANY_OBJECT},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        # OpenAI's per-function `strict`: honoured when every function asks for it (one grammar serves all).
        strict = all(t.function.strict for t in tools)
        return ToolPlan("required", names), {"json": schema, **({"strict": True} if strict else {})}
    if not enable_auto:  # "auto", said or by default with tools: vLLM's rule
        raise FieldError("tool_choice", "tool_choice 'auto' (the default with tools) needs the server started with "
                                        "--enable-auto-tool-choice and --tool-call-parser; or use 'required', a "
                                        "named function, or 'none'")
    return ToolPlan("auto", names, parser), None


def template_messages(messages) -> list[dict]:
    """Chat messages as chat templates take them: assistant tool calls with their arguments parsed
    (templates render them as objects), tool results with their call id."""
    plain = []
    for m in messages:
        item = {"role": m.role, "content": m.text}
        if m.tool_calls:
            item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _parsed(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            item["name"] = m.name
        plain.append(item)
    return plain


def _parsed(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---- parsers of "auto" output: text -> (content before the calls, [(name, arguments dict)]) ----------
def _json_objects(text: str) -> list:
    """The JSON values in `text` one after another (separated by whitespace, `;` or `,`)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            break
        value, i = decoder.raw_decode(text, i)
        values.append(value)
    return values


HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in HERMES.findall(text[start:]):
        try:
            item = json.loads(body)
        except ValueError:
            continue
        if isinstance(item, dict):
            calls.append((item.get("name"), item.get("arguments", item.get("parameters"))))
    return text[:start].strip(), calls


def parse_llama3_json(text: str) -> tuple[str, list]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    try:
        items = _json_objects(body)
    except ValueError:
        return text, []
    return "", [(i.get("name"), i.get("parameters", i.get("arguments"))) for i in items if isinstance(i, dict)]


def parse_mistral(text: str) -> tuple[str, list]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    body, calls = text[start + len("[TOOL_CALLS]"):].strip(), []
    try:
        if body.startswith("["):
            calls = [(i.get("name"), i.get("arguments")) for i in json.loads(body) if isinstance(i, dict)]
        else:  # the newer form: name[ARGS]{...} per call
            for part in body.split("[TOOL_CALLS]"):
                name, _, args = part.partition("[ARGS]")
                calls.append((name.strip(), json.loads(args)))
    except ValueError:
        return text, []
    return text[:start].strip(), calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}
