"""Tool signatures: argument validation and JSON-compatible parameter schemas."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

__all__ = ("ToolSignature", "inspect_tool")


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    annotation: Any
    required: bool
    default: Any


@dataclass(frozen=True, slots=True)
class ToolSignature:
    """What the registry knows of a tool function's parameters."""

    params: tuple[_Param, ...]
    execution_param: str | None
    accepts_extra: bool

    def bind(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Check ``args`` against the signature; return the keyword arguments (no view)."""
        known = {p.name: p for p in self.params}
        if self.execution_param is not None and self.execution_param in args:
            raise ValueError(f"argument {self.execution_param!r} is supplied by the runtime")
        unknown = [k for k in args if k not in known]
        if unknown and not self.accepts_extra:
            raise ValueError(f"unexpected argument(s): {', '.join(sorted(unknown))}")
        missing = [p.name for p in self.params if p.required and p.name not in args]
        if missing:
            raise ValueError(f"missing required argument(s): {', '.join(missing)}")
        for name, value in args.items():
            param = known.get(name)
            if param is not None and not _matches(value, param.annotation):
                raise ValueError(
                    f"argument {name!r} must be {_describe(param.annotation)}, "
                    f"got {type(value).__name__}"
                )
        return dict(args)

    def json_schema(self) -> dict[str, Any]:
        """A JSON Schema object describing the parameters (the MCP ``inputSchema`` shape)."""
        properties: dict[str, Any] = {}
        for p in self.params:
            prop = _schema_of(p.annotation)
            if not p.required and _json_plain(p.default):
                prop = {**prop, "default": p.default}
            properties[p.name] = prop
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        required = [p.name for p in self.params if p.required]
        if required:
            schema["required"] = required
        if not self.accepts_extra:
            schema["additionalProperties"] = False
        return schema


def inspect_tool(fn: Callable[..., Any], execution_type: type) -> ToolSignature:
    """Read a tool function's signature. The parameter annotated ``execution_type`` (any name)
    receives the execution view; the rest are the tool's arguments."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: fall back to the raw ones
        hints = dict(getattr(fn, "__annotations__", {}))
    sig = inspect.signature(fn)
    params: list[_Param] = []
    execution_param: str | None = None
    accepts_extra = False
    for p in sig.parameters.values():
        annotation = hints.get(p.name, p.annotation)
        if annotation is execution_type:
            if execution_param is not None:
                raise TypeError(f"tool {fn.__name__!r} declares two execution parameters")
            execution_param = p.name
            continue
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            accepts_extra = True
            continue
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            raise TypeError(
                f"tool {fn.__name__!r}: parameter {p.name!r} cannot be passed by keyword"
            )
        if annotation is inspect.Parameter.empty:
            annotation = Any
        required = p.default is inspect.Parameter.empty
        params.append(_Param(p.name, annotation, required, None if required else p.default))
    return ToolSignature(tuple(params), execution_param, accepts_extra)


def _json_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


def _matches(value: Any, annotation: Any) -> bool:
    if annotation is Any or annotation is object:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    origin = get_origin(annotation)
    if _is_union(origin):
        return any(_matches(value, a) for a in get_args(annotation))
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(annotation))
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (str, bool, bytes):
        return isinstance(value, annotation)
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        args = get_args(annotation)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(args) == len(value) and all(map(_matches, value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin in (dict, typing.Mapping) or annotation is dict:
        if not isinstance(value, dict):
            return False
        args = get_args(annotation)
        return not args or all(
            _matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items()
        )
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # annotations we do not understand are not enforced


def _describe(annotation: Any) -> str:
    if isinstance(annotation, type):
        return {"float": "a number", "int": "an integer", "str": "a string"}.get(
            annotation.__name__, f"of type {annotation.__name__}"
        )
    return f"of type {annotation!r}".replace("typing.", "")


_SCALARS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    bytes: {"type": "string", "contentEncoding": "base64"},
    type(None): {"type": "null"},
    None: {"type": "null"},
}


def _schema_of(annotation: Any) -> dict[str, Any]:
    if annotation in _SCALARS:
        return dict(_SCALARS[annotation])
    origin = get_origin(annotation)
    args = get_args(annotation)
    if _is_union(origin):
        return {"anyOf": [_schema_of(a) for a in args]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        schema: dict[str, Any] = {"type": "array"}
        if args and args[-1] is not Ellipsis and origin is not tuple:
            schema["items"] = _schema_of(args[0])
        return schema
    if origin in (dict, typing.Mapping) or annotation is dict:
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = _schema_of(args[1])
        return schema
    return {}
