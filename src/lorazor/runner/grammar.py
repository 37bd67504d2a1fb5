"""Constrained decoding for one row: a structured-output spec, its grammar compiled by xgrammar, and
the row's matcher, whose token bitmask is applied to that row's logits before any sampling rule.

A spec is a dict (or `StructuredOutput`) with exactly one of:
- `json`: a JSON schema (a dict, or its JSON text); beside it `strict: True` is OpenAI's strict mode
  (properties and items a schema does not declare are refused). A schema using a keyword the
  grammar engine would not enforce is refused (`json_schema.py`), never decoded loosely;
- `json_object`: True, any JSON object (OpenAI's `response_format: {"type": "json_object"}`);
- `regex`: a regular expression the whole output matches;
- `choice`: a non-empty list of strings, the output being exactly one of them;
- `grammar`: an EBNF grammar in xgrammar's dialect (GBNF-like, `root ::= ...`).

Grammars are compiled once per (tokenizer, spec) and kept (`GrammarCache`, least recently used
first out); a spec the grammar engine cannot compile raises `StructuredOutputError` naming why. The
grammar engine is xgrammar (vLLM's and SGLang's default): nothing here re-implements a matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .json_schema import normalize, schema_problem

SPEC_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Compiled grammars kept per tokenizer (a large schema's compiled grammar holds a few MB at most).
GRAMMARS_KEPT = 256
# The longest spec text accepted (a schema, regex or grammar), in characters.
MAX_SPEC_CHARS = 1 << 20


class StructuredOutputError(ValueError):
    """A structured-output spec that is malformed or that the grammar engine cannot compile; the
    message names the field and the reason."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on one request's output: set exactly one field (the module docstring)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, False)}


