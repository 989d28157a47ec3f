"""The sync protocol: one round's exchange of compressed updates among the holders of each unit, and the
refresh of frozen copies from holders. It moves tensors; it knows nothing of optimizers or data.

Round r, for every unit u this peer holds (see docs/protocol.md for the wire details):

1. update = end weights - start weights; encode it (top-k keeps its error feedback locally); decode our own
   payload too, so every holder aggregates exactly the same numbers;
2. keep the payload in the outbox and announce it under ``<run>/updates/<r>/<u>``: tokens, size, SHA-256,
   and a hash of the start weights;
3. fetch the announced payloads of the unit's other participants (its live holders; for the dense part, this
   round's random group of at most G peers), several at a time, until all have answered or the deadline
   passed; late updates of the previous ``staleness`` rounds still count;
4. check each payload (announced size and checksum, codec limits, names, shapes, finiteness);
5. token-weighted mean of the updates, then the outer rule (FedAvg or Nesterov). If some participant started
   from other weights than ours (different start hash), deltas cannot be mixed: the participants' end weights
   are fetched uncompressed and averaged instead, which re-synchronizes the holders in one round.

Afterwards the peer serves its new weights of each unit it holds (``spes/weights``), and refreshes its frozen
copies of the others from their holders. No wait is unbounded: every fetch has a timeout and every round a
deadline that adapts to observed arrival times within [deadline_min, deadline_max].
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import torch

from spes_p2p.swarm.aggregate import Contribution, OuterStep, weighted_mean
from spes_p2p.swarm.codecs import (
    CODECS,
    PayloadError,
    TensorSpec,
    TopKFeedback,
    decode,
    encode,
    max_payload_bytes,
)
from spes_p2p.swarm.transport import RemoteError, Transport, TransportError, Unavailable

logger = logging.getLogger(__name__)

LIVENESS_CHECK_SECONDS = 1.0
RPC_UPDATE = "spes/update"
RPC_WEIGHTS = "spes/weights"

Tensors = dict[str, torch.Tensor]


def updates_key(run_id: str, round_: int, unit: str) -> str:
    return f"{run_id}/updates/{round_}/{unit}"


def tensors_hash(tensors: Tensors) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    run_id: str
    codec: str = "int8"  # updates
    refresh_codec: str = "int8"  # frozen copies
    topk_fraction: float = 0.02
    outer: str = "fedavg"
    outer_lr: float = 1.0
    outer_momentum: float = 0.9
    dense_group_size: int = 16  # G
    staleness: int = 1  # rounds a late update still counts
    deadline_min: float = 2.0
    deadline_max: float = 60.0
    deadline_factor: float = 2.0  # deadline = factor x the recent time the last participant took to arrive
    request_timeout: float = 30.0
    poll_interval: float = 0.1
    parallel_fetches: int = 4
    keep_rounds: int = 3  # rounds the outbox keeps serving
    announce_ttl: float = 120.0


@dataclass
class UnitRound:
    """What one unit's exchange did in one round."""

    unit: str
    participants: list[str]  # peers whose updates were aggregated (this one included)
    missing: list[str]  # expected participants that did not answer in time
    rejected: list[str]  # peers whose payloads failed validation
    resynced: bool = False  # start weights differed, so end weights were averaged instead
    new_weights: Tensors = field(default_factory=dict)


@dataclass
class _Outgoing:
    round: int
    payload: bytes  # the encoded update
    end: Tensors  # end weights, served uncompressed when start weights differ
    tokens: int
    base_hash: str


class AdaptiveDeadline:
    """How long a round waits for the last participant: factor x a running mean of observed waits, clamped."""

    def __init__(self, low: float, high: float, factor: float) -> None:
        self.low, self.high, self.factor = low, high, factor
        self.mean_wait: float | None = None

    def seconds(self) -> float:
        if self.mean_wait is None:
            return self.high
        return min(self.high, max(self.low, self.factor * self.mean_wait))

    def observe(self, wait: float) -> None:
        self.mean_wait = wait if self.mean_wait is None else 0.7 * self.mean_wait + 0.3 * wait


