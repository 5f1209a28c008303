"""Cancel causes: a closed vocabulary, validated strictly at every boundary (C1.2, C1.3)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal, final

__all__ = (
    "CALLER_KINDS",
    "RUNTIME_KINDS",
    "CancelCause",
    "CauseKind",
    "validate_cause",
)

#: Every kind of cause that exists. Callers may request ``user`` and ``parent``; the runtime
#: adds ``disposed`` (the pool or group is being closed) and ``timeout`` (a deadline).
CauseKind = Literal["user", "parent", "disposed", "timeout"]

CALLER_KINDS: Final = frozenset({"user", "parent"})
RUNTIME_KINDS: Final = frozenset({"disposed", "timeout"})
_ALL_KINDS: Final = CALLER_KINDS | RUNTIME_KINDS


@final
class CancelCause(Mapping[str, str]):
    """A frozen cancel cause: a mapping with exactly one key, ``kind``.

    Instances are interned (one per kind) and compare equal to the plain mapping
    ``{"kind": kind}``, which is also their wire form. Build them with
    :func:`validate_cause`; the runtime-only kinds come from the runtime.
    """

    __slots__ = ("_kind",)
    _interned: dict[str, CancelCause] = {}  # noqa: RUF012 (class-level cache)

    _kind: CauseKind

    def __new__(cls, kind: CauseKind) -> CancelCause:
        try:
            return cls._interned[kind]
        except KeyError:
            pass
        if kind not in _ALL_KINDS:
            raise ValueError(f"unknown cancel cause kind {kind!r}")
        self = super().__new__(cls)
        object.__setattr__(self, "_kind", kind)
        cls._interned[kind] = self
        return self

    @property
    def kind(self) -> CauseKind:
        """Which kind of cause this is."""
        return self._kind

    def __getitem__(self, key: str) -> str:
        if key == "kind":
            return self._kind
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        yield "kind"

    def __len__(self) -> int:
        return 1

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CancelCause is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("CancelCause is immutable")

    def __hash__(self) -> int:
        return hash(("CancelCause", self._kind))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CancelCause):
            return other is self
        if isinstance(other, Mapping):
            return dict(other) == {"kind": self._kind}
        return NotImplemented

    def __repr__(self) -> str:
        return f"CancelCause(kind={self._kind!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (CancelCause, (self._kind,))

    def to_wire(self) -> dict[str, str]:
        """The plain-dict wire form, ``{"kind": ...}``."""
        return {"kind": self._kind}


def validate_cause(value: object, *, allow_runtime: bool = False) -> CancelCause:
    """Validate a caller-supplied cause and return the frozen, detached value.

    ``None`` means the default, ``{"kind": "user"}``. Otherwise ``value`` must be a plain
    ``dict`` (or a :class:`CancelCause`) with exactly one key, ``"kind"``, whose value is a
    supported kind. Strings, lists, exceptions, other mappings and objects are rejected with
    :class:`TypeError`; extra or missing keys and unknown kinds with :class:`ValueError`.
    The runtime-only kinds (``disposed``, ``timeout``) are accepted only with
    ``allow_runtime=True`` (the wire from the supervisor, and the runtime itself).
    """
    if value is None:
        return CancelCause("user")
    if isinstance(value, CancelCause):
        kind: str = value.kind
    else:
        if type(value) is not dict:
            raise TypeError(
                f"a cancel cause must be a dict like {{'kind': 'user'}}, not {type(value).__name__}"
            )
        keys = list(value)
        # Check key types first: a str subclass or an object that compares equal to "kind"
        # must not pass for the key (nor escape as a KeyError on the lookup below).
        if any(type(k) is not str for k in keys):
            raise TypeError("a cancel cause's keys must be strings")
        if keys != ["kind"]:
            raise ValueError(
                f"a cancel cause has exactly one key, 'kind'; got keys {sorted(map(str, keys))}"
            )
        raw = value["kind"]
        if type(raw) is not str:
            raise TypeError(f"a cancel cause's kind must be a str, not {type(raw).__name__}")
        kind = raw
    if kind in CALLER_KINDS:
        return CancelCause(kind)  # type: ignore[arg-type]
    if kind in RUNTIME_KINDS:
        if allow_runtime:
            return CancelCause(kind)  # type: ignore[arg-type]
        raise ValueError(f"cancel cause kind {kind!r} is reserved for the runtime")
    raise ValueError(f"unknown cancel cause kind {kind!r}; expected one of {sorted(CALLER_KINDS)}")
