"""Shared by the fault and soak tests: counting K/V states, and a device fault injected into
the engine's step."""

from __future__ import annotations

import torch


class StateCount:
    """Counts the backend's K/V states as they are made and released (wraps the real calls)."""

    def __init__(self, backend, monkeypatch) -> None:
        self.live: set[int] = set()
        self.made = 0
        real_new, real_release = backend.new_state, backend.release

        def new_state(**kw):
            state = real_new(**kw)
            self.live.add(id(state))
            self.made += 1
            return state

        def release(state):
            self.live.discard(id(state))
            return real_release(state)

        monkeypatch.setattr(backend, "new_state", new_state)
        monkeypatch.setattr(backend, "release", release)


def fail_step_at(engine, monkeypatch, call: int) -> None:
    """The engine's `call`-th step raises a sticky device error, as an illegal memory access does:
    it poisons every session on the device."""
    real_step = engine.step
    calls = 0

    def dying_step(session):
        nonlocal calls
        calls += 1
        if calls == call:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return real_step(session)

    monkeypatch.setattr(engine, "step", dying_step)