def spec_key(spec) -> tuple[str, str]:
    """(kind, canonical text) of a spec: the compile cache's key; raises StructuredOutputError for a
    malformed one (naming the field)."""
    if isinstance(spec, StructuredOutput):
        spec = spec.as_dict()
    if not isinstance(spec, dict):
        raise StructuredOutputError(f"structured_output must be a dict or StructuredOutput with one of {SPEC_KINDS}, "
                                    f"got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(SPEC_KINDS) - {"strict"})
    if unknown:
        raise StructuredOutputError(f"structured_output has unknown fields {unknown}: use exactly one of {SPEC_KINDS}")
    strict = spec.get("strict", False)
    if not isinstance(strict, bool) or (strict and "json" not in spec):
        raise StructuredOutputError(f"structured_output.strict must be a bool beside json, got {strict!r}")
    given = [k for k in SPEC_KINDS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise StructuredOutputError(f"structured_output needs exactly one of {SPEC_KINDS}, got {given or 'none'}")
    kind = given[0]
    value = spec[kind]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise StructuredOutputError(f"structured_output.json is not valid JSON: {err}") from None
        if not isinstance(value, (dict, bool)):
            raise StructuredOutputError(f"structured_output.json must be a JSON schema (an object), got "
                                        f"{type(value).__name__}")
        problem = schema_problem(normalize(value))
        if problem:
            raise StructuredOutputError(f"structured_output.json cannot be enforced: {problem}")
        # Key order kept: properties are generated in the schema's order (as OpenAI does).
        text = json.dumps(value)
        kind = "json_strict" if strict else "json"
    elif kind == "json_object":
        if value is not True:
            raise StructuredOutputError(f"structured_output.json_object must be true, got {value!r}")
        text = ""
    elif kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise StructuredOutputError("structured_output.choice must be a non-empty list of non-empty strings, "
                                        f"got {value!r}")
        text = json.dumps(list(value))
    else:
        if not isinstance(value, str) or not value:
            raise StructuredOutputError(f"structured_output.{kind} must be a non-empty string, got {value!r}")
        text = value
    if len(text) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"structured_output.{kind} is {len(text)} characters, more than {MAX_SPEC_CHARS}")
    return kind, text


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCache:
    """Compiled grammars for one tokenizer, by spec, least recently used out first; thread-safe
    (a server compiles on a worker thread while the engine's thread matches)."""

    def __init__(self, tokenizer, vocab_size: int, kept: int = GRAMMARS_KEPT):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        # A Hugging Face tokenizer, or xgrammar's TokenizerInfo itself (a benchmark's synthetic vocabulary).
        self.info = tokenizer if isinstance(tokenizer, xgr.TokenizerInfo) else xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.kept = kept
        self._compiled: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (not found in the cache), for tests and metrics

    def compile(self, spec):
        """The compiled grammar of `spec`; raises StructuredOutputError when it cannot be compiled."""
        key = spec_key(spec)
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
                return found
        compiled = self._compile(*key)
        with self._lock:
            self._compiled[key] = compiled
            self.compiles += 1
            while len(self._compiled) > self.kept:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str):
        try:
            if kind in ("json", "json_strict"):  # strict (OpenAI's): undeclared properties and items refused
                schema = normalize(json.loads(text))
                return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                         strict_mode=kind == "json_strict")
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(json.loads(text)))
            return self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as err:  # xgrammar's parse and compile errors
            lines = str(err).strip().splitlines()
            # Without xgrammar's "[time] file.cc:line: " prefix, which says nothing to a client.
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[-1]) if lines else type(err).__name__
            raise StructuredOutputError(f"structured_output.{kind.removesuffix('_strict')} cannot be compiled: "
                                        f"{reason}") from None

    def constraint(self, spec) -> "Constraint":
        json_kind = spec_key(spec)[0] in ("json", "json_object", "json_strict")
        return Constraint(self.compile(spec), self.vocab_size, self.no_control_chars() if json_kind else None)

    def no_control_chars(self) -> torch.Tensor:
        """A one-row bitmask allowing every token but those whose bytes hold a control character
        (U+0000-U+001F), stop tokens kept. xgrammar's JSON strings admit every byte but `"`, `\\`,
        CR and LF, while JSON (RFC 8259) forbids raw control characters in strings: JSON outputs
        are masked with this too, so they always parse."""
        if getattr(self, "_no_control", None) is None:
            mask = new_bitmask(1, self.vocab_size)
            stops = set(self.info.stop_token_ids)
            for token, raw in enumerate(self.info.decoded_vocab[:self.vocab_size]):
                if token not in stops and any(byte < 0x20 for byte in raw):
                    mask[0, token // 32] &= ~(1 << (token % 32))
            self._no_control = mask
        return self._no_control


_CACHES_LOCK = threading.Lock()


def grammar_cache(tokenizer, vocab_size: int) -> GrammarCache:
    """The shared `GrammarCache` of `tokenizer` (a Hugging Face tokenizer or an xgrammar
    `TokenizerInfo`) for a model of `vocab_size` logits. It is kept on the tokenizer object itself
    (a server has one tokenizer; tests a few), so its compiled grammars live and die with it; no
    global map by identity (xgrammar's TokenizerInfo cannot be hashed)."""
    if tokenizer is None:
        raise StructuredOutputError("structured_output needs the tokenizer (pass tokenizer=...): the grammar is "
                                    "compiled against its vocabulary")
    with _CACHES_LOCK:
        by_size = tokenizer.__dict__.setdefault("_lorazor_grammar_caches", {})
        if vocab_size not in by_size:
            by_size[vocab_size] = GrammarCache(tokenizer, vocab_size)
        return by_size[vocab_size]


class Constraint:
    """One row's matcher: which tokens may come next, advanced with each accepted token."""

    def __init__(self, compiled, vocab_size: int, allowed: torch.Tensor | None = None):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.allowed = allowed  # a one-row bitmask ANDed with the grammar's (None: none)
        self.failed = False

    @property
    def done(self) -> bool:
        """The grammar is complete (its stop token accepted) or a token was refused: no more masks."""
        return self.failed or self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance with an accepted token; False (and no further masks) if the grammar refuses it."""
        if self.done:
            return False
        ok = self.matcher.accept_token(int(token))
        self.failed = not ok
        return ok

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed is not None:
            bitmask[row] &= self.allowed[0]


def new_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """An int32 bitmask of `rows` rows over `vocab_size` tokens (xgrammar's layout), on the host."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(rows, vocab_size)
    return mask.pin_memory() if pin else mask


# From this many constrained rows on, their bitmasks are filled by xgrammar's BatchGrammarMatcher,
# on several threads (128 rows: 0.5 ms against 0.85 ms one by one, on this project's CPU machine).
BATCH_FILL_ROWS = 8
_BATCH = None


class MaskBuffers:
    """Host bitmasks reused step after step: two, alternated, so a step's asynchronous copy to the
    GPU is never overwritten by the next step's fill (pinned on a GPU)."""

    def __init__(self):
        self._buffers: list = [None, None]
        self._turn = 0

    def take(self, rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] * 32 < vocab_size:
            buffer = self._buffers[self._turn] = new_bitmask(max(rows, 8), vocab_size, pin)
        return buffer[:rows]


def apply_masks(logits: torch.Tensor, constraints: list, rows: list[int], buffers: MaskBuffers | None = None) -> None:
    """Fill the bitmask of each `constraints[k]` (for row `rows[k]` of `logits`) on the host and
    apply them in place: a forbidden token's logit becomes -inf, so greedy, sampling, penalties and
    log-probabilities all see the masked logits. Rows not in `rows` are untouched."""
    import xgrammar as xgr

    if not rows:
        return
    vocab = logits.shape[-1]
    upto = max(rows) + 1
    mask = (buffers or MaskBuffers()).take(upto, vocab, logits.is_cuda)
    fill_masks(mask, constraints, rows)
    if logits.is_cuda:
        mask = mask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits[:upto], mask, vocab_size=vocab, indices=rows)


def fill_masks(mask: torch.Tensor, constraints: list, rows: list[int]) -> None:
    """Fill row `rows[k]` of host bitmask `mask` with what `constraints[k]` allows next (the host's
    part of a constrained step)."""
    import xgrammar as xgr

    if len(rows) >= BATCH_FILL_ROWS:  # xgrammar fills the rows on its own threads
        global _BATCH
        _BATCH = _BATCH or xgr.BatchGrammarMatcher()
        _BATCH.batch_fill_next_token_bitmask([c.matcher for c in constraints], mask, indices=rows)
        by_mask: dict = {}  # rows per shared extra mask (`no_control_chars`: one per tokenizer)
        for row, c in zip(rows, constraints):
            if c.allowed is not None:
                by_mask.setdefault(id(c.allowed), (c.allowed, []))[1].append(row)
        for allowed, limited in by_mask.values():
            mask[limited] &= allowed
    else:
        for row, constraint in zip(rows, constraints):
            constraint.fill(mask, row)



class StructuredLogitsProcessor:
    """An HF logits processor holding one `Constraint` (or None) per row, for `generate()`'s static
    loop: each call first advances every row's matcher with the token the previous call chose,
    then masks what its grammar forbids next. A row whose grammar is complete, or that ended
    otherwise (padding after EOS), is left alone."""

    def __init__(self, constraints: list, prompt_len: int):
        self.constraints = constraints
        self.prompt_len = prompt_len
        self.buffers = MaskBuffers()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_len:
            last = input_ids[:, -1].tolist()
            for constraint, token in zip(self.constraints, last):
                if constraint is not None and not constraint.done:
                    constraint.accept(token)
        live = [i for i, c in enumerate(self.constraints) if c is not None and not c.done]
        apply_masks(scores, [self.constraints[i] for i in live], live, self.buffers)
        return scores
