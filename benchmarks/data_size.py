"""A training process's peak memory and time to its first step, on a prepared dataset and on one 10 times
as large: reading a dataset shard by shard should cost the same whatever its size.

Prepares the first MB of the standard library and 10 times as much (``spes data prepare``, small shards so
that both datasets have many), then starts ``spes train``'s run (the tiny preset) in a fresh process on each,
alternately, ``--repeats`` times: the seconds from the process's start to its first step done, and its peak
RSS. Prints one JSON object with the medians and their ratios (large / small).

    python benchmarks/data_size.py --mb 3 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spes_p2p.data.prepare import prepare
from spes_p2p.data.recipe import Recipe

SHARD_TOKENS = 1 << 16  # 64k tokens: 3 MB of the stdlib is about 15 shards


def first_step(dataset: str, out: str) -> dict:
    """In this (fresh) process: a training run on ``dataset``, timed to its first step."""
    began = time.monotonic()
    from spes_p2p.settings import Settings
    from spes_p2p.train.run import TrainingRun

    s = Settings().override({"model.preset": "tiny", "data.dataset": dataset, "train.total_steps": 1})
    run = TrainingRun(s.model, s.train, s.data, Path(out))
    run.trainer.train_step(*run.sampler.next_batch())
    return {
        "seconds": time.monotonic() - began,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def measure(mb: float, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        datasets = {}
        for name, size in (("small", mb), ("large", 10 * mb)):
            recipe = Recipe("stdlib", vocab_size=1024, shard_tokens=SHARD_TOKENS, max_bytes=int(size * 1e6))
            index = prepare(recipe, Path(tmp, name))
            datasets[name] = {"tokens": index.tokens("train"), "shards": len(index.train)}
        runs = {"small": [], "large": []}
        for i in range(repeats):
            for name in runs:
                child = [
                    sys.executable,
                    __file__,
                    "--child",
                    str(Path(tmp, name)),
                    str(Path(tmp, f"run-{name}-{i}")),
                ]
                runs[name].append(
                    json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
                )
    result = {"repeats": repeats, "datasets": datasets}
    for key in ("seconds", "peak_rss_mb"):
        medians = {name: statistics.median(r[key] for r in rows) for name, rows in runs.items()}
        result[key] = {**medians, "ratio": medians["large"] / medians["small"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=3.0, help="The small dataset's text, in MB.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("DATASET", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    print(json.dumps(first_step(*args.child) if args.child else measure(args.mb, args.repeats)))


if __name__ == "__main__":
    main()
