"""The spes command line: click commands and rich rendering only; the work happens in ``spes_p2p``.

Imports of torch and the rest of the stack happen inside commands, so ``--help`` answers at once.
"""