class SyncEngine:
    def __init__(
        self,
        transport: Transport,
        cfg: SyncConfig,
        specs: dict[str, dict[str, TensorSpec]],
        local_copy: Callable[[str], Tensors] | None = None,
        live_peers: Callable[[], set[str]] | None = None,
    ) -> None:
        self.transport, self.cfg, self.specs = transport, cfg, specs
        self.local_copy = local_copy  # reads our copy of any unit, for newcomers that find no holder ready
        self.live_peers = live_peers  # who is still in the swarm: no round waits for peers that left
        self.abort = threading.Event()  # set when the peer stops: waits end at once, with what has arrived
        self.outbox: dict[tuple[int, str], _Outgoing] = {}
        self.current: dict[str, dict[int, Tensors]] = {}  # unit -> round -> weights served to non-holders
        self._encoded: dict[tuple[int, str, str], bytes] = {}
        self.base_hashes: dict[tuple[int, str], str] = {}  # (round, unit) -> our start-weights hash
        self.applied: set[tuple[str, int, str]] = set()  # (peer, round, unit) already aggregated
        self.feedback: dict[str, TopKFeedback] = {}
        self.outer: dict[str, OuterStep] = {}
        self.deadline = AdaptiveDeadline(cfg.deadline_min, cfg.deadline_max, cfg.deadline_factor)
        self.rejected_payloads = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(cfg.parallel_fetches, thread_name_prefix="spes-fetch")
        transport.serve(RPC_UPDATE, self.rpc_update)
        transport.serve(RPC_WEIGHTS, self.rpc_weights)

    # ----------------------------------------------------------------------------------------- serving

    def rpc_update(self, caller: str, request: bytes) -> bytes:
        """{round, unit, kind}: our encoded update of that round, or our end weights (kind 'end')."""
        req = _unpack_request(request, ("round", "unit", "kind"))
        with self._lock:
            out = self.outbox.get((req["round"], req["unit"]))
        if out is None:
            raise Unavailable(f"no update for {req['unit']} in round {req['round']}")
        return (
            out.payload
            if req["kind"] == "delta"
            else self._encode_cached(out.round, f"end:{req['unit']}", out.end, "none")
        )

    def rpc_weights(self, caller: str, request: bytes) -> bytes:
        """{unit, codec, round, any_copy}: our weights of a unit we hold, as {round, payload, holder}: of that
        round if we still have it (so every non-holder gets the same version), else our newest. With
        ``any_copy`` (newcomers), a unit we do not hold is answered from our own copy of it."""
        req = _unpack_request(request, ("unit", "codec"))
        with self._lock:
            versions = dict(self.current.get(req["unit"], {}))
        if versions:
            round_ = req.get("round") if req.get("round") in versions else max(versions)
            payload = self._encode_cached(round_, req["unit"], versions[round_], req["codec"])
            return msgpack.packb({"round": round_, "payload": payload, "holder": True}, use_bin_type=True)
        if req.get("any_copy") and self.local_copy is not None and req["unit"] in self.specs:
            payload = encode(self.local_copy(req["unit"]), req["codec"], self.cfg.topk_fraction)
            return msgpack.packb({"round": -1, "payload": payload, "holder": False}, use_bin_type=True)
        raise Unavailable(f"this peer does not hold {req['unit']}")

    def _encode_cached(self, round_: int, key: str, tensors: Tensors, codec: str) -> bytes:
        with self._lock:
            cached = self._encoded.get((round_, key, codec))
        if cached is None:
            cached = encode(tensors, codec, self.cfg.topk_fraction)
            with self._lock:
                self._encoded[(round_, key, codec)] = cached
        return cached

    def serve_weights(self, round_: int, unit: str, weights: Tensors) -> None:
        """From now on, non-holders that ask for ``unit`` get these weights (as of round ``round_``)."""
        with self._lock:
            versions = self.current.setdefault(unit, {})
            versions[round_] = {n: t.detach().clone() for n, t in weights.items()}
            for old in sorted(versions)[: -self.cfg.keep_rounds]:  # so slower peers get the version they ask
                del versions[old]
            self._encoded = {k: v for k, v in self._encoded.items() if k[:2] != (round_, unit)}

    def forget_before(self, round_: int) -> None:
        """Drops outbox entries, served weights (so a unit given up stops being served) and caches older
        than ``keep_rounds``."""
        horizon = round_ - self.cfg.keep_rounds
        with self._lock:
            kept = {u: {r: w for r, w in v.items() if r > horizon} for u, v in self.current.items()}
            self.current = {u: v for u, v in kept.items() if v}
            self.outbox = {k: v for k, v in self.outbox.items() if k[0] > horizon}
            self._encoded = {k: v for k, v in self._encoded.items() if k[0] > horizon}
            self.base_hashes = {
                k: v for k, v in self.base_hashes.items() if k[0] > horizon - self.cfg.staleness
            }

    # ---------------------------------------------------------------------------------------- the round

    def exchange(
        self,
        round_: int,
        unit: str,
        start: Tensors,
        end: Tensors,
        tokens: int,
        participants: list[str],
        counted: bool = True,
    ) -> UnitRound:
        """Steps 1-7 of the round for one unit; returns the unit's new weights and who took part. With
        ``counted`` False (a newcomer's first round, which the others do not wait for) our own update is
        neither announced nor aggregated: we adopt the others' result, exactly as they compute it."""
        me = self.transport.peer_id
        base_hash = tensors_hash(start)
        own: list[Contribution] = []
        if counted:
            own = [
                Contribution(me, tokens, self._announce(round_, unit, start, end, tokens, base_hash), round_)
            ]
        others = sorted(set(participants) - {me})
        fetched, missing, rejected = self._gather(round_, unit, others)
        late = self._late_updates(round_, unit)
        result = UnitRound(unit, [me], missing, rejected)
        same_base = [c for c, base in fetched if base == base_hash]
        if len(same_base) == len(fetched):
            contributions = [*own, *same_base, *late]
            if not contributions:  # nobody to aggregate with: our own end weights stand
                result.new_weights = {n: t.clone() for n, t in end.items()}
            else:
                outer = self.outer.setdefault(
                    unit, OuterStep(self.cfg.outer, self.cfg.outer_lr, self.cfg.outer_momentum)
                )
                result.new_weights = outer.apply(start, weighted_mean(contributions))
        else:  # someone started elsewhere: average end weights, putting every participant on one base again
            contributions = [Contribution(me, tokens, end, round_)] if counted else []
            contributions += [
                c for c in (self._fetch_end(round_, unit, c) for c, _ in fetched) if c is not None
            ]
            result.new_weights = weighted_mean(contributions) if contributions else dict(end)
            result.resynced = True
            self.outer.pop(unit, None)
        result.participants = sorted({c.peer_id for c in contributions})
        with self._lock:
            self.applied |= {(c.peer_id, c.round, unit) for c in contributions}
        return result

    def _announce(
        self, round_: int, unit: str, start: Tensors, end: Tensors, tokens: int, base_hash: str
    ) -> Tensors:
        """Encodes, keeps and announces our update; returns its decoded form, which is what we aggregate."""
        payload = self._encode_update(unit, {n: end[n] - start[n] for n in start})
        with self._lock:
            self.outbox[(round_, unit)] = _Outgoing(
                round_, payload, {n: t.clone() for n, t in end.items()}, tokens, base_hash
            )
            self.base_hashes[(round_, unit)] = base_hash
        announcement = {
            "round": round_,
            "tokens": tokens,
            "bytes": len(payload),
            "codec": self.cfg.codec,
            "sha256": hashlib.sha256(payload).hexdigest(),
            "base": base_hash,
        }
        self.transport.publish(
            updates_key(self.cfg.run_id, round_, unit),
            announcement,
            self.transport.now() + self.cfg.announce_ttl,
        )
        return decode(payload, self.specs[unit], self.cfg.codec)

    def _encode_update(self, unit: str, update: Tensors) -> bytes:
        if self.cfg.codec == "topk":
            return self.feedback.setdefault(unit, TopKFeedback()).encode(update, self.cfg.topk_fraction)
        return encode(update, self.cfg.codec, self.cfg.topk_fraction)

    def _gather(self, round_: int, unit: str, others: list[str]):
        """Fetches the others' updates of this round until all answered, left, or the deadline passed."""
        started = time.monotonic()
        deadline = started + self.deadline.seconds()
        fetched: dict[str, tuple[Contribution, str]] = {}
        rejected: set[str] = set()
        waiting = set(others)
        next_liveness_check = started + LIVENESS_CHECK_SECONDS
        while True:
            announced = self._announcements(round_, unit)
            todo = [(p, announced[p]) for p in sorted(waiting) if p in announced]
            outcomes = self._pool.map(lambda item: self._fetch(round_, unit, *item), todo)
            for (peer, _), outcome in zip(todo, outcomes, strict=True):
                if isinstance(outcome, tuple):
                    fetched[peer] = outcome
                    waiting.discard(peer)
                elif outcome == "rejected":
                    rejected.add(peer)
                    waiting.discard(peer)
                elif outcome == "gone":
                    waiting.discard(peer)
            now = time.monotonic()
            if waiting and self.live_peers is not None and now >= next_liveness_check:
                waiting &= self.live_peers()  # a participant whose records vanished has left: stop waiting
                next_liveness_check = now + LIVENESS_CHECK_SECONDS
            if not waiting:
                self.deadline.observe(now - started)
                break
            if now >= deadline or self.abort.is_set():
                logger.info("round %d %s: deadline passed without %s", round_, unit, sorted(waiting))
                break
            time.sleep(self.cfg.poll_interval)
        missing = sorted(set(others) - set(fetched) - rejected)
        return [fetched[p] for p in sorted(fetched)], missing, sorted(rejected)

    def _announcements(self, round_: int, unit: str) -> dict[str, dict]:
        entries = self.transport.read(updates_key(self.cfg.run_id, round_, unit))
        return {p: e.value for p, e in entries.items() if _valid_announcement(e.value, round_)}

    def _fetch(self, round_: int, unit: str, peer: str, announcement: dict):
        """(Contribution, start hash); 'rejected' for a bad payload; 'gone' when the announcer no longer
        has it (it moved on); None when it cannot be reached right now."""
        codec = announcement["codec"]
        limit = max_payload_bytes(self.specs[unit], codec) if codec in CODECS else 0
        if not 0 < announcement["bytes"] <= limit:
            logger.warning(
                "rejecting %s's %s update: announced %s bytes (limit %d)",
                peer,
                unit,
                announcement["bytes"],
                limit,
            )
            return self._reject()
        request = msgpack.packb({"round": round_, "unit": unit, "kind": "delta"})
        try:
            payload = self.transport.request(
                peer, RPC_UPDATE, request, timeout=self.cfg.request_timeout, max_response_bytes=limit
            )
        except RemoteError as exc:  # it announced the update, so it will not come back
            logger.info("%s no longer has its %s update of round %d: %s", peer, unit, round_, exc)
            return "gone"
        except TransportError as exc:
            logger.info("could not fetch %s's %s update of round %d: %s", peer, unit, round_, exc)
            return None
        try:
            if hashlib.sha256(payload).hexdigest() != announcement["sha256"]:
                raise PayloadError("payload does not match its announced checksum")
            tensors = decode(payload, self.specs[unit], codec)
        except PayloadError as exc:
            logger.warning("rejecting %s's %s update of round %d: %s", peer, unit, round_, exc)
            return self._reject()
        return Contribution(peer, int(announcement["tokens"]), tensors, round_), announcement["base"]

    def _reject(self) -> str:
        with self._lock:
            self.rejected_payloads += 1
        return "rejected"

    def _fetch_end(self, round_: int, unit: str, contribution: Contribution) -> Contribution | None:
        request = msgpack.packb({"round": round_, "unit": unit, "kind": "end"})
        try:
            payload = self.transport.request(
                contribution.peer_id,
                RPC_UPDATE,
                request,
                timeout=self.cfg.request_timeout,
                max_response_bytes=max_payload_bytes(self.specs[unit], "none"),
            )
            return Contribution(
                contribution.peer_id, contribution.tokens, decode(payload, self.specs[unit], "none"), round_
            )
        except (TransportError, PayloadError) as exc:
            logger.info("could not fetch %s's %s end weights: %s", contribution.peer_id, unit, exc)
            return None

    def _late_updates(self, round_: int, unit: str) -> list[Contribution]:
        """Updates of the last ``staleness`` rounds that came after those rounds closed, on our old base."""
        late = []
        for past in range(max(0, round_ - self.cfg.staleness), round_):
            our_base = self.base_hashes.get((past, unit))
            announced = self._announcements(past, unit)
            for peer in sorted(announced):
                if peer == self.transport.peer_id or (peer, past, unit) in self.applied:
                    continue
                if our_base is None or announced[peer]["base"] != our_base:
                    continue
                outcome = self._fetch(past, unit, peer, announced[peer])
                if isinstance(outcome, tuple):
                    late.append(outcome[0])
        return late

    # ------------------------------------------------------------------------------------ frozen copies

    def refresh(
        self,
        min_round: int,
        holders: dict[str, list[str]],
        deadline: float,
        codec: str | dict[str, str] | None = None,
        on_unit: Callable[[str, int, Tensors], None] | None = None,
        fallback: list[str] = (),
    ) -> dict[str, int]:
        """Fetches each unit in ``holders`` (unit -> live holders) from one of them, units in parallel, once
        a holder has weights of round >= ``min_round``; returns unit -> round fetched, for units obtained.
        A unit that no holder can serve yet is taken from a ``fallback`` peer's own copy (newcomers).
        ``codec``: one for every unit, or unit -> codec (default: the refresh codec)."""
        codecs = codec if isinstance(codec, dict) else {u: codec or self.cfg.refresh_codec for u in holders}
        stop_at = time.monotonic() + deadline
        futures = {
            u: self._pool.submit(self._refresh_unit, u, h, list(fallback), min_round, codecs[u], stop_at)
            for u, h in holders.items()
            if h or fallback
        }
        got = {}
        for unit, future in futures.items():
            outcome = future.result()
            if outcome is not None:
                got[unit] = outcome[0]
                if on_unit:
                    on_unit(unit, *outcome)
        return got

    def _refresh_unit(
        self, unit: str, holders: list[str], fallback: list[str], min_round: int, codec: str, stop_at: float
    ):
        order = list(holders)
        random.Random(f"{self.transport.peer_id}:{unit}:{min_round}").shuffle(order)  # spread the load
        while True:
            if self.live_peers is not None:
                order = [p for p in order if p in self.live_peers()]
                if not order and not fallback:
                    logger.info("every holder of %s left; keeping the old copy", unit)
                    return None
            for peer in order:
                found = self._fetch_weights(peer, unit, codec, min_round, any_copy=False)
                if found is not None:
                    return found
            last_try = time.monotonic() >= stop_at or self.abort.is_set()
            for peer in fallback if not order or last_try else ():  # holders first, while they may catch up
                found = self._fetch_weights(peer, unit, codec, -1, any_copy=True)
                if found is not None:
                    return found
            if last_try:
                logger.info("no holder had %s of round >= %d in time; keeping the old copy", unit, min_round)
                return None
            time.sleep(self.cfg.poll_interval)

    def _fetch_weights(self, peer: str, unit: str, codec: str, min_round: int, any_copy: bool):
        """(round, weights) from ``peer``, or None when it cannot serve them (yet)."""
        # the round to match (refreshes: every peer then gets the same version), or the newest (catch-up)
        wanted = min_round if min_round >= 0 else None
        request = msgpack.packb({"unit": unit, "codec": codec, "round": wanted, "any_copy": any_copy})
        limit = max_payload_bytes(self.specs[unit], codec) + 64
        try:
            raw = self.transport.request(
                peer, RPC_WEIGHTS, request, timeout=self.cfg.request_timeout, max_response_bytes=limit
            )
            answer = msgpack.unpackb(raw, raw=False)
            if not isinstance(answer, dict) or not isinstance(answer.get("round"), int):
                raise PayloadError("malformed weights answer")
            if answer["round"] < min_round:
                return None
            return answer["round"], decode(answer["payload"], self.specs[unit], codec)
        except (TransportError, PayloadError, ValueError, KeyError, TypeError) as exc:
            logger.debug("weights of %s from %s: %s", unit, peer, exc)
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def dense_group(peers: list[str], me: str, round_: int, run_id: str, size: int) -> list[str]:
    """This round's random group (at most ``size`` peers) that ``me`` averages the dense part with."""
    order = sorted(peers)
    random.Random(f"{run_id}:{round_}").shuffle(order)
    n_groups = max(1, -(-len(order) // size))
    groups = [order[i::n_groups] for i in range(n_groups)]
    return next((g for g in groups if me in g), [me])


def _unpack_request(request: bytes, keys: tuple[str, ...]) -> dict:
    try:
        req = msgpack.unpackb(request, raw=False)
    except (ValueError, msgpack.UnpackException):
        raise ValueError("malformed request") from None
    if not isinstance(req, dict) or any(k not in req for k in keys):
        raise ValueError(f"request must hold {', '.join(keys)}")
    return req


def _valid_announcement(value, round_: int) -> bool:
    return (
        isinstance(value, dict)
        and value.get("round") == round_
        and isinstance(value.get("tokens"), int)
        and isinstance(value.get("bytes"), int)
        and isinstance(value.get("sha256"), str)
        and isinstance(value.get("base"), str)
        and isinstance(value.get("codec"), str)
    )
