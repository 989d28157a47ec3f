"""A dataset served under a URL (a web server on 127.0.0.1): training fetches its index and tokenizer at once
and a shard when it first reads it; a shard that is not the index's is refused, counted and fetched from the
next source; an unreachable source is passed over; the cache keeps at most its bound."""

import functools
import hashlib
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from spes_p2p.data.plan import LocalPlan
from spes_p2p.data.prepare import prepare
from spes_p2p.data.recipe import Recipe
from spes_p2p.data.shards import read_shard
from spes_p2p.data.sources import FolderSource, HttpSource, HubSource, ShardStore, open_dataset
from spes_p2p.errors import DataError
from spes_p2p.train.config import DataConfig
from spes_p2p.train.dataset import ShardSampler, prepare_data


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    for i in range(60):
        (corpus / f"{i}.txt").write_text(" ".join(f"word{(i * j) % 97}" for j in range(300)))
    folder = tmp_path_factory.mktemp("dataset") / "ds"
    index = prepare(Recipe(str(corpus), vocab_size=300, shard_tokens=2000, val_percent=10), folder)
    assert len(index.train) >= 6
    return folder, index


@pytest.fixture(scope="module")
def served(dataset):
    folder, _ = dataset
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_a_dataset_at_a_url_is_fetched_a_shard_at_a_time_as_training_reads_it(dataset, served, tmp_path):
    folder, index = dataset
    data = prepare_data(DataConfig(dataset=served, cache_dir=str(tmp_path)), vocab_size=300)
    assert data.dataset_hash == index.digest and data.tokenizer_hash == index.tokenizer_sha256
    assert data.store.fetched == 0 and not list(data.store.folder.glob("*/*.safetensors"))
    assert np.array_equal(data.shard("train", 3), read_shard(folder, index.train[3], index))
    assert sorted(p.name for p in data.store.folder.glob("*/*.safetensors")) == ["000003.safetensors"]
    data.shard("train", 3)
    assert data.store.fetched == 1  # (the second read is the local copy)


def test_a_shard_that_is_not_the_indexs_is_refused_counted_and_fetched_elsewhere(dataset, served, tmp_path):
    folder, index = dataset
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / index.train[0].name).write_bytes((folder / index.train[1].name).read_bytes())  # another shard
    store = ShardStore(index, tmp_path / "cache", [FolderSource(bad), HttpSource(served)], True, 10**9)
    assert np.array_equal(store.tokens("train", 0), read_shard(folder, index.train[0], index))
    assert store.refused == {str(bad): 1}
    (store.folder / index.train[0].name).write_bytes(
        b"damaged"
    )  # a damaged copy in the cache is fetched again
    assert np.array_equal(store.tokens("train", 0), read_shard(folder, index.train[0], index))
    assert store.refused == {str(bad): 2}


def test_an_unreachable_source_is_passed_over_and_none_left_is_one_line(dataset, served, tmp_path):
    folder, index = dataset
    gone = HttpSource("http://127.0.0.1:9/")  # (the discard port: nothing listens)
    store = ShardStore(index, tmp_path / "cache", [gone, HttpSource(served)], True, 10**9)
    assert np.array_equal(store.tokens("train", 1), read_shard(folder, index.train[1], index))
    lost = ShardStore(index, tmp_path / "lost", [gone, FolderSource(tmp_path / "nowhere")], True, 10**9)
    with pytest.raises(
        DataError, match=r"cannot get train/000001.safetensors from any source; tried http://127.0.0.1:9/"
    ):
        lost.tokens("train", 1)


def test_the_cache_keeps_at_most_its_bound(dataset, served, tmp_path):
    folder, index = dataset
    size = (folder / index.train[0].name).stat().st_size
    store = ShardStore(index, tmp_path / "cache", [HttpSource(served)], True, max_bytes=2 * size + 100)
    for number in range(4):
        store.tokens("train", number)
    kept = sorted(p.name for p in store.folder.glob("train/*.safetensors"))
    assert kept == ["000002.safetensors", "000003.safetensors"] and store.fetched == 4
    store.tokens("train", 0)
    assert store.fetched == 5


def test_a_url_that_serves_no_dataset_is_one_line(served, tmp_path):
    with pytest.raises(DataError, match=r"cannot get index\.json from any source"):
        open_dataset(served + "nothing/", tmp_path, 10**9)


def test_the_next_shard_is_fetched_while_the_current_one_trains(dataset, served, tmp_path):
    _, index = dataset
    data = prepare_data(DataConfig(dataset=served, cache_dir=str(tmp_path)), vocab_size=300)
    sampler = ShardSampler(data, 16, 2, 0, LocalPlan(len(data.index.train), 0))
    while sampler.ahead is None:  # half way through the first shard, the second is taken and on its way
        sampler.next_batch()
    data.store.wait()
    first, second = sampler.work.shard, sampler.ahead.shard
    names = {p.relative_to(data.store.folder).as_posix() for p in data.store.folder.glob("*/*.safetensors")}
    assert names == {index.train[first].name, index.train[second].name} and data.store.fetched == 2
    data.shard("train", second)
    assert data.store.fetched == 2  # (read from the copy fetched ahead)


class FakeHub(SimpleHTTPRequestHandler):
    """The Hub's file endpoint, /datasets/OWNER/NAME/resolve/REVISION/PATH, for one repository at one
    revision, whose files are ``directory``'s under the folder ``data``."""

    def translate_path(self, path: str) -> str:
        prefix = "/datasets/volunteers/corpus/resolve/v1/data/"
        return super().translate_path("/" + path[len(prefix) :] if path.startswith(prefix) else "/nothing")

    def end_headers(self) -> None:
        self.send_header("X-Repo-Commit", "0" * 40)
        self.send_header("ETag", f'"{hashlib.sha256(self.path.encode()).hexdigest()}"')
        super().end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_dataset_in_a_hugging_face_repository_is_read_through_its_client(dataset, tmp_path):
    folder, index = dataset
    hub = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(FakeHub, directory=str(folder)))
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{hub.server_address[1]}"
        source = HubSource("hf://datasets/volunteers/corpus@v1/data", endpoint=endpoint)
        assert (source.repo, source.revision, source.folder) == ("volunteers/corpus", "v1", "data")
        store = ShardStore(index, tmp_path / "cache", [source], True, 10**9)
        assert np.array_equal(store.tokens("train", 2), read_shard(folder, index.train[2], index))
        elsewhere = HubSource("hf://datasets/volunteers/corpus@v2/data", endpoint=endpoint)
        with pytest.raises(DataError, match=r"tried hf://datasets/volunteers/corpus@v2/data \("):
            ShardStore(index, tmp_path / "lost", [elsewhere], True, 10**9).tokens("train", 2)
    finally:
        hub.shutdown()
        hub.server_close()
        thread.join(timeout=10)
    with pytest.raises(DataError, match="hf://datasets/OWNER/NAME"):
        HubSource("hf://models/x")
