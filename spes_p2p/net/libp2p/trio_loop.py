"""A trio event loop in its own thread, behind a synchronous facade (py-libp2p runs only on trio).

``TrioLoop(main)`` starts a daemon thread that runs ``main(ready, stopping)``: an async function that sets
up its services, calls ``ready()``, serves until the ``stopping`` event is set, and then closes them.
``call`` runs a coroutine function on that loop from any other thread, with a deadline; ``spawn`` starts
one in the background; ``stop`` sets ``stopping``, cancels what is left after half its time, and joins
the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio


class LoopClosed(RuntimeError):
    """The loop has stopped (or failed to start): nothing more runs on it."""


class TrioLoop:
    def __init__(self, main: Callable[[Callable[[], None], trio.Event], Awaitable[None]], name: str) -> None:
        self._main = main
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stopping: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, timeout: float) -> None:
        """Starts the loop and waits until ``main`` is ready; re-raises what ``main`` raised before that.
        TimeoutError when it is not ready within ``timeout`` (the loop is then stopped)."""
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop(timeout=2.0)
            raise TimeoutError(f"not ready within {timeout:.0f}s")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported to start(); after that, the loop is simply gone
            self._error = exc
        finally:
            self._token = None
            self._ready.set()

    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._stopping = trio.Event()
            self._token = trio.lowlevel.current_trio_token()
            await self._main(self._ready.set, self._stopping)
            nursery.cancel_scope.cancel()  # (whatever was spawned)

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any, timeout: float) -> Any:
        """``await fn(*args)`` on the loop; TimeoutError past ``timeout`` seconds (the call is cancelled)."""

        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await fn(*args)

        token = self._token
        if token is None:
            raise LoopClosed("the network loop has stopped")
        try:
            return trio.from_thread.run(bounded, trio_token=token)
        except trio.TooSlowError:
            raise TimeoutError(f"no answer within {timeout:.1f}s") from None
        except trio.RunFinishedError:
            raise LoopClosed("the network loop has stopped") from None

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Starts ``fn(*args)`` in the background on the loop, from any thread (the loop's too)."""
        token, nursery = self._token, self._nursery
        if token is None or nursery is None:
            return
        if threading.current_thread() is self._thread:
            nursery.start_soon(fn, *args)
            return
        try:
            trio.from_thread.run_sync(nursery.start_soon, fn, *args, trio_token=token)
        except trio.RunFinishedError:
            pass

    def stop(self, timeout: float) -> None:
        """Asks ``main`` to close its services; cancels everything still running after ``timeout / 2``
        seconds, and waits up to ``timeout`` seconds in all for the thread to end."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return
        steps = (lambda: self._stopping.set(), lambda: self._nursery.cancel_scope.cancel())
        for step in steps:
            token = self._token  # (None until the loop runs, and once it has ended)
            if token is None:
                break
            try:
                trio.from_thread.run_sync(step, trio_token=token)
            except trio.RunFinishedError:
                break
            self._thread.join(timeout / 2)
            if not self._thread.is_alive():
                break
