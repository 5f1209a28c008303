"""Tool signatures: argument validation and JSON-compatible parameter schemas.

Arguments arrive as msgpack values: None, bool, int, float, str, bytes, lists and maps. A
parameter annotated with one of those (or a union, ``Literal``, list, tuple or dict of them)
is checked and passed as it came. Three richer annotations are converted from such values
before the body is called, and described in the schema: an ``Enum`` from one of its members'
values, a dataclass from a map of its fields (converted in turn), and ``datetime``/``date``
from ISO 8601 text. An annotation no argument can ever satisfy (another class, such as
``Path``) is refused when the tool is registered.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Union, get_args, get_origin

__all__ = ("ToolSignature", "inspect_tool")


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    annotation: Any
    required: bool
    default: Any
    convert: bool = False
    """The annotation holds an Enum, a dataclass or a datetime: the value is converted."""


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
        kwargs = dict(args)
        for name, value in args.items():
            param = known.get(name)
            if param is None:
                continue
            if param.convert:
                kwargs[name] = _convert(value, param.annotation, f"argument {name!r}")
            elif not _matches(value, param.annotation):
                raise ValueError(
                    f"argument {name!r} must be {_describe(param.annotation)}, "
                    f"got {type(value).__name__}"
                )
        return kwargs

    def plain_types(self) -> tuple[dict[str, frozenset[type]], frozenset[str]] | None:
        """What :meth:`bind` passes unchanged, for arguments as msgpack decodes them (values of
        exactly None, bool, int, float, str, bytes, list or dict): each parameter's types whose
        values it takes as they are, and the names it requires. A map of arguments whose names
        are all here, whose values' types are among their parameter's, and that holds every
        required name binds to itself. None where a value's type alone cannot tell (a
        parameter converted, or annotated ``list[int]``, a ``Literal``...), or where extra
        arguments are taken (``**kwargs``)."""
        if self.accepts_extra:
            return None
        types: dict[str, frozenset[type]] = {}
        for p in self.params:
            admitted = None if p.convert else _plain_types(p.annotation)
            if admitted is None:
                return None
            types[p.name] = admitted
        return types, frozenset(p.name for p in self.params if p.required)

    def json_schema(self) -> dict[str, Any]:
        """A JSON Schema object describing the parameters (the MCP ``inputSchema`` shape)."""
        properties: dict[str, Any] = {}
        for p in self.params:
            prop = _schema_of(p.annotation)
            default = _json_default(p.default)
            if not p.required and _json_plain(default):
                prop = {**prop, "default": default}
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
        _check_annotation(annotation, f"tool {fn.__name__!r}: parameter {p.name!r}")
        required = p.default is inspect.Parameter.empty
        default = None if required else p.default
        convert = _converts(annotation)
        params.append(_Param(p.name, annotation, required, default, convert))
    return ToolSignature(tuple(params), execution_param, accepts_extra)


# ------------------------------------------------------------------ what may be annotated

#: What msgpack decodes to: a class annotation must admit one of these (or be converted).
_WIRE_TYPES: tuple[type, ...] = (str, int, float, bool, bytes, list, dict, type(None))


def _is_dataclass_type(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


def _is_enum_type(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, enum.Enum)


def _is_typeddict(annotation: Any) -> bool:
    return typing.is_typeddict(annotation)


@functools.cache
def _fields_of(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """A dataclass's fields that its constructor takes: (name, resolved annotation,
    required)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations: the raw ones
        hints = {}
    return tuple(
        (
            f.name,
            hints.get(f.name, f.type if not isinstance(f.type, str) else Any),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
        if f.init
    )


def _parts(annotation: Any) -> list[Any]:
    """The annotations inside a union or a generic (one level; none in a Literal)."""
    if get_origin(annotation) is Literal:
        return []
    return [a for a in get_args(annotation) if a is not Ellipsis]


def _converts(annotation: Any) -> bool:
    """Whether a value for ``annotation`` must be converted (it holds an Enum, a
    dataclass or a date)."""
    if _is_enum_type(annotation) or _is_dataclass_type(annotation):
        return True
    if annotation in (datetime.datetime, datetime.date):
        return True
    return any(_converts(a) for a in _parts(annotation))


def _check_annotation(annotation: Any, where: str, seen: frozenset[Any] = frozenset()) -> None:
    """Refuse, at registration, an annotation that no argument could satisfy."""
    if annotation is Any or annotation is None:
        return
    if _is_enum_type(annotation):
        bad = [m for m in annotation if not isinstance(m.value, (str, int, float))]
        if bad:
            raise TypeError(
                f"{where}: Enum {annotation.__name__} has members whose values are not a "
                f"string or a number ({', '.join(m.name for m in bad)}); an argument names "
                "a member by its value"
            )
        return
    if _is_dataclass_type(annotation):
        if annotation in seen:  # it contains itself
            return
        for name, field_annotation, _ in _fields_of(annotation):
            _check_annotation(field_annotation, f"{where}, field {name!r}", seen | {annotation})
        return
    if annotation in (datetime.datetime, datetime.date) or _is_typeddict(annotation):
        return
    if isinstance(annotation, type) and get_origin(annotation) is None:
        if not any(issubclass(t, annotation) for t in _WIRE_TYPES):
            raise TypeError(
                f"{where} is annotated {annotation.__name__}, which no argument can be "
                "(arguments are JSON-like values); use str, int, float, bool, bytes, a "
                "list, tuple or dict of them, an Enum, a dataclass, or datetime/date "
                "(converted from ISO 8601 text)"
            )
        return
    for part in _parts(annotation):
        _check_annotation(part, where, seen)


# ------------------------------------------------------------------ converting values


def _got(value: Any) -> str:
    return f"{value!r}" if isinstance(value, (str, int, float)) else type(value).__name__


def _convert(value: Any, annotation: Any, where: str) -> Any:
    """``value`` (as msgpack decoded it) for a parameter annotated ``annotation``: checked,
    and converted where the annotation holds an Enum, a dataclass or a date. Raises
    ValueError saying what was wrong, and where."""
    if annotation is Any or annotation is object:
        return value
    if annotation is None or annotation is type(None):
        if value is None:
            return None
        raise ValueError(f"{where} must be null, got {_got(value)}")
    origin = get_origin(annotation)
    if _is_union(origin):
        failures: list[ValueError] = []
        for alternative in get_args(annotation):
            try:
                return _convert(value, alternative, where)
            except ValueError as exc:
                if alternative is not type(None):
                    failures.append(exc)
        if value is not None and len(failures) == 1:  # X | None: what was wrong with it as X
            raise failures[0]
        raise ValueError(f"{where} must be {_describe(annotation)}, got {_got(value)}")
    if _is_enum_type(annotation):
        try:
            if not isinstance(value, bool):
                return annotation(value)
        except ValueError:
            pass
        values = ", ".join(repr(m.value) for m in annotation)
        raise ValueError(
            f"{where} must be one of {values} ({annotation.__name__}), got {_got(value)}"
        )
    if annotation is datetime.datetime or annotation is datetime.date:
        kind = "date and time" if annotation is datetime.datetime else "date"
        if isinstance(value, str):
            try:
                return annotation.fromisoformat(value)
            except ValueError:
                pass
        raise ValueError(f"{where} must be an ISO 8601 {kind} (text), got {_got(value)}")
    if _is_dataclass_type(annotation):
        return _convert_dataclass(value, annotation, where)
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be an array, got {_got(value)}")
        args = get_args(annotation)
        as_tuple = origin is tuple or annotation is tuple
        if as_tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ValueError(f"{where} must have {len(args)} items, got {len(value)}")
            return tuple(
                _convert(v, a, f"{where}[{i}]")
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            )
        item = args[0] if args else Any
        items = [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if as_tuple else items
    if origin in (dict, typing.Mapping) or annotation is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object, got {_got(value)}")
        args = get_args(annotation)
        if len(args) != 2:
            return value
        return {
            _convert(k, args[0], f"{where} key {k!r}"): _convert(v, args[1], f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if not _matches(value, annotation):
        raise ValueError(f"{where} must be {_describe(annotation)}, got {_got(value)}")
    return value


def _convert_dataclass(value: Any, cls: type, where: str) -> Any:
    if not isinstance(value, dict):
        raise ValueError(
            f"{where} must be an object with the fields of {cls.__name__}, got {_got(value)}"
        )
    fields = _fields_of(cls)
    names = {name for name, _, _ in fields}
    unknown = sorted(str(k) for k in value if k not in names)
    if unknown:
        raise ValueError(
            f"{where} has unexpected field(s) for {cls.__name__}: {', '.join(unknown)}"
        )
    missing = [name for name, _, required in fields if required and name not in value]
    if missing:
        raise ValueError(f"{where} lacks field(s) of {cls.__name__}: {', '.join(missing)}")
    kwargs = {
        name: _convert(value[name], annotation, f"{where}.{name}")
        for name, annotation, _ in fields
        if name in value
    }
    try:
        return cls(**kwargs)
    except Exception as exc:  # its __post_init__ refused the values
        raise ValueError(
            f"{where}: {cls.__name__}() refused it: {type(exc).__name__}: {exc}"
        ) from None


def _json_default(default: Any) -> Any:
    """A parameter's default as the schema shows it: an Enum member by its value, a date
    as ISO 8601 text."""
    if isinstance(default, enum.Enum):
        return default.value
    if isinstance(default, (datetime.datetime, datetime.date)):
        return default.isoformat()
    return default


def _json_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


#: The types :func:`_matches` admits for a simple annotation, of values as msgpack decodes them.
_PLAIN: Final[dict[Any, frozenset[type]]] = {
    Any: frozenset(_WIRE_TYPES),
    object: frozenset(_WIRE_TYPES),
    None: frozenset((type(None),)),
    type(None): frozenset((type(None),)),
    float: frozenset((int, float)),
    int: frozenset((int,)),
    str: frozenset((str,)),
    bool: frozenset((bool,)),
    bytes: frozenset((bytes,)),
    list: frozenset((list,)),
    tuple: frozenset((list,)),
    dict: frozenset((dict,)),
}


def _plain_types(annotation: Any) -> frozenset[type] | None:
    """:data:`_PLAIN`'s types for ``annotation``, or a union of such annotations; None for
    any other annotation (its values are checked by :func:`_matches` itself)."""
    if _is_union(get_origin(annotation)):
        admitted: frozenset[type] = frozenset()
        for member in get_args(annotation):
            types = _plain_types(member)
            if types is None:
                return None
            admitted |= types
        return admitted
    try:
        return _PLAIN.get(annotation)
    except TypeError:  # (an unhashable annotation)
        return None


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
    if _is_typeddict(annotation):
        return isinstance(value, dict)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # annotations we do not understand are not enforced


def _describe(annotation: Any) -> str:
    if annotation is None or annotation is type(None):
        return "null"
    if _is_union(get_origin(annotation)):
        return " or ".join(_describe(a) for a in get_args(annotation))
    if _is_enum_type(annotation):
        return f"one of {', '.join(repr(m.value) for m in annotation)} ({annotation.__name__})"
    if annotation is datetime.datetime:
        return "an ISO 8601 date and time"
    if annotation is datetime.date:
        return "an ISO 8601 date"
    if _is_dataclass_type(annotation):
        return f"an object with the fields of {annotation.__name__}"
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


_JSON_TYPES: dict[type, str] = {str: "string", bool: "boolean", int: "integer", float: "number"}


def _schema_of(annotation: Any, seen: frozenset[Any] = frozenset()) -> dict[str, Any]:
    if annotation in _SCALARS:
        return dict(_SCALARS[annotation])
    if _is_enum_type(annotation):
        values = [m.value for m in annotation]
        kinds = {_JSON_TYPES.get(type(v)) for v in values}
        schema: dict[str, Any] = {"enum": values, "title": annotation.__name__}
        if len(kinds) == 1 and None not in kinds:
            schema = {"type": kinds.pop(), **schema}
        return schema
    if annotation is datetime.datetime:
        return {"type": "string", "format": "date-time"}
    if annotation is datetime.date:
        return {"type": "string", "format": "date"}
    if _is_dataclass_type(annotation):
        if annotation in seen:  # a dataclass that contains itself
            return {"type": "object", "title": annotation.__name__}
        fields = _fields_of(annotation)
        schema = {
            "type": "object",
            "title": annotation.__name__,
            "properties": {
                name: _schema_of(field_annotation, seen | {annotation})
                for name, field_annotation, _ in fields
            },
        }
        required = [name for name, _, is_required in fields if is_required]
        if required:
            schema["required"] = required
        schema["additionalProperties"] = False
        return schema
    if _is_typeddict(annotation):
        return {"type": "object"}
    origin = get_origin(annotation)
    args = get_args(annotation)
    if _is_union(origin):
        return {"anyOf": [_schema_of(a, seen) for a in args]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        schema = {"type": "array"}
        if args and args[-1] is not Ellipsis and origin is not tuple:
            schema["items"] = _schema_of(args[0], seen)
        return schema
    if origin in (dict, typing.Mapping) or annotation is dict:
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = _schema_of(args[1], seen)
        return schema
    return {}
