"""Which JSON schemas the grammar engine enforces exactly, checked before one is compiled.

xgrammar compiles most of JSON Schema into a grammar, but some keywords it accepts and then does
not enforce (measured with its matcher on instances that break them: `tests/engine/
test_structured_outputs.py`): `not`, `if`/`then`/`else`, `uniqueItems`, `dependentRequired` and
`dependencies`, `contains`, `unevaluated*`, remote `$ref`s, `allOf` beside other keywords or with
several branches, `anyOf`/`oneOf` beside other validation keywords, `oneOf` whose branches can
overlap (it decodes them as `anyOf`), a `$ref` beside other validation keywords, and `required`
names that `properties` does not declare. `normalize` first rewrites what can be rewritten with
the same instances valid (siblings moved into branches, `allOf` branches merged, `required` names
declared); a schema that still uses any of them could yield an output that does not validate, so
it is refused, naming the keyword and where it is.
"""

from __future__ import annotations

import copy

# Keywords the grammar does not enforce (why: the module docstring).
UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependencies", "dependentSchemas", "contains",
              "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
              "$recursiveRef", "additionalItems")
# Keywords that never constrain an instance (they may sit beside a `$ref` or an `allOf`).
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
               "$schema", "$id", "$anchor", "$defs", "definitions", "markdownDescription", "format",
               "enumDescriptions", "markdownEnumDescriptions", "deprecationMessage", "errorMessage",
               "x-intellij-html-description",
               "defaultSnippets", "doNotSuggest", "patternErrorMessage", "$vocabulary"}
# Where sub-schemas sit: maps of them, lists of them, single ones.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")
# JSON types no value has two of (integer is also a number).
DISJOINT_TYPES = ("object", "array", "string", "boolean", "null")


