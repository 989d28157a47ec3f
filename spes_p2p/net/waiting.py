"""Bounded waiting: every wait for another peer ends at a deadline, or at once when the peer stops.

``Deadline`` is a point in time plus the peer's abort event; ``poll`` asks a question until it has an
answer or the deadline passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MIN_REQUEST_SECONDS = 0.5  # a request sent just before a deadline still gets this long


class Deadline:
    def __init__(self, seconds: float, abort: threading.Event | None = None) -> None:
        self.at = time.monotonic() + seconds
        self.abort = abort or threading.Event()

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return self.abort.is_set() or time.monotonic() >= self.at

    def sleep(self, seconds: float) -> None:
        """Sleeps ``seconds``, less when the deadline comes first or the peer stops."""
        self.abort.wait(min(seconds, self.remaining()))


def poll(ask: Callable[[], T | None], deadline: Deadline, every: float) -> T | None:
    """``ask()`` every ``every`` seconds until it returns something other than None; None at the deadline.
    ``ask`` is tried at least once, and once more when the deadline has passed."""
    while True:
        last_try = deadline.passed()
        answer = ask()
        if answer is not None or last_try:
            return answer
        deadline.sleep(every)
