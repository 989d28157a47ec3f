"""The sparse codec (``sparseloco``) against int8, DiLoCo and centralized training: the ``codec_*`` sections
of ``benchmarks/run.py`` (docs/compression.md, docs/benchmarks.md).

- ``codec_bytes``: bytes per peer per round of the `1b` preset's shapes with virtual compute, against a
  DiLoCo peer's fp32 exchange. Four 1b peers do not fit in this machine's memory at once, so the same swarm
  runs with 1b's width and expert size and fewer layers, experts and tokens (``SHAPE_POINTS``); a peer's
  bytes are a sum over its tensors, each coded in a size linear in its elements (``features``), and 1b's
  figure is that sum's fit at (12 layers, 151,665 tokens, 16 experts), fitted on four points and checked on a
  fifth. tiny and small are measured whole in the ``bytes`` section.
- ``codec_loss``: validation loss at equal tokens, 3 seeds each, of SPES with sparseloco at two densities and
  with int8, DiLoCo (fp32) and centralized, on the loss section's setting and on a run 4 times as long; and
  the same runs compared at equal training compute (``flops_per_token``).
- ``codec_time``: coding time of a default peer's update (what a peer trains, with error feedback: encode,
  then decode its own payload) and decoding one co-holder's payload, on this machine's CPU, beside a round's
  compute at H = 100.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from itertools import pairwise

import torch

from spes_p2p.model.config import measured_step_seconds
from spes_p2p.model.units import layout_of

# (layers, vocabulary, experts) measured, the last to check the others' fit; 1b: 12, 151,665, 16
SHAPE_POINTS = ((1, 8192, 2), (2, 8192, 2), (1, 16384, 2), (1, 8192, 4), (2, 8192, 4))
LOSS_SEEDS = (0, 1, 2)
# the methods compared, as settings changes: SPES runs the default exchange (reduce-scatter, changes). The
# sparse codec at two densities: SparseLoCo's (64 of 4,096, 1.6%), and the densest whose bytes stay within
# 0.02x DiLoCo's on `small` (512 of 4,096, 12.5%: 0.019x; docs/benchmarks.md)
SPARSE_KS = (64, 512)
CODEC_METHODS = {
    **{
        f"spes sparseloco k={k}": {
            "sync.codec": "sparseloco",
            "sync.refresh_codec": "sparseloco",
            "sync.sparse_k": k,
        }
        for k in SPARSE_KS
    },
    "spes int8": {},
    "diloco fp32": {"method.mode": "diloco", "sync.codec": "none", "sync.refresh_codec": "none"},
}
# a round's compute at H = 100 on a GPU, for the wan figure and the coding-time ratio: an estimate, not a
# measurement (no GPU here). A 1b peer's step of 16 x 1024 tokens at its FLOPs per token
# (``flops_per_token``), on a GPU that sustains 100 TFLOP/s in bf16 (about 40% of an RTX 4090's or 10% of an
# H100's dense peak)
GPU_STEP_TOKENS, GPU_FLOPS = 16 * 1024, 100e12
H = 100


# ------------------------------------------------------------------------------------------- shapes


def features(layers: int, vocab: int, experts: int) -> list[float]:
    """A peer's bytes as a sum over its tensors: a constant, the embedding and head (in the vocabulary), and
    per layer its attention (constant) and its experts and router (in the experts)."""
    return [1.0, vocab, layers, layers * experts]


def extend(points: list[tuple], column: int, at: tuple[int, int, int]) -> float:
    """``column`` of ``points`` (rows of layers, vocabulary, experts, figures...), fitted exactly on the first
    four by ``features`` and evaluated at ``at``."""
    matrix = torch.tensor([features(*p[:3]) for p in points[:4]], dtype=torch.float64)
    values = torch.tensor([float(p[column]) for p in points[:4]], dtype=torch.float64)
    weights = torch.linalg.solve(matrix, values)
    return float(torch.tensor(features(*at), dtype=torch.float64) @ weights)


def trained_shapes(settings) -> tuple[dict[str, dict[str, tuple[int, ...]]], dict[str, frozenset[str]]]:
    """A default peer's trained units (the first expert shard and the first dense block) -> tensor shapes,
    and the tensors of each that its quantized keepers quantize, from a model built on the meta device (no
    memory)."""
    from spes_p2p.model import MoETransformer
    from spes_p2p.model.units import quantized_when_frozen, unit_parameters

    layout = layout_of(settings.model)
    with torch.device("meta"):
        model = MoETransformer(settings.model.architecture())
    units = [layout.dense_units[0], layout.expert_units[0]]
    shapes = {u: {n: tuple(p.shape) for n, p in unit_parameters(model, layout, u).items()} for u in units}
    return shapes, quantized_when_frozen(model, layout)


def flops_per_token(settings, method: str) -> float:
    """Training FLOPs per token of one peer: 2 x the active matmul parameters forward, as much again for the
    activations' gradients backward, and 2 x the active parameters it trains for their weight gradients.
    A SPES peer trains one dense block of B and 1/shards of the experts (a token reaches one of its experts
    top_k / shards of the time, on average); DiLoCo and centralized train all (6 x active). Attention's
    score and value products (4 x seq_len x d_model a layer forward) have two inputs to differentiate and no
    weights: 6 x theirs in every method."""
    arch, model = settings.model.architecture(), settings.model
    d, f, layers = arch.d_model, arch.expert_dim, arch.n_layers
    attention = layers * (2 * d * d + 2 * d * arch.head_dim * arch.kv_heads)
    experts = layers * arch.top_k * 3 * d * f
    head, router = d * arch.vocab_size, layers * d * arch.n_experts
    scores = layers * 2 * settings.train.seq_len * d  # per token, forward, as parameter-equivalents
    active = attention + experts + head + router + scores
    if method in ("diloco", "centralized"):
        return 6 * active
    dense_trained = (attention + head + router) / model.dense_blocks
    return 4 * active + 2 * (dense_trained + experts / model.shards + scores)


# -------------------------------------------------------------------------------------- coding time


def bench_codec_time(presets: list[str], codecs: list[str]) -> list[dict]:
    """Seconds to code a default peer's update of each preset (error feedback's encode, which decodes its
    own payload too), to decode one payload of it, and to publish the next version of each unit it trains
    that others keep frozen copies of (``Versions.advance``: the exact chain's change and each quantized
    chain's, in the same codec), against a round's compute at H = 100."""
    from spes_p2p.settings import Settings
    from spes_p2p.sync.codecs import CODECS
    from spes_p2p.sync.payload import ErrorFeedback, decode, specs_of
    from spes_p2p.sync.versions import Chains, Versions

    rows = []
    for preset in presets:
        settings = Settings().override({"model.preset": preset})
        shapes, quantized = trained_shapes(settings)
        g = torch.Generator().manual_seed(0)
        updates = {
            u: {n: torch.randn(s, generator=g) * 1e-3 for n, s in t.items()} for u, t in shapes.items()
        }
        numel = sum(math.prod(s) for t in shapes.values() for s in t.values())
        step_tokens = settings.train.batch_size * settings.train.seq_len
        cpu_step = measured_step_seconds(preset, step_tokens)
        gpu_round = H * GPU_STEP_TOKENS * flops_per_token(settings, "spes") / GPU_FLOPS
        for name in codecs:
            codec = CODECS[name]
            ErrorFeedback(codec).encode({"warm-up": torch.randn(10_000, generator=g)})
            encode_s, decode_s, publish_s, sizes = [], [], [], 0
            for unit, update in updates.items():
                feedback = ErrorFeedback(codec)
                started = time.perf_counter()
                payload, _ = feedback.encode(update, round_=0)
                encode_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                decode(payload, specs_of(update), codec)
                decode_s.append(time.perf_counter() - started)
                sizes += len(payload)
                if unit.startswith("experts/") or settings.model.dense_blocks > 1:  # (others keep copies)
                    versions = Versions(codec, Chains(shapes, quantized))
                    versions.start(unit, 0, {n: torch.zeros_like(t) for n, t in update.items()})
                    started = time.perf_counter()
                    versions.advance(unit, 1, 0, update)
                    publish_s.append(time.perf_counter() - started)
                    del versions
            row = {
                "preset": preset,
                "codec": name,
                "trained_params": numel,
                "payload_bytes": sizes,
                "encode_seconds": sum(encode_s),
                "decode_seconds": sum(decode_s),
                "publish_seconds": sum(publish_s),
                "cpu_round_seconds": None if cpu_step is None else H * cpu_step,
                "gpu_round_seconds_estimate": gpu_round,
            }
            rows.append(row)
            print(f"codec time {json.dumps(row)}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------- tables


def headline(results: dict, measured) -> dict:
    """The codec sections' headline figures, of those measured."""
    figures = {}
    if measured(results, "codec_bytes"):
        for r in results["codec_bytes"]:
            figures[f"bytes_ratio_vs_diloco_fp32_{r.get('preset', '1b')}_{r['codec']}"] = r[
                "ratio_vs_diloco_fp32"
            ]
    if measured(results, "codec_time"):
        for r in results["codec_time"]:
            gpu = r["gpu_round_seconds_estimate"]
            figures[f"encode_share_of_gpu_round_{r['preset']}_{r['codec']}"] = r["encode_seconds"] / gpu
            if "publish_seconds" in r:
                coding = (r["encode_seconds"] + r["publish_seconds"]) / gpu
                figures[f"encode_and_publish_share_of_gpu_round_{r['preset']}_{r['codec']}"] = coding
    if measured(results, "codec_loss"):
        for length in ("short", "long"):
            curves = results["codec_loss"].get(length, {})
            final = {name: statistics.fmean(c[-1][1] for c in runs) for name, runs in curves.items()}
            for name in (f"spes sparseloco k={k}" for k in SPARSE_KS):
                if name in final:
                    key = name.split()[-1].replace("=", "")
                    figures[f"val_loss_ratio_sparseloco_{key}_vs_int8_{length}"] = (
                        final[name] / final["spes int8"]
                    )
                    figures[f"val_loss_ratio_sparseloco_{key}_vs_diloco_{length}"] = (
                        final[name] / final["diloco fp32"]
                    )
    if measured(results, "codec_wan"):
        figures["sync_wait_fraction_sparseloco_1b_link"] = results["codec_wan"]["sync_wait_fraction"]
    return figures


def equal_compute(loss: dict, settings) -> dict[str, list[float]]:
    """Each method's validation loss (one per seed) at the training FLOPs of a DiLoCo peer's short run: read
    on the long runs' curves, at the tokens that many FLOPs buy each method (``flops_per_token``), linearly
    between validations."""
    per_token = {
        name: flops_per_token(settings, "centralized" if name == "centralized" else name.split()[0])
        for name in loss["long"]
    }
    budget = loss["short"]["diloco fp32"][0][-1][0] * per_token["diloco fp32"]
    return {
        name: [_at(curve, budget / per_token[name]) for curve in curves]
        for name, curves in loss["long"].items()
    }


def _at(curve: list, tokens: float) -> float:
    """The curve's loss at ``tokens`` (linear between its points; its last point beyond it)."""
    for (t0, l0), (t1, l1) in pairwise(curve):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return curve[-1][1] if tokens > curve[-1][0] else curve[0][1]


def spread(values: list[float]) -> str:
    """Mean, and (min to max) over seeds."""
    return f"{statistics.fmean(values):.3f} ({min(values):.3f} to {max(values):.3f})"


def codec_tables(results: dict, row, mib) -> list[str]:
    out = []
    if "codec_bytes" in results:
        heads = ("sent MiB", "received MiB", "DiLoCo fp32 MiB", "vs DiLoCo fp32", "DiLoCo / 24 B a param")
        out += ["", row("preset", "SPES peer: codec", *heads, "fit's error, 5th point"), row(*["---"] * 8)]
        for r in results["codec_bytes"]:
            check = f"{r['formula_check']:.3f}" if "formula_check" in r else "(the formula)"
            fit = f"{r['check_point_error']:+.3f}" if "check_point_error" in r else ""
            sizes = (mib(r["sent"]), mib(r["received"]), mib(r["diloco_fp32_bytes"]))
            ratio = f"{r['ratio_vs_diloco_fp32']:.4f}"
            out.append(row(r.get("preset", "1b"), r["codec"], *sizes, ratio, check, fit))
    if "codec_time" in results:
        heads = ("trained params", "payload MiB", "encode s", "decode s", "publish s", "CPU round s")
        heads += ("GPU round s (est.)", "encode / GPU round", "encode + publish / GPU round")
        out += ["", row("preset", "codec", *heads), row(*["---"] * 11)]
        for r in results["codec_time"]:
            cpu, gpu = r["cpu_round_seconds"], r["gpu_round_seconds_estimate"]
            publish = r.get("publish_seconds")
            out.append(
                row(
                    r["preset"],
                    r["codec"],
                    f"{r['trained_params']:,}",
                    mib(r["payload_bytes"]),
                    f"{r['encode_seconds']:.3f}",
                    f"{r['decode_seconds']:.3f}",
                    "" if publish is None else f"{publish:.3f}",
                    "" if cpu is None else f"{cpu:.0f}",
                    f"{gpu:.2f}",
                    f"{r['encode_seconds'] / gpu:.3f}",
                    "" if publish is None else f"{(r['encode_seconds'] + publish) / gpu:.3f}",
                )
            )
    if "codec_wan" in results:
        r = results["codec_wan"]
        out += [
            "",
            row("codec_wan: 4 small peers, sparseloco, transfer / compute as a 1b peer's", ""),
            row("---", "---"),
        ]
        one_b = r["one_b_transfer_seconds_per_round"], r["one_b_round_compute_seconds"]
        out += [
            row("a 1b peer's upload per round on 20 Mbit/s (s)", f"{one_b[0]:.1f}"),
            row("a 1b peer's round of compute (s, on a GPU, estimated)", f"{one_b[1]:.1f}"),
            row("the scaled swarm's link (kbit/s, both ways)", f"{r['bandwidth_kbit']:.0f}"),
            row("its round of compute (s)", f"{r['round_compute_seconds']:.1f}"),
            row("round (s, median)", f"{r['round_seconds']:.1f}" if r["round_seconds"] else "failed"),
            row(
                "sync-wait share (rounds 2 to n - 1 / with the last)",
                f"{r['sync_wait_fraction']:.3f} / {r['sync_wait_fraction_with_last']:.3f}",
            ),
        ]
    if "codec_loss" in results:
        from spes_p2p.settings import Settings

        loss = results["codec_loss"]
        screening = loss.get("screening", {})
        for length in ("short", "long"):
            if length not in loss:
                continue
            heads = (
                "tokens",
                "final val loss, mean (min to max)",
                "refused, left out, banned, resynced, missing",
            )
            out += ["", row(f"{length} run: method", *heads), row(*["---"] * 4)]
            for name, runs in loss[length].items():
                seen = [v for k, v in screening.items() if k.startswith(f"{length}/{name}/")]
                counts = (sum(s["refused"] for s in seen), sum(s.get("left_out", 0) for s in seen))
                counts += (sum(len(s["banned"]) for s in seen),)
                counts += tuple(sum(s.get(k, 0) for s in seen) for k in ("resynced", "missing"))
                cells = (f"{runs[0][-1][0]:,}", spread([c[-1][1] for c in runs]), ", ".join(map(str, counts)))
                out.append(row(name, *cells[:2], cells[2] if seen else ""))
        if "long" in loss:
            at = equal_compute(loss, Settings().override({"model.shards": 2}))
            out += ["", row("at a DiLoCo peer's FLOPs of the short run", "val loss, mean (min to max)")]
            out.append(row("---", "---"))
            out += [row(name, spread(values)) for name, values in at.items()]
    return out
