"""Malicious peers for simulations (``spes simulate --byzantine I:MODE``).

A byzantine peer runs the honest client over a ``ByzantineTransport``, which rewrites what the client sends:
its update announcements, the payloads it serves, and extra messages of its own. Nothing here is imported
by the client; the attacks only ever reach the honest peers through the network, as a stranger's would.

    garbage   served updates are random bytes, and it sends malformed requests to every other peer
    nan       its updates are NaN (block scales too, in a quantized codec)
    scale     its updates are multiplied by 1000
    signflip  its updates are negated
    subtle    its updates are half the honest ones, negated: inside every norm bound
    zero      its updates are zeros, for the tokens it claims to have trained on (a free-rider)
    noise     its updates are random, of about the honest norm (random codes at its scales, when quantized)
              (these seven also apply to each piece of a reduce-scatter, and to the combined parts it owns)
    copy      it serves, as its own, a copy of another participant's update of the unit (or of its pieces)
    frozenscale the versions and changes it serves for others' frozen copies are multiplied by 1000
    ownerflip the combined parts of the dense update it owns are served as -8 times the honest part, naming
              only itself as combined (so that no member holds the part against its own piece)
    tokens    it claims 10^15 tokens for every update
    late      it injects updates, as a late participant, into units and rounds it did not train
    resync    it announces a foreign start-weight hash and serves end weights pulled far away
    claimall  it claims every unit, and SYBILS fake peers claim the last expert shard and never serve it
    overclaim it declares capacity for every expert shard and claims them all (within that capacity), and
              serves only the ones it trains
    forge     (hivemind) it signs "left" tombstones of every other peer under their ids
    silent    it announces its updates and never serves them (nor anything else)
    slow      it answers every request only after SLOW_SECONDS
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading

import msgspec
import torch
from safetensors.torch import load, save

from spes_p2p.model.units import layout_of
from spes_p2p.net.transport import Entry, Handler, Transport, TransportError
from spes_p2p.net.wire import RecordError
from spes_p2p.settings import Settings
from spes_p2p.sim.config import BYZANTINE_MODES as MODES
from spes_p2p.swarm.gossip import Told
from spes_p2p.swarm.records import Announcement, Holding, PeerRecord, peers_key
from spes_p2p.sync.messages import RPC_UPDATE, RPC_WEIGHTS, UpdateRequest, WeightsRequest
from spes_p2p.sync.payload import buffers_digest, metadata_of

logger = logging.getLogger(__name__)

SLOW_SECONDS = 8.0
SYBILS = 8
SILENT_SECONDS = 120.0  # how long a silent peer holds a request before dropping it
# how long a copier waits for an update to copy before it sends its own: at most this, and no longer than
# twice the longest the honest peers wait for any update (a copy announced after that is never fetched)
COPY_WAIT_SECONDS = 10.0
_REWRITES = {
    "nan": lambda t: t * float("nan"),
    "scale": lambda t: t * 1000,
    "signflip": lambda t: -t,
    "subtle": lambda t: t * -0.5,
    "zero": lambda t: t * 0,
    "noise": lambda t: torch.randn_like(t) * (t.norm() / max(t.numel(), 1) ** 0.5),
}


# What noise does to the codes of a quantized payload (the int8 and nf4 codecs' uint8 buffers), so that
# the update decodes to noise, not to the honest codes at random block scales
_CODES = {"noise": lambda t: torch.randint_like(t, 0, 256)}


def rewrite(payload: bytes, change, codes=None, **meta: str) -> bytes:
    """The payload with ``change`` applied to every floating-point buffer (and ``codes`` to every buffer of
    quantized codes), ``meta`` in its metadata, and its checksum made to match: a well-formed payload
    carrying bad values."""
    buffers = load(payload)
    changed = {k: _changed(v, change, codes) for k, v in buffers.items()}
    return save(changed, metadata={**metadata_of(payload), **meta, "sha256": buffers_digest(changed)})


def _changed(buffer: torch.Tensor, change, codes) -> torch.Tensor:
    if buffer.is_floating_point():
        return change(buffer)
    return codes(buffer) if codes is not None and buffer.dtype == torch.uint8 else buffer


class ByzantineTransport(Transport):
    """The transport of a malicious peer of a swarm of ``settings``: the inner one, with ``mode``'s attack on
    top."""

    def __init__(self, inner: Transport, mode: str, settings: Settings) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown byzantine mode {mode!r}; choose one of {', '.join(MODES)}")
        self.inner, self.mode = inner, mode
        self.units = layout_of(settings.model).units  # (what ``late`` injects into)
        self.copy_wait = min(COPY_WAIT_SECONDS, 2 * settings.sync.deadline_max)
        self.peer_id, self.stats, self.guard = inner.peer_id, inner.stats, inner.guard
        self.handlers: dict[str, Handler] = {}
        self.forged: dict[tuple[int, str, int], bytes] = {}  # (round, unit, part) -> the payload it serves
        self.announced: dict[tuple[int, str], Announcement] = {}  # (round, unit) -> what it announces
        self.stopped = threading.Event()
        self.sybils: list[Transport] = []
        self.run_id = ""  # (learnt from the first update it announces)

    # ---------------------------------------------------------------------------------- pass-through

    def addresses(self) -> list[str]:
        return self.inner.addresses()

    def now(self) -> float:
        return self.inner.now()

    def read(self, key: str, *, banned: bool = False) -> dict[str, Entry]:
        return self.inner.read(key, banned=banned)

    def request(self, peer_id: str, name: str, payload: bytes, **kwargs) -> bytes:
        return self.inner.request(peer_id, name, payload, **kwargs)

    def probe(self, address: str, timeout: float) -> bool:
        return self.inner.probe(address, timeout)

    def subscribe(self, topic: str, on_message) -> bool:
        return self.inner.subscribe(topic, on_message)

    def unsubscribe(self, topic: str) -> None:
        self.inner.unsubscribe(topic)

    def gossip(self, topic: str, data: bytes) -> bool:  # (an announcement: the one it published)
        told = Told.decode(data)
        forged = self.announced.get((told.announcement.round, told.unit), told.announcement)
        return self.inner.gossip(topic, Told(told.unit, forged).encode())

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stopped.set()
        for sybil in self.sybils:
            sybil.shutdown(timeout)
        self.inner.shutdown(timeout)

    # -------------------------------------------------------------------------------------- attacks

    def serve(self, name: str, handler: Handler, *, max_request_bytes: int) -> None:
        self.handlers[name] = handler

        def attacked(caller: str, request: bytes) -> bytes:
            if self.mode == "silent":
                self.stopped.wait(SILENT_SECONDS)
                raise TransportError("never answered")
            if self.mode == "slow":
                self.stopped.wait(SLOW_SECONDS)
            if name == RPC_UPDATE:
                req = UpdateRequest.decode(request)
                if req.kind in ("delta", "piece") and (req.round, req.unit, req.part) in self.forged:
                    return self.forged[(req.round, req.unit, req.part)]
                if req.kind == "end" and self.mode == "resync":
                    return rewrite(handler(caller, request), lambda t: t * -10)
                if req.kind in ("reduced", "merged") and self.mode in ("garbage", *_REWRITES):
                    return self._forge(handler(caller, request))
                if req.kind in ("reduced", "merged") and self.mode == "ownerflip":
                    return rewrite(handler(caller, request), lambda t: t * -8, peers=self.peer_id)
            if name == RPC_WEIGHTS and self.mode == "frozenscale":
                if WeightsRequest.decode(request).kind in ("version", "change"):
                    return rewrite(handler(caller, request), lambda t: t * 1000)
            return handler(caller, request)

        self.inner.serve(name, attacked, max_request_bytes=max_request_bytes)

    def publish(self, key: str, value: bytes, expires_at: float) -> bool:
        parts = key.split("/")
        if self.mode == "claimall" and parts[-1] == "peers":
            value = self._claim_all(parts[0], PeerRecord.decode(value), expires_at)
        if self.mode == "overclaim" and parts[-1] == "peers":
            value = self._overclaim(PeerRecord.decode(value))
        if self.mode == "forge" and parts[-1] == "peers":
            self._forge_tombstones(parts[0], PeerRecord.decode(value))
        if len(parts) == 5 and parts[1] == "updates":  # <run>/updates/<round>/<unit>: our update is ready
            self.run_id = parts[0]
            value = self._announced(int(parts[2]), f"{parts[3]}/{parts[4]}", Announcement.decode(value))
            if self.mode == "late":
                self._inject_late(parts[0], int(parts[2]) - 1, expires_at)
            if self.mode == "garbage":
                self._send_garbage_requests(parts[0])
        return self.inner.publish(key, value, expires_at)

    def _announced(self, round_: int, unit: str, a: Announcement) -> bytes:
        """The announcement it publishes and gossips for its update ``a`` (forged once: the same both ways,
        and when it announces again)."""
        if (round_, unit) not in self.announced:
            self.announced[(round_, unit)] = Announcement.decode(self._announce(round_, unit, a))
        return self.announced[(round_, unit)].encode()

    def _announce(self, round_: int, unit: str, a: Announcement) -> bytes:
        fields = {f: getattr(a, f) for f in a.__struct_fields__}
        if self.mode == "tokens":
            fields["tokens"] = 10**15
        elif self.mode == "resync":
            fields["base"] = hashlib.sha256(f"foreign {round_}".encode()).hexdigest()[:16]
        elif self.mode == "copy":
            self._copy(round_, unit, fields)
        elif self.mode in ("garbage", *_REWRITES):
            serve = self.handlers[RPC_UPDATE]
            if not a.pieces:
                forged = self._forge(serve(self.peer_id, UpdateRequest(round=round_, unit=unit).encode()))
                self.forged[(round_, unit, 0)] = forged
                fields.update(bytes=len(forged), sha256=hashlib.sha256(forged).hexdigest())
            else:
                for part in range(len(a.pieces)):
                    ask = UpdateRequest(round=round_, unit=unit, kind="piece", part=part, parts=len(a.pieces))
                    self.forged[(round_, unit, part)] = self._forge(serve(self.peer_id, ask.encode()))
                pieces = [
                    hashlib.sha256(self.forged[(round_, unit, p)]).hexdigest() for p in range(len(a.pieces))
                ]
                fields.update(pieces=pieces, sha256=hashlib.sha256("".join(pieces).encode()).hexdigest())
        return Announcement(**fields).encode()

    def _copy(self, round_: int, unit: str, fields: dict) -> None:
        """Waits (bounded) for another participant's update of the unit, and serves a copy of it (or of its
        pieces) as its own: ``fields`` are made to announce the copy."""
        key = f"{self.run_id}/updates/{round_}/{unit}"
        parts = len(fields["pieces"])
        for _ in range(int(self.copy_wait / 0.2)):
            for holder, entry in sorted(self.inner.read(key).items()):
                theirs = Announcement.decode(entry.value) if holder != self.peer_id else None
                if theirs is None or len(theirs.pieces) != parts or theirs.base != fields["base"]:
                    continue
                try:
                    copied = [
                        self.inner.request(holder, RPC_UPDATE, ask.encode(), timeout=5)
                        for ask in _requests(round_, unit, parts)
                    ]
                except TransportError as exc:
                    logger.debug("nothing to copy from %s: %s", holder, exc)
                    continue
                for part, payload in enumerate(copied):
                    self.forged[(round_, unit, part)] = payload
                fields.update(tokens=theirs.tokens, bytes=theirs.bytes, sha256=theirs.sha256)
                fields["pieces"] = theirs.pieces
                return
            if self.stopped.wait(0.2):
                return

    def _forge(self, honest: bytes) -> bytes:
        if self.mode == "garbage":
            return os.urandom(len(honest))
        return rewrite(honest, _REWRITES[self.mode], _CODES.get(self.mode))

    def _inject_late(self, run_id: str, round_: int, expires_at: float) -> None:
        """Into every unit it did not announce for in ``round_ + 1``: a copy of a holder's update of
        ``round_``, negated and with 10^6 tokens, announced on that holder's start weights as a late one."""
        if round_ < 0:
            return
        for unit in self.units:
            key = f"{run_id}/updates/{round_}/{unit}"
            entries = self.inner.read(key)
            if self.peer_id in entries or (round_, unit, 0) in self.forged:
                continue
            for holder, entry in sorted(entries.items()):
                try:
                    a = Announcement.decode(entry.value)
                    request = UpdateRequest(round=round_, unit=unit).encode()
                    payload = rewrite(
                        self.inner.request(holder, RPC_UPDATE, request, timeout=5), lambda t: -t
                    )
                except (RecordError, TransportError) as exc:
                    logger.debug("late injection into %s: %s", unit, exc)
                    continue
                self.forged[(round_, unit, 0)] = payload
                digest = hashlib.sha256(payload).hexdigest()
                fake = Announcement(
                    round=round_, tokens=10**6, bytes=len(payload), codec=a.codec, sha256=digest, base=a.base
                )
                self.inner.publish(key, fake.encode(), expires_at)
                break

    def _claim_all(self, run_id: str, record: PeerRecord, expires_at: float) -> bytes:
        """Claims every unit in its own record (returned), and has its sybils (fake peers on the same
        network, that serve nothing) claim the last expert shard, so that it looks covered many times over."""
        if record.state != "active":
            return record.encode()
        if not self.sybils:
            self.sybils = [self.inner.network.join(f"{self.peer_id}-sybil{i}") for i in range(SYBILS)]
        target = [u for u in self.units if u.startswith("experts/")][-1]
        for sybil in self.sybils:
            fake = msgspec.structs.replace(
                record, peer_id=sybil.peer_id, addresses=[], holds={target: Holding()}
            )
            sybil.publish(peers_key(run_id), fake.encode(), expires_at)
        return msgspec.structs.replace(record, holds={u: Holding() for u in self.units}).encode()

    def _overclaim(self, record: PeerRecord) -> bytes:
        if record.state != "active":
            return record.encode()
        shards = [u for u in self.units if u.startswith("experts/")]
        holds = {**{u: Holding() for u in shards}, **record.holds}
        return msgspec.structs.replace(record, capacity=len(shards), holds=holds).encode()

    def _forge_tombstones(self, run_id: str, record: PeerRecord) -> None:
        """For every other peer: a "left" peer record under the victim's id, made with this peer's key.
        hivemind: signed by this peer but stored under the victim's subkey, expiring in an hour (the DHT
        keeps the entry that expires last); libp2p: the victim's public key, this peer's signature, sent
        to every peer as to a keeper of the key."""
        victims = set(self.inner.read(peers_key(run_id))) - {self.peer_id}
        logger.info("forging tombstones of %s", sorted(victims))
        for victim in victims:
            left = msgspec.structs.replace(record, peer_id=victim, addresses=[], holds={}, state="left")
            if self.inner.backend == "hivemind":
                subkey = victim.encode() + self.inner._validator.local_public_key
                far = self.inner.now() + 3600
                self.inner.dht.store(peers_key(run_id), left.encode(), far, subkey=subkey, return_future=True)
            else:
                self._forge_entry(peers_key(run_id), left.encode(), victim, victims)

    def _forge_entry(self, key: str, value: bytes, victim: str, keepers: set[str]) -> None:
        from libp2p.peer.id import ID

        from spes_p2p.net.libp2p.kad_records import STORE, SignedEntry

        expires = self.inner.now() + 300  # (within every reader's horizon: the signature must refuse it)
        signed = SignedEntry.sign(key, value, expires, self.inner._key_pair.private_key)
        victim_key = ID.from_base58(victim).extract_public_key().serialize()
        stolen = SignedEntry(key, value, expires, victim_key, signed.signature)
        for keeper in keepers:
            try:
                self.inner.request(keeper, STORE, stolen.encode(), timeout=5)
            except TransportError as exc:  # (refused, as it should be)
                logger.info("%s refused a forged entry: %s", keeper, exc)

    def _send_garbage_requests(self, run_id: str) -> None:
        for peer in set(self.inner.read(peers_key(run_id))) - {self.peer_id}:
            for name in (RPC_UPDATE, RPC_WEIGHTS):
                try:
                    self.inner.request(peer, name, os.urandom(64), timeout=2)
                except TransportError:
                    pass


def _requests(round_: int, unit: str, parts: int) -> list[UpdateRequest]:
    """The requests of a whole update, or of each of its ``parts`` pieces."""
    if not parts:
        return [UpdateRequest(round=round_, unit=unit)]
    return [UpdateRequest(round=round_, unit=unit, kind="piece", part=p, parts=parts) for p in range(parts)]


def main(argv: list[str]) -> int:
    """``python -m spes_p2p.sim.byzantine SETTINGS.toml MODE``: the peer process of a malicious peer in a
    simulation of peer processes (``python -m spes_p2p.peer``, over an attacking transport)."""
    from spes_p2p.peer.__main__ import main as peer_main
    from spes_p2p.peer.setup import open_transport

    def attacking(settings) -> ByzantineTransport:
        transport = open_transport(settings, new_swarm=settings.run.new_swarm)
        return ByzantineTransport(transport, argv[2], settings)

    return peer_main(argv[:2], attacking)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