def schema_problem(schema, path: str = "#") -> str | None:
    """Why the grammar engine would not enforce `schema` exactly (the first reason found, with its
    place as a JSON pointer), or None."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        return None
    for key in UNENFORCED:
        if key in schema:
            return f"'{key}' at {path} is not enforced by the grammar engine"
    if schema.get("uniqueItems") is True:
        return f"'uniqueItems' at {path} is not enforced by the grammar engine"
    ref = schema.get("$ref")
    if ref is not None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return f"'$ref' {ref!r} at {path} points outside the schema (only local '#/...' references are resolved)"
        beside = sorted(set(schema) - ANNOTATIONS - {"$ref"})
        if beside:
            return f"'$ref' at {path} sits beside {beside}, which the grammar engine would not combine with it"
    if "allOf" in schema:
        beside = sorted(set(schema) - ANNOTATIONS - {"allOf"})
        if len(schema["allOf"]) != 1 or beside:
            return (f"'allOf' at {path} has {len(schema['allOf'])} branches" + (f" beside {beside}" if beside else "")
                    + ": only a single branch alone is enforced")
    required = schema.get("required")
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [n for n in required if n not in properties] if isinstance(required, list) else []
    if missing and ("patternProperties" in schema or schema.get("additionalProperties") is False):
        return (f"'required' at {path} names {missing[0]!r}, which 'properties' does not declare (beside "
                "patternProperties or additionalProperties false, the grammar engine cannot require it)")
    for key in ("anyOf", "oneOf"):
        beside = sorted(set(schema) - ANNOTATIONS - {key})
        if key in schema and beside:
            return (f"'{key}' at {path} sits beside {beside}, which the grammar engine would not combine with its "
                    "branches (put them inside each branch)")
    if "oneOf" in schema and not _disjoint(schema["oneOf"]):
        return (f"'oneOf' at {path} has branches that may overlap, which the grammar engine decodes as 'anyOf' "
                "(use anyOf, or branches of distinct types)")
    for key in SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            found = schema_problem(sub, f"{path}/{key}/{name}")
            if found:
                return found
    for key in SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or ()) if isinstance(schema.get(key), list) else ():
            found = schema_problem(sub, f"{path}/{key}/{i}")
            if found:
                return found
    for key in SCHEMA_VALUES:
        found = schema_problem(schema.get(key), f"{path}/{key}")
        if found:
            return found
    return None


def _disjoint(branches) -> bool:
    """Whether no value can match two of `branches`: each declares one type of `DISJOINT_TYPES`
    (or integer/number, not both), all different."""
    types = []
    for branch in branches if isinstance(branches, list) else ():
        kind = branch.get("type") if isinstance(branch, dict) else None
        if not isinstance(kind, str):
            return False
        types.append("number" if kind == "integer" else kind)
    return len(set(types)) == len(types)


class Unmergeable(ValueError):
    """Two schemas to be merged constrain the same keyword differently."""


def normalize(schema):
    """A copy of `schema` rewritten into the forms the grammar engine enforces, with the same
    instances valid: keywords beside an `anyOf`/`oneOf` moved into each branch (P and (A or B) is
    (P and A) or (P and B)); an `allOf`'s branches (and its siblings) merged into one schema where
    no keyword is given twice; `required` names declared in `properties`. Where a merge would
    have to combine two values of one keyword, the schema is left as it was there (then
    `schema_problem` refuses it). A local `$ref` inside an embedded resource (a sub-schema with its
    own `$id`) is resolved against that resource, as JSON Schema says, and rewritten to point from
    the root (the grammar engine resolves every `#/...` from the root)."""
    schema = copy.deepcopy(schema)
    # Drafts 4-7 ignore every keyword beside a `$ref`, its `$id` included.
    legacy = isinstance(schema, dict) and "draft-0" in str(schema.get("$schema", ""))
    _rebase(schema, "", "", legacy)
    return _normalize(schema)


def _rebase(schema, path: str, base: str, legacy: bool) -> None:
    """Rewrite, in place, each `#...` `$ref` under an embedded resource at JSON pointer `base` to `#<base>...`."""
    if not isinstance(schema, dict):
        return
    new_id = isinstance(schema.get("$id"), str) and not schema["$id"].startswith("#")
    if path and new_id and not (legacy and "$ref" in schema):
        base = path  # a new resource ("#name", draft 6/7's plain-name fragment, is an anchor, not a new base)
    ref = schema.get("$ref")
    if base and isinstance(ref, str) and ref.startswith("#") and (ref == "#" or ref.startswith("#/")):
        schema["$ref"] = "#" + base + ref[1:]
    for key in SCHEMA_MAPS:
        for name, sub in schema[key].items() if isinstance(schema.get(key), dict) else ():
            _rebase(sub, f"{path}/{key}/{_pointer(name)}", base, legacy)
    for key in SCHEMA_LISTS:
        for i, sub in enumerate(schema[key]) if isinstance(schema.get(key), list) else ():
            _rebase(sub, f"{path}/{key}/{i}", base, legacy)
    for key in SCHEMA_VALUES:
        _rebase(schema.get(key), f"{path}/{key}", base, legacy)


def _pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _normalize(schema):
    if not isinstance(schema, dict):
        return schema
    # Merges first, on the schemas as written (declared names would read as conflicts), then the parts.
    if isinstance(schema.get("allOf"), list) and all(isinstance(b, dict) and "$ref" not in b for b in schema["allOf"]):
        try:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for branch in schema["allOf"]:
                merged = _merge(merged, branch)
            schema = merged
        except Unmergeable:
            pass
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        beside = {k: v for k, v in schema.items() if k not in ANNOTATIONS and k != key}
        if isinstance(branches, list) and beside and all(isinstance(b, dict) and "$ref" not in b for b in branches):
            try:
                merged = [_merge(beside, b) for b in branches]
            except Unmergeable:
                continue
            schema = {k: v for k, v in schema.items() if k not in beside}
            schema[key] = merged
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            schema[key] = {name: _normalize(sub) for name, sub in schema[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            schema[key] = [_normalize(sub) for sub in schema[key]]
    for key in SCHEMA_VALUES:
        if key in schema:
            schema[key] = _normalize(schema[key])
    _declare(schema, recurse=False)
    return schema


def _merge(a: dict, b: dict) -> dict:
    """One schema valid exactly where both `a` and `b` are (Unmergeable if a keyword would need both
    values): `required` lists joined, `properties` joined where no name is in both, annotations kept
    from `a`, any other keyword only if equal or in one of them."""
    out = dict(a)
    for key, value in b.items():
        if key not in out or key in ANNOTATIONS:
            out.setdefault(key, value)
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = list(dict.fromkeys(out[key] + value))
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            if set(value) & set(out[key]) and any(out[key][n] != value[n] for n in set(value) & set(out[key])):
                raise Unmergeable(key)
            out[key] = {**out[key], **value}
        elif out[key] != value:
            raise Unmergeable(key)
    # additionalProperties and patternProperties judge names against their own object's properties:
    # joining two objects' properties would let one's names past the other's additionalProperties.
    for one, other in ((a, b), (b, a)):
        if ("additionalProperties" in one or "patternProperties" in one) and set(other.get("properties") or ()) - set(
                one.get("properties") or ()):
            raise Unmergeable("additionalProperties")
    return out


def _declare(schema, recurse: bool = True) -> None:
    if not isinstance(schema, dict):
        return
    required = schema.get("required")
    if isinstance(required, list):
        properties = schema.setdefault("properties", {})
        extra = schema.get("additionalProperties", True)
        if isinstance(properties, dict):
            for name in required:
                if isinstance(name, str) and name not in properties and extra is not False:
                    properties[name] = extra if isinstance(extra, dict) else {}
    if not recurse:
        return
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _declare(sub)
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                _declare(sub)
    for key in SCHEMA_VALUES:
        _declare(schema.get(key))
