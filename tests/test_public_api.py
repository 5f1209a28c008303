"""The public surface: __all__ matches what is exported, and re-exports read toolpool.X."""

from __future__ import annotations

import types

import pytest

import toolpool


def test_all_is_a_sorted_tuple_of_real_names() -> None:
    assert isinstance(toolpool.__all__, tuple)
    assert len(set(toolpool.__all__)) == len(toolpool.__all__)
    for name in toolpool.__all__:
        assert hasattr(toolpool, name), name


def test_all_lists_every_public_attribute() -> None:
    public = {
        name
        for name, value in vars(toolpool).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    }
    assert public <= set(toolpool.__all__) | {"__version__"}


@pytest.mark.parametrize("name", ["Registry", "ToolResult", "Outcome", "CancelController"])
def test_reexports_have_public_module(name: str) -> None:
    assert getattr(toolpool, name).__module__ == "toolpool"
