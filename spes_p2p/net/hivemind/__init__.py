"""The hivemind backend: hivemind's DHT in a child process and request streams through p2pd (go-libp2p).

Never imported in a process that uses the libp2p backend (both register the protobuf package ``crypto.pb``).
"""
