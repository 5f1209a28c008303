"""Graces: the one options model of the escalation ladder's waits (each default written
once, in ``toolpool.Graces``), and everyone who takes theirs from it."""

from __future__ import annotations

import dataclasses

import pytest

import toolpool
from toolpool import Graces
from toolpool.core import DEFAULT_GRACES


@pytest.mark.timeout(10)
def test_the_defaults_and_what_they_refuse() -> None:
    graces = Graces()
    assert (graces.cancel, graces.term, graces.drain, graces.unkillable_after) == (
        5.0,
        2.0,
        30.0,
        10.0,
    )
    assert graces == DEFAULT_GRACES
    with pytest.raises(dataclasses.FrozenInstanceError):
        graces.cancel = 1.0  # type: ignore[misc]
    assert Graces(cancel=1).cancel == 1.0
    assert isinstance(Graces(cancel=1).cancel, float)
    for bad in (
        {"cancel": -1.0},
        {"term": float("nan")},
        {"drain": True},
        {"cancel": "5"},
        {"unkillable_after": 0.0},
    ):
        with pytest.raises(ValueError, match=f"Graces.{next(iter(bad))} must be"):
            Graces(**bad)  # type: ignore[arg-type]
    assert Graces(cancel=0.5, term=1).ladder() == (
        "one that does not stop within 0.5s gets SIGTERM, then SIGKILL 1s later"
    )


@pytest.mark.timeout(10)
def test_the_pool_the_cli_and_batch_take_theirs_from_it() -> None:
    from toolpool._batch._runner import BatchOptions
    from toolpool._cli import _parser

    pool = toolpool.Pool("toolpool.testing.examples:registry", workers=1)
    assert pool.graces == DEFAULT_GRACES
    assert (pool.cancel_grace, pool.term_grace) == (DEFAULT_GRACES.cancel, DEFAULT_GRACES.term)
    pool = toolpool.Pool(
        "toolpool.testing.examples:registry", cancel_grace=1, term_grace=0.5, drain_grace=3
    )
    assert pool.graces == Graces(cancel=1.0, term=0.5, drain=3.0)
    assert pool._core.config.graces is pool.graces
    with pytest.raises(ValueError, match="cancel_grace must be"):
        toolpool.Pool("toolpool.testing.examples:registry", cancel_grace=-1)
    for command in (["call", "m:r", "t"], ["batch", "m:r", "in.jsonl", "-o", "out.jsonl"]):
        ns = _parser().parse_args(command)
        assert (ns.cancel_grace, ns.term_grace) == (DEFAULT_GRACES.cancel, DEFAULT_GRACES.term)
    options = BatchOptions(tools="m:r", input="in.jsonl", output="out.jsonl")
    assert (options.cancel_grace, options.term_grace) == (
        DEFAULT_GRACES.cancel,
        DEFAULT_GRACES.term,
    )
