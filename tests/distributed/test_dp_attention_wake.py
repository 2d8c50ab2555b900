"""DP attention's idle wait: an idle replica waits on its link, not on the group, and a Wake
(another replica was sent a request) keeps it agreeing until the group has agreed on that
work, so the request's first step waits for no replica's idle wait."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from atom_core.engine import core_process
from atom_core.engine.core_messages import Wake, to_engine_decoder
from atom_core.engine.core_process import WAKE_S, EngineCore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(core_process.time, "monotonic", c)
    return c


class Lockstep:
    """The group's agreements, scripted: ``step`` agrees ``next_busy``."""

    def __init__(self) -> None:
        self.any_busy = False
        self.next_busy = False

    def step(self, stop: bool) -> bool:
        self.any_busy = self.next_busy
        return stop


def idle_replica() -> tuple[EngineCore, Lockstep]:
    lockstep = Lockstep()
    engine = SimpleNamespace(is_finished=lambda: True, lockstep=lockstep)
    return EngineCore(engine, push=None), lockstep


def test_a_wake_keeps_an_idle_replica_agreeing_until_the_group_has_work(clock):
    core, lockstep = idle_replica()
    assert core.is_idle()
    core.handle(to_engine_decoder.decode(core_process.encoder.encode(Wake())))
    assert not core.is_idle()
    # Read before the request's own replica read the request: the next agreement may still
    # say idle, and the woken replica must not go back to its long wait on that.
    core.step()
    clock.now += WAKE_S / 2
    assert not core.is_idle()
    lockstep.next_busy = True
    core.step()  # the group agreed on the work
    assert not core.is_idle()
    lockstep.next_busy = False
    core.step()  # and finished it: idle at once, not when the Wake would have lapsed
    assert core.is_idle()


def test_a_wake_whose_request_never_came_lapses(clock):
    core, _ = idle_replica()
    core.handle(Wake())
    clock.now += WAKE_S
    assert core.is_idle()


def test_without_dp_attention_only_the_engine_decides():
    engine = SimpleNamespace(is_finished=lambda: True, lockstep=None)
    core = EngineCore(engine, push=None)
    assert core.is_idle()
    core.dirty = True  # an abort to report
    assert not core.is_idle()
