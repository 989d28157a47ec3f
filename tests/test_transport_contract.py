"""Every backend passes the one Transport contract (``transport_contract.py``): records, expiry, signatures,
streams, limits, timeouts, errors, restart with the same id.

The memory backend runs here. hivemind and libp2p each run all their checks in a process of their own
(they cannot share one: both register the protobuf package ``crypto.pb``), once per module; every check is
still its own test, which reports that check's traceback.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transport_contract import CHECKS, run

CONTRACT = Path(__file__).with_name("transport_contract.py")


@pytest.fixture(scope="module")
def results():
    """Each backend's results, run on first use: check name -> 'ok', 'skip: why' or a traceback."""
    done = {}

    def of(backend: str) -> dict[str, str]:
        if backend not in done:
            proc = subprocess.run(
                [sys.executable, str(CONTRACT), backend], capture_output=True, text=True, timeout=400
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
        return done[backend]

    return of


BACKENDS = [
    "memory",
    pytest.param("hivemind", marks=[pytest.mark.slow, pytest.mark.timeout(420)]),
    pytest.param("libp2p", marks=[pytest.mark.slow, pytest.mark.timeout(420)]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check", CHECKS)
def test_contract(results, backend, check):
    result = run(backend, check) if backend == "memory" else results(backend)[check]
    if result.startswith("skip: "):
        pytest.skip(result[len("skip: ") :])
    assert result == "ok", result
