"""The round pipeline on its own: a sync that hangs past every deadline is an error, not a hang."""

import threading

import pytest

from spes_p2p.errors import SpesError
from spes_p2p.peer.job import RoundJob
from spes_p2p.peer.rounds import Pipeline


class StuckSync:
    """A sync whose waits never end (as if a wait lacked its deadline)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, job: RoundJob) -> None:
        self.release.wait(60)

    def bound(self, job: RoundJob) -> float:
        return 0.2


@pytest.mark.timeout(30)
def test_a_sync_stuck_past_its_bound_is_reported_not_waited_for_forever():
    work = StuckSync()
    pipeline = Pipeline(work, overlap=True)
    pipeline.submit(RoundJob(3, ["experts/0"], {}, {}, 0, {}))
    try:
        with pytest.raises(SpesError, match="sync of round 3 did not end within its bound"):
            pipeline.take()
    finally:
        work.release.set()
