"""Cancel causes: a closed set, validated strictly, frozen and detached (CONTRACT C1.2, C1.3)."""

from __future__ import annotations

import collections
import copy
import operator
import pickle
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from toolpool import CancelCause, CancelController, validate_cause
from toolpool.core import CALLER_KINDS, RUNTIME_KINDS

ALL_KINDS = ("user", "parent", "disposed", "timeout")


class StrSub(str):
    __slots__ = ()


class DictSub(dict[Any, Any]):
    pass


class AlwaysEqual:
    """A key that claims to equal everything, "kind" included."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


def expected_kind(value: object, *, allow_runtime: bool) -> str | None:
    """The oracle, written independently of the code: the kind accepted, or None if rejected."""
    allowed = ALL_KINDS if allow_runtime else ("user", "parent")
    if value is None:
        return "user"
    if isinstance(value, CancelCause):
        return value.kind if value.kind in allowed else None
    if type(value) is not dict:
        return None
    if [type(k) for k in value] != [str]:
        return None
    [(key, kind)] = value.items()
    if key != "kind" or type(kind) is not str:
        return None
    return kind if kind in allowed else None


kinds = st.one_of(
    st.sampled_from(ALL_KINDS),
    st.sampled_from(["User", "USER", " user", "user ", "", "kind", "cancel", "usr", "parents"]),
    st.text(max_size=8),
    st.sampled_from(ALL_KINDS).map(StrSub),
    st.sampled_from(ALL_KINDS).map(str.encode),
    st.integers(),
    st.booleans(),
    st.none(),
    st.lists(st.sampled_from(ALL_KINDS), max_size=2),
    st.sampled_from(ALL_KINDS).map(lambda k: {"kind": k}),
)
keys = st.one_of(
    st.just("kind"),
    st.sampled_from(["Kind", "KIND", "kind ", "type", "reason", "cause", ""]),
    st.text(max_size=6),
    st.just(StrSub("kind")),
    st.just(b"kind"),
    st.integers(),
    st.builds(AlwaysEqual),
)
exact_shape = st.builds(lambda k: {"kind": k}, kinds)
one_key = st.builds(lambda k, v: {k: v}, keys, kinds)
extra_keys = st.builds(
    lambda k, extra: {"kind": k, **extra},
    kinds,
    st.dictionaries(keys, kinds, min_size=1, max_size=3),
)
other_mappings = st.one_of(
    st.builds(lambda k: DictSub(kind=k), kinds),
    st.builds(lambda k: collections.OrderedDict(kind=k), kinds),
    st.builds(lambda k: MappingProxyType({"kind": k}), kinds),
    st.builds(lambda k: collections.UserDict(kind=k), kinds),
    st.builds(lambda k: collections.defaultdict(str, kind=k), kinds),
)
not_mappings = st.one_of(
    st.sampled_from(ALL_KINDS),  # a bare kind string is not a cause
    st.text(max_size=10),
    st.binary(max_size=5),
    st.integers(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.lists(st.sampled_from(ALL_KINDS), max_size=3),
    st.tuples(st.just("kind"), st.sampled_from(ALL_KINDS)),
    st.lists(st.tuples(st.just("kind"), st.sampled_from(ALL_KINDS)), max_size=1),
    st.frozensets(st.sampled_from(ALL_KINDS)),
    st.builds(ValueError, st.sampled_from(ALL_KINDS)),
    st.builds(RuntimeError, st.just("user")),
    st.builds(object),
    st.builds(AlwaysEqual),
)
causes = st.sampled_from(ALL_KINDS).map(CancelCause)
candidates = st.one_of(
    st.none(), exact_shape, one_key, extra_keys, other_mappings, not_mappings, causes
)


# ----------------------------------------------------------------------------- properties


@given(value=candidates, allow_runtime=st.booleans())
@example(value={StrSub("kind"): "user"}, allow_runtime=False)
@example(value={AlwaysEqual(): "user"}, allow_runtime=True)
@example(value={"kind": StrSub("user")}, allow_runtime=False)
@example(value=DictSub(kind="user"), allow_runtime=False)
@example(value={"kind": "timeout"}, allow_runtime=False)
@example(value={"kind": "timeout"}, allow_runtime=True)
def test_only_the_exact_accepted_shapes_pass(value: object, allow_runtime: bool) -> None:
    expected = expected_kind(value, allow_runtime=allow_runtime)
    if expected is None:
        with pytest.raises((TypeError, ValueError)) as info:
            validate_cause(value, allow_runtime=allow_runtime)
        assert str(info.value), "a rejection must say what is wrong"
    else:
        cause = validate_cause(value, allow_runtime=allow_runtime)
        assert type(cause) is CancelCause
        assert cause.kind == expected
        assert cause == {"kind": expected}


@given(value=candidates)
def test_controller_cancel_validates_like_validate_cause(value: object) -> None:
    controller = CancelController()
    expected = expected_kind(value, allow_runtime=False)
    if expected is None:
        with pytest.raises((TypeError, ValueError)):
            controller.cancel(value)
        assert not controller.signal.cancelled
        assert controller.signal.reason is None
    else:
        assert controller.cancel(value) is True
        assert controller.signal.reason == {"kind": expected}


@given(value=candidates)
def test_validation_is_the_same_when_already_cancelled(value: object) -> None:
    controller = CancelController()
    controller.cancel({"kind": "parent"})
    expected = expected_kind(value, allow_runtime=False)
    if expected is None:
        with pytest.raises((TypeError, ValueError)):
            controller.cancel(value)
    else:
        assert controller.cancel(value) is False
    assert controller.signal.reason == {"kind": "parent"}


@given(value=st.dictionaries(st.text(max_size=6), st.sampled_from(ALL_KINDS), max_size=3))
def test_accepted_values_are_detached_from_the_callers_dict(value: dict[str, str]) -> None:
    expected = expected_kind(value, allow_runtime=True)
    try:
        cause = validate_cause(value, allow_runtime=True)
    except (TypeError, ValueError):
        assert expected is None
        return
    assert cause.kind == expected
    value.clear()
    value["kind"] = "parent" if expected != "parent" else "user"
    value["extra"] = "x"
    assert cause.kind == expected
    assert dict(cause) == {"kind": expected}


# ----------------------------------------------------------------------------- the closed set


def test_the_closed_set_of_kinds() -> None:
    assert frozenset({"user", "parent"}) == CALLER_KINDS
    assert frozenset({"disposed", "timeout"}) == RUNTIME_KINDS


def test_none_means_user() -> None:
    assert validate_cause(None) == {"kind": "user"}
    assert validate_cause(None).kind == "user"


@pytest.mark.parametrize("kind", ["user", "parent"])
def test_callers_may_request_user_and_parent(kind: str) -> None:
    assert validate_cause({"kind": kind}).kind == kind


@pytest.mark.parametrize("kind", ["disposed", "timeout"])
def test_runtime_kinds_need_allow_runtime(kind: str) -> None:
    with pytest.raises(ValueError, match="reserved for the runtime"):
        validate_cause({"kind": kind})
    with pytest.raises(ValueError, match="reserved for the runtime"):
        validate_cause(CancelCause(kind))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserved for the runtime"):
        CancelController().cancel({"kind": kind})
    assert validate_cause({"kind": kind}, allow_runtime=True).kind == kind


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("user", TypeError, "must be a dict"),
        ("", TypeError, "must be a dict"),
        (["user"], TypeError, "not list"),
        ([("kind", "user")], TypeError, "not list"),
        (ValueError("user"), TypeError, "not ValueError"),
        (object(), TypeError, "not object"),
        (42, TypeError, "not int"),
        (DictSub(kind="user"), TypeError, "not DictSub"),
        (MappingProxyType({"kind": "user"}), TypeError, "must be a dict"),
        ({}, ValueError, "exactly one key"),
        ({"kind": "user", "message": "stop"}, ValueError, "exactly one key"),
        ({"type": "user"}, ValueError, "exactly one key"),
        ({"kind": "bogus"}, ValueError, "unknown cancel cause kind 'bogus'"),
        ({"kind": "User"}, ValueError, "unknown cancel cause kind"),
        ({"kind": 1}, TypeError, "must be a str, not int"),
        ({"kind": None}, TypeError, "must be a str, not NoneType"),
        ({"kind": StrSub("user")}, TypeError, "must be a str, not StrSub"),
        ({"kind": b"user"}, TypeError, "must be a str, not bytes"),
        ({1: "user"}, TypeError, "keys must be strings"),
        ({StrSub("kind"): "user"}, TypeError, "keys must be strings"),
        ({AlwaysEqual(): "user"}, TypeError, "keys must be strings"),
    ],
)
def test_rejections_are_clear(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        validate_cause(value)
    with pytest.raises(error, match=match):
        validate_cause(value, allow_runtime=True)


# ----------------------------------------------------------------------------- frozen values


def test_cancel_cause_is_immutable() -> None:
    cause = validate_cause({"kind": "parent"})
    with pytest.raises(AttributeError):
        cause.kind = "user"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cause._kind = "user"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del cause._kind  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cause.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        cause["kind"] = "user"  # type: ignore[index]
    assert cause.kind == "parent"
    assert validate_cause({"kind": "parent"}).kind == "parent"


def test_cancel_cause_is_a_one_key_mapping() -> None:
    cause = validate_cause({"kind": "parent"})
    assert cause == {"kind": "parent"}
    assert operator.eq({"kind": "parent"}, cause)  # the reflected comparison too
    assert cause != {"kind": "user"}
    assert cause != {"kind": "parent", "extra": 1}
    assert cause != "parent"
    assert cause != CancelCause("user")
    assert dict(cause) == {"kind": "parent"}
    assert list(cause) == ["kind"]
    assert len(cause) == 1
    assert cause["kind"] == "parent"
    with pytest.raises(KeyError):
        cause["other"]
    assert repr(cause) == "CancelCause(kind='parent')"


def test_cancel_cause_wire_form_is_a_fresh_plain_dict() -> None:
    cause = validate_cause(None)
    wire = cause.to_wire()
    assert type(wire) is dict
    assert wire == {"kind": "user"}
    wire["kind"] = "parent"
    assert cause.to_wire() == {"kind": "user"}
    assert validate_cause(cause.to_wire()) is cause


def test_cancel_causes_are_interned_and_survive_copies() -> None:
    cause = validate_cause({"kind": "parent"})
    assert validate_cause({"kind": "parent"}) is cause
    assert CancelCause("parent") is cause
    assert validate_cause(cause) is cause
    assert pickle.loads(pickle.dumps(cause)) is cause
    assert copy.copy(cause) is cause
    assert copy.deepcopy(cause) is cause
    assert hash(cause) == hash(CancelCause("parent"))
    assert hash(cause) != hash(CancelCause("user"))


def test_cancel_cause_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="unknown cancel cause kind"):
        CancelCause("bogus")  # type: ignore[arg-type]


def test_accepted_value_is_detached_from_the_callers_dict() -> None:
    raw = {"kind": "parent"}
    cause = validate_cause(raw)
    assert cause is not raw
    raw["kind"] = "user"
    raw["extra"] = "x"
    assert cause == {"kind": "parent"}

    controller = CancelController()
    raw = {"kind": "parent"}
    controller.cancel(raw)
    raw["kind"] = "user"
    del raw["kind"]
    assert controller.signal.reason == {"kind": "parent"}
    assert controller.signal.reason is CancelCause("parent")
