"""The swarm's dataset on a peer: the one its manifest pins, from wherever it can be had, and the files of it
this peer serves to the others.

A founder writes its dataset into the manifest (``pin``): the digest of its index, its training
shards' count, and the places it can be fetched from (``data.dataset`` when it names one, and
``data.mirrors``). A peer that joins (``swarm_data``):

- given a dataset or a corpus of its own (``--dataset``, ``--corpus``), trains on it if its digest is the
  swarm's, and is refused, naming both, if not;
- else takes the swarm's: a whole copy in its cache with that digest (a corpus it prepared before), or the
  index from the manifest's places or from the peers (checked against the digest), and each shard when it
  trains it, from the same places and then from the peers (checked against the index).

Every peer serves the files of its dataset it has (``spes/data``: the index, the tokenizer, and the shards
in its folder or cache), so a swarm needs no web server.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from spes_p2p.data.shards import DatasetIndex
from spes_p2p.data.sources import ShardStore, SourceUnavailable, cached_copy, fetch_dataset, source_of
from spes_p2p.errors import SwarmMismatch
from spes_p2p.net.transport import RemoteError, Transport, TransportError, Unavailable
from spes_p2p.net.wire import BadRequest
from spes_p2p.settings import Settings
from spes_p2p.swarm.datawork import DataClaims
from spes_p2p.swarm.manifest import DatasetPin, Manifest
from spes_p2p.swarm.records import read_peers
from spes_p2p.train.dataset import PreparedData, open_prepared, prepare_data

logger = logging.getLogger(__name__)

RPC_DATA = "spes/data"
REQUEST_SECONDS = 30.0  # one file from one peer
MAX_NAME_BYTES = 64  # a request is a file's name: "train/0000000.safetensors"


def pin(settings: Settings, data: PreparedData) -> DatasetPin:
    """What a new swarm's manifest says of its dataset."""
    places = [settings.data.dataset] if settings.data.dataset else []
    return DatasetPin(
        dataset=data.dataset_hash,
        train_shards=len(data.index.train),
        sources=[*places, *settings.data.mirrors],
        corpus=data.index.source,
    )


def dataset_of(settings: Settings, transport: Transport, manifest: Manifest | None) -> PreparedData:
    """A founder's dataset (``manifest`` None: the one its settings name), or the swarm's."""
    if manifest is None:
        return prepare_data(settings.data, settings.model.architecture().vocab_size)
    return swarm_data(settings, transport, manifest)


def data_claims(
    settings: Settings, transport: Transport, data: PreparedData, live_peers: Callable[[], set[str]]
) -> DataClaims:
    """This peer's share of the swarm's dataset (the sampler's plan)."""
    index, lease = data.index, settings.swarm.record_ttl_seconds
    return DataClaims(
        transport, settings.swarm.run_id, data.dataset_hash, len(index.train), live_peers, lease
    )


def swarm_data(settings: Settings, transport: Transport, manifest: Manifest) -> PreparedData:
    """The dataset the swarm's manifest pins (see the module's docstring)."""
    cfg, vocab = settings.data, settings.model.architecture().vocab_size
    wanted = manifest.data.dataset
    if {"data.dataset", "data.corpus"} & settings.given:
        data = prepare_data(cfg, vocab)
        if data.dataset_hash != wanted:
            given = cfg.dataset or cfg.corpus
            raise SwarmMismatch(
                f"the dataset here ({given}: {data.dataset_hash[:16]}, prepared from {data.index.source}) is "
                f"not swarm {manifest.run_id!r}'s ({wanted[:16]}, prepared from {manifest.data.corpus}): "
                "leave --dataset and --corpus out to train on the swarm's"
            )
        return data
    folder = cached_copy(cfg.cache_path, wanted)
    if folder is not None:
        logger.info("the swarm's dataset %s is in the cache: %s", wanted[:16], folder)
        return open_prepared(ShardStore(DatasetIndex.read(folder), folder, [], False, 0), vocab)
    places = [source_of(place) for place in manifest.data.sources]

    def sources() -> list:
        return [*places, *peer_sources(transport, manifest.run_id)]

    store = fetch_dataset(sources, cfg.cache_path, int(cfg.cache_mb * 1e6), digest=wanted)
    logger.info("the swarm's dataset %s: %d shards, fetched as trained", wanted[:16], len(store.index.train))
    return open_prepared(store, vocab)


class PeerSource:
    """One peer of the swarm, as a source of the dataset's files."""

    def __init__(self, transport: Transport, peer: str) -> None:
        self.transport, self.peer, self.name = transport, peer, f"peer {peer}"

    def read(self, name: str, max_bytes: int) -> bytes:
        try:
            return self.transport.request(
                self.peer, RPC_DATA, name.encode(), timeout=REQUEST_SECONDS, max_response_bytes=max_bytes
            )
        except (TransportError, RemoteError) as exc:
            raise SourceUnavailable(str(exc)) from None

    def refused(self, reason: str) -> None:
        self.transport.guard.reject(self.peer, "dataset file", reason)


class NoPeer:
    """What ``peer_sources`` lists when no other peer is live (so a failure says so)."""

    name = "the swarm's peers"

    def read(self, name: str, max_bytes: int) -> bytes:
        raise SourceUnavailable("no other peer is live")


def peer_sources(transport: Transport, run_id: str) -> list[PeerSource | NoPeer]:
    """The swarm's live peers (in a random order: a newcomer's fetches spread over them)."""
    peers = [p for p in read_peers(transport, run_id) if p != transport.peer_id]
    random.shuffle(peers)
    return [PeerSource(transport, p) for p in peers] or [NoPeer()]


def serve_data(transport: Transport, files: Callable[[str], bytes | None]) -> None:
    """Answers ``spes/data``: the file named, when this peer has it (``ShardStore.file``)."""

    def handle(caller: str, request: bytes) -> bytes:
        try:
            name = request.decode("ascii")
        except UnicodeDecodeError:
            raise BadRequest("a dataset file's name is ASCII") from None
        data = files(name)
        if data is None:
            raise Unavailable(f"no dataset file {name!r} here")
        return data

    transport.serve(RPC_DATA, handle, max_request_bytes=MAX_NAME_BYTES)
