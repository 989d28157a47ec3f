"""A stand-in peer module for tests/test_launcher.py: ``main`` prints what the launcher forked it with, then
exits with the status it is given (or sleeps until killed)."""

import os
import random
import sys
import time


def main(argv: list[str]) -> int:
    print("preloaded", all(m in sys.modules for m in ("torch", "spes_p2p.peer.life")))
    print("own_session", os.getsid(0) == os.getpid())
    print("random", random.random())
    if argv[1] == "sleep":
        time.sleep(120)
    return int(argv[1])
