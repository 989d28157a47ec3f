import os

# The suite runs a test per core (pytest -n auto): one math thread each, in the workers and in the peer
# processes they start, as `spes simulate` gives its peers. More only contend (the fast tier: 283 CPU-s
# with torch's default threads, 217 with one).
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

import pytest
import torch

from spes_p2p.train.config import DataConfig

torch.set_num_threads(1)

# A slice of the embedded default corpus: big enough to learn from, small enough to tokenize in seconds.
STDLIB_TEST_MB = 2.0
TOKENIZER = b'{"a tokenizer": true}'  # what manifest_of's peers serve as their tokenizer


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory) -> str:
    """One tokenizer/token cache for the whole session (child processes too), so each tokenizer is trained
    once and nothing is written under the user's home."""
    path = str(tmp_path_factory.mktemp("spes-cache"))
    os.environ["SPES_CACHE_DIR"] = path
    return path


@pytest.fixture(scope="session")
def stdlib_data(cache_dir) -> DataConfig:
    return DataConfig(corpus="stdlib", max_corpus_mb=STDLIB_TEST_MB, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def manifest_of():
    """A manifest for settings alone, for membership tests that build no model (its hashes are placeholders,
    the same for every peer of the same settings)."""
    from spes_p2p.peer.admission import manifest_for
    from spes_p2p.swarm.manifest import DatasetPin

    def build(settings):
        return manifest_for(settings, TOKENIZER, DatasetPin(), {})

    return build
