"""The service's lifecycle: one owner of "are we serving?", read by gRPC health, the HTTP API and the async engine.

Contract:
- States: LOADING (port bound, model not ready) → SERVING → DRAINING (SIGTERM: in-flight requests may finish,
  new ones are refused) → STOPPED. BROKEN (the engine failed too many steps in a row) is entered from LOADING or
  SERVING and left only for DRAINING. Any other transition raises `ValueError`; moving to the current state is a
  no-op.
- `to(state)` runs in the event loop and calls every listener (`on_change`) at once with the new state, so gRPC
  health flips in the same loop iteration, not at the next poll. `to_threadsafe(state)` is how another thread (the
  engine's) reports a transition: it is applied in the loop.
- `accepting` is True only while SERVING: the one test every entry point (gRPC, HTTP, the async engine) applies to
  new work. `refusal()` is the message of the error a refused request gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable


class State(enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"
    BROKEN = "broken"


_ALLOWED = {
    State.LOADING: {State.SERVING, State.DRAINING, State.BROKEN},
    State.SERVING: {State.DRAINING, State.BROKEN},
    State.BROKEN: {State.DRAINING},
    State.DRAINING: {State.STOPPED},
    State.STOPPED: set(),
}


class Lifecycle:
    def __init__(self, state: State = State.LOADING) -> None:
        self._state = state
        self._listeners: list[Callable[[State], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def state(self) -> State:
        return self._state

    @property
    def accepting(self) -> bool:
        return self._state is State.SERVING

    @property
    def draining(self) -> bool:
        return self._state in (State.DRAINING, State.STOPPED)

    def refusal(self) -> str:
        return {
            State.LOADING: "the model is still loading",
            State.DRAINING: "the server is shutting down",
            State.STOPPED: "the server is shutting down",
            State.BROKEN: "the engine is broken (it failed several steps in a row); the server must be restarted",
        }.get(self._state, "")

    def on_change(self, listener: Callable[[State], None]) -> None:
        self._listeners.append(listener)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop `to_threadsafe` hands transitions to."""
        self._loop = loop

    def to(self, state: State) -> None:
        if state is self._state:
            return
        if state not in _ALLOWED[self._state]:
            raise ValueError(f"lifecycle: {self._state.value} cannot become {state.value}")
        self._state = state
        for listener in self._listeners:
            listener(state)

    def to_threadsafe(self, state: State) -> None:
        if self._loop is None:
            self.to(state)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._to_if_allowed, state)

    def _to_if_allowed(self, state: State) -> None:
        if state is self._state or state in _ALLOWED[self._state]:
            self.to(state)
