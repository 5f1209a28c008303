"""White box: every provider enters the machine the same way (``Machine.add_provider``,
started by ``Machine.start``), the default one of ``Pool(tools, ...)`` too, and decides with
its own options."""

from __future__ import annotations

import pytest

from core_support import FakeProbe
from toolpool.core import Outcome
from toolpool.protocol import PROTOCOL_VERSION, Hello, ResultMessage, pack_value
from toolpool.supervisor.machine import (
    CallRecord,
    Clean,
    CoreConfig,
    Machine,
    ProviderSpec,
    ProviderState,
    Send,
    Spawn,
)


def _serving(core: Machine, name: str, *, allow_background: bool) -> int:
    """Add provider ``name`` (one worker, the tool ``bg``) and let its worker say hello."""
    spec = ProviderSpec(tools_spec="m:r", size=1, allow_background=allow_background)
    p = core.add_provider(name, spec, 1.0)
    (spawn,) = [a for a in core.flush(1.0) if isinstance(a, Spawn) and a.provider == name]
    pid = 500 + spawn.wid
    core.spawned(spawn.wid, pid, "fork", 1.0)
    tools = [{"name": f"bg_{name}", "runs_in_thread": True}]
    hello = Hello(PROTOCOL_VERSION, pid, spawn.secret, tools, {})
    core.message(spawn.wid, hello, 1.0, peer_pid=pid)
    core.flush(1.0)
    assert p.state is ProviderState.ACTIVE
    return spawn.wid


@pytest.mark.timeout(10)
@pytest.mark.parametrize("allow_background", [True, False])
def test_a_providers_leftovers_follow_its_own_allow_background(allow_background: bool) -> None:
    """A call that leaves a process behind: killed before it settles, unless its provider
    allows background processes (the pool's other options say nothing of it)."""
    core = Machine(CoreConfig(), FakeProbe(), lambda: b"s" * 32)
    core.start(0.0)
    assert not core.flush(0.0)  # no provider yet: nothing starts
    wid = _serving(core, "p", allow_background=allow_background)
    call = CallRecord(1, "bg_p", pack_value({}), None, 1.0)
    core.submit(call, timeout=None, now=1.0)
    assert any(isinstance(a, Send) and a.wid == wid for a in core.flush(1.0))
    result = ResultMessage(1, "ok", None, None, None, True, {}, 1, {"kept": True})
    core.message(wid, result, 1.1)
    actions = core.flush(1.1)
    cleaned = any(isinstance(a, Clean) for a in actions)
    assert cleaned is not allow_background
    assert (call._result is not None) is allow_background
    if not allow_background:
        core.cleaned(wid, 1, 1.2)
        core.flush(1.2)
        assert call._result is not None
    assert call._result.outcome is Outcome.OK
    assert call._result.leftovers_killed == (0 if allow_background else 1)


@pytest.mark.timeout(10)
def test_a_provider_added_before_the_start_starts_with_it() -> None:
    """``Pool(tools, ...)``: the provider "default" is added before the pool starts, and its
    workers start with the pool, not before."""
    core = Machine(CoreConfig(), FakeProbe(), lambda: b"s" * 32)
    core.add_provider("default", ProviderSpec(tools_spec="m:r", size=2, warm_spares=1), 0.0)
    assert not core.flush(0.0)
    assert core.default is core.pending["default"]
    core.start(5.0)
    spawns = [a for a in core.flush(5.0) if isinstance(a, Spawn)]
    assert [a.provider for a in spawns] == ["default"] * 3
    assert core.next_deadline() == 5.0 + core.config.start_timeout  # (hello deadlines)
