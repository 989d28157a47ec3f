"""The libp2p backend: py-libp2p in pure Python, on a trio loop in a thread of the peer's process.

Never imported in a process that uses the hivemind backend (both register the protobuf package ``crypto.pb``).
"""
