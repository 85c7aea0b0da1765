"""A fast path for ``jsonschema``: the schema compiled once into nested Python closures.

Validating ten thousand run files with ``jsonschema``'s interpreter costs most of an audit,
so the auditor first asks a compiled predicate.  The compiler handles the keywords that
mxdb's generated schemas use (type, properties, required, additionalProperties, items,
anyOf, allOf, $ref to $defs, const, enum, pattern, numeric and length bounds) with
``jsonschema``'s semantics; for a schema with any other keyword it declines (``compile``
returns ``None``) and ``jsonschema`` does all the work.  A document the fast path rejects
is re-validated by ``jsonschema``, which alone produces the findings, so the fast path can
only save time, never invent a finding; a test compares both on mutated documents.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[Any], bool]

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "format",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$defs",
        "definitions",
    }
)


class Unsupported(Exception):
    """The schema uses a keyword the fast path does not implement."""


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_TYPES: dict[str, Check] = {
    "object": lambda x: isinstance(x, dict),
    "array": lambda x: isinstance(x, list),
    "string": lambda x: isinstance(x, str),
    "boolean": lambda x: isinstance(x, bool),
    "null": lambda x: x is None,
    "number": _is_number,
    "integer": lambda x: (
        (isinstance(x, int) and not isinstance(x, bool))
        or (isinstance(x, float) and x.is_integer())
    ),
}


def _equal(a: Any, b: Any) -> bool:
    """JSON equality as jsonschema defines it (booleans are not numbers)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, list) or isinstance(b, list):
        return (
            isinstance(a, list)
            and isinstance(b, list)
            and len(a) == len(b)
            and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


class _Compiler:
    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root
        self.refs: dict[str, Check] = {}

    def ref(self, ref: str) -> Check:
        if not ref.startswith("#/$defs/"):
            raise Unsupported(ref)
        name = ref[len("#/$defs/") :]
        if name not in self.refs:
            holder: list[Check] = []
            self.refs[name] = lambda x: holder[0](x)  # recursion-safe forward reference
            holder.append(self.compile(self.root["$defs"][name]))
        return self.refs[name]

    def compile(self, schema: Any) -> Check:
        if schema is True:
            return lambda x: True
        if schema is False:
            return lambda x: False
        if not isinstance(schema, dict):
            raise Unsupported(repr(schema))
        checks: list[Check] = []
        for key, value in schema.items():
            if key in _ANNOTATIONS or key.startswith("x-"):
                continue
            checks.append(self.keyword(key, value, schema))
        if not checks:
            return lambda x: True
        if len(checks) == 1:
            return checks[0]
        return lambda x: all(c(x) for c in checks)

    def keyword(self, key: str, value: Any, schema: Mapping[str, Any]) -> Check:
        if key == "type":
            types = [value] if isinstance(value, str) else list(value)
            fns = [_TYPES[t] for t in types]
            return fns[0] if len(fns) == 1 else (lambda x: any(f(x) for f in fns))
        if key == "$ref":
            return self.ref(value)
        if key == "const":
            return lambda x: _equal(x, value)
        if key == "enum":
            return lambda x: any(_equal(x, v) for v in value)
        if key == "anyOf":
            subs = [self.compile(s) for s in value]
            return lambda x: any(s(x) for s in subs)
        if key == "allOf":
            subs = [self.compile(s) for s in value]
            return lambda x: all(s(x) for s in subs)
        if key == "required":
            req = tuple(value)
            return lambda x: not isinstance(x, dict) or all(k in x for k in req)
        if key == "properties":
            props = {k: self.compile(v) for k, v in value.items()}
            items = tuple(props.items())

            def properties(x: Any) -> bool:
                if not isinstance(x, dict):
                    return True
                return all(f(x[k]) for k, f in items if k in x)

            return properties
        if key == "additionalProperties":
            if "patternProperties" in schema:
                raise Unsupported("patternProperties")
            known = frozenset(schema.get("properties", {}))
            sub = self.compile(value)

            def additional(x: Any) -> bool:
                if not isinstance(x, dict):
                    return True
                return all(sub(v) for k, v in x.items() if k not in known)

            return additional
        if key == "items":
            if "prefixItems" in schema:
                raise Unsupported("prefixItems")
            sub = self.compile(value)
            return lambda x: not isinstance(x, list) or all(sub(v) for v in x)
        if key == "pattern":
            rx = re.compile(value)
            return lambda x: not isinstance(x, str) or rx.search(x) is not None
        bounds: dict[str, Callable[[Any, Any], bool]] = {
            "minimum": lambda x, v: not x < v,
            "maximum": lambda x, v: not x > v,
            "exclusiveMinimum": lambda x, v: not x <= v,
            "exclusiveMaximum": lambda x, v: not x >= v,
        }
        if key in bounds:
            op = bounds[key]
            return lambda x: not _is_number(x) or op(x, value)
        sizes: dict[str, tuple[type[Any], Callable[[int], bool]]] = {
            "minLength": (str, lambda n: n >= value),
            "maxLength": (str, lambda n: n <= value),
            "minItems": (list, lambda n: n >= value),
            "maxItems": (list, lambda n: n <= value),
            "minProperties": (dict, lambda n: n >= value),
            "maxProperties": (dict, lambda n: n <= value),
        }
        if key in sizes:
            kind, ok = sizes[key]

            def size(x: Any) -> bool:
                sized: Any = x
                return not isinstance(sized, kind) or ok(len(sized))

            return size
        raise Unsupported(key)


def compile_schema(schema: Mapping[str, Any]) -> Check | None:
    """A predicate equivalent to ``jsonschema``'s ``is_valid`` for ``schema``, or ``None``."""
    try:
        return _Compiler(schema).compile(dict(schema))
    except Unsupported:
        return None
