import hashlib
import json
import sys

import numpy as np
import pytest

from spes_p2p.data.corpus import Document, first_bytes, held_out, iter_documents
from spes_p2p.data.plan import LocalPlan, Work
from spes_p2p.data.shards import FORMAT, DatasetIndex, Shard, encode_shard, shard_name
from spes_p2p.data.sources import ShardStore
from spes_p2p.data.tokenizer import train_tokenizer
from spes_p2p.errors import DataError
from spes_p2p.train.config import DataConfig
from spes_p2p.train.dataset import PreparedData, ShardSampler, prepare_data


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def documents(corpus: str, max_bytes: int | None = None) -> list[Document]:
    return list(first_bytes(iter_documents(corpus), max_bytes))


def docs(n: int) -> list[Document]:
    return [Document(f"doc{i}.txt", f"def f{i}(x):\n    return x * {i}\n" * 20) for i in range(n)]


def test_the_validation_split_is_by_name_whatever_the_text_or_order():
    d = docs(200)
    val = {x.name for x in d if held_out(x, 10.0)}
    assert val == {x.name for x in reversed(d) if held_out(Document(x.name, "other text"), 10.0)}
    assert 5 <= len(val) <= 40
    assert {x.name for x in d if held_out(x, 10.0, seed=1)} != val


def test_tokenizer_training_is_deterministic():
    d = docs(50)
    assert train_tokenizer(d, 300).to_str() == train_tokenizer(d, 300).to_str()


def test_a_corpus_is_prepared_into_the_cache_once_and_a_dataset_read_as_it_is(tmp_path):
    (tmp_path / "corpus").mkdir()
    for i, doc in enumerate(docs(60)):
        (tmp_path / "corpus" / f"{i}.txt").write_text(doc.text)
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"), val_percent=10)
    first = prepare_data(cfg, vocab_size=300)
    assert (
        first.store.folder.parent == tmp_path / "cache" / "datasets"
        and (first.store.folder / "index.json").exists()
    )
    written = {p: p.stat().st_mtime_ns for p in first.store.folder.rglob("*")}
    second = prepare_data(cfg, vocab_size=300)
    assert (
        second.index == first.index
        and {p: p.stat().st_mtime_ns for p in first.store.folder.rglob("*")} == written
    )
    assert first.tokenizer.get_vocab_size() <= 300
    same = prepare_data(DataConfig(dataset=str(first.store.folder), corpus="unused"), vocab_size=300)
    assert same.dataset_hash == first.dataset_hash
    other = tmp_path / "other.json"
    other.write_text(train_tokenizer(docs(5), 280).to_str())
    with pytest.raises(DataError, match="prepared with another tokenizer than"):
        prepare_data(DataConfig(dataset=str(first.store.folder), tokenizer=str(other)), vocab_size=300)
    with pytest.raises(DataError, match="not a prepared dataset"):
        prepare_data(DataConfig(dataset=str(tmp_path / "corpus")), vocab_size=300)


def test_jsonl_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "hello"}) + "\n\n" + json.dumps({"text": "world"}) + "\n")
    assert [d.text for d in documents(str(good))] == ["hello", "world"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        documents(str(bad))
    with pytest.raises(DataError, match="does not exist"):
        documents(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("   \n")
    with pytest.raises(DataError, match="has no text"):
        documents(str(tmp_path / "empty"))


def test_stdlib_corpus_excludes_site_packages():
    names = [d.name for d in documents("stdlib", max_bytes=3_000_000)]
    assert names and not any("site-packages" in n for n in names)
    assert names == sorted(names)


def test_hf_without_the_extra_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError, match=r"spes-p2p\[hf\]"):
        documents("hf:some/dataset")


def windows_of(sampler: ShardSampler, n_batches: int) -> list[int]:
    starts = []
    for _ in range(n_batches):
        inputs, _ = sampler.next_batch()
        starts.extend(inputs[:, 0].tolist())
    return starts


def dataset_of(folder, ids: np.ndarray, shard_tokens: int) -> PreparedData:
    """A dataset of these tokens in shards (token value == position: a window's first token is its start)."""
    shards = []
    for number, start in enumerate(range(0, len(ids), shard_tokens)):
        data = encode_shard(ids[start : start + shard_tokens].astype(np.uint16))
        shards.append(
            Shard(shard_name("train", number), len(ids[start : start + shard_tokens]), sha256(data))
        )
        (folder / "train").mkdir(exist_ok=True)
        (folder / shards[-1].name).write_bytes(data)
    fields = dict(source="test", tokenizer_sha256="0" * 64, vocab_size=65536, dtype="uint16", val_percent=2.0)
    val = (Shard(shard_name("val", 0), 1, "0" * 64),)  # (not read here)
    index = DatasetIndex(
        FORMAT, **fields, shard_tokens=shard_tokens, documents=1, train=tuple(shards), val=val
    )
    return PreparedData(None, ShardStore(index, folder, [], cached=False, max_bytes=0))


def sampler_of(data: PreparedData, seq_len: int, batch_size: int, seed: int = 0, plan=None) -> ShardSampler:
    plan = plan or LocalPlan(len(data.index.train), seed)
    return ShardSampler(data, seq_len, batch_size, seed, plan)


def test_an_epoch_reads_every_window_once(tmp_path):
    data = dataset_of(tmp_path, np.arange(10_001), shard_tokens=1000)  # 10 shards of 99 windows, 1 of none
    sampler = sampler_of(data, 10, 9, seed=3)
    starts = windows_of(sampler, 110)
    assert sorted(starts) == [s * 1000 + w * 10 for s in range(10) for w in range(99)]
    assert sampler.epoch == 0 and windows_of(sampler, 1) and sampler.epoch == 1
    assert starts[:99] != sorted(starts[:99])  # (shuffled)


class SharedPlan(LocalPlan):
    """Two readers taking from one plan (as peers take from the swarm's records); the second takes over
    the first's shard where it stopped."""

    def __init__(self, shards: int) -> None:
        super().__init__(shards, seed=0)
        self.given_back: list[Work] = []
        self.recorded: dict[tuple[int, int], int] = {}

    def take(self) -> Work:
        return self.given_back.pop() if self.given_back else super().take()

    def record(self, work: Work, position: int, done: bool) -> None:
        self.recorded[work[:2]] = position


def test_readers_of_one_plan_read_disjoint_windows_and_continue_each_others_shards(tmp_path):
    data = dataset_of(tmp_path, np.arange(10_001), shard_tokens=1000)
    plan = SharedPlan(11)
    a, b = sampler_of(data, 10, 5, plan=plan), sampler_of(data, 10, 5, plan=plan)
    seen_a, seen_b = windows_of(a, 30), windows_of(b, 30)
    assert not set(seen_a) & set(seen_b)
    # a stops mid-shard: its shard goes back to the plan at its recorded position, and c continues it
    stopped = a.work
    plan.given_back.append(stopped._replace(position=plan.recorded[stopped[:2]]))
    seen_c = windows_of(sampler_of(data, 10, 5, plan=plan), 30)
    assert not set(seen_c) & (set(seen_a) | set(seen_b))
    assert {s // 1000 for s in seen_c[:5]} == {stopped.shard}


def test_a_position_resumes_exactly_across_an_epoch(tmp_path):
    data = dataset_of(tmp_path, np.arange(10_001), shard_tokens=1000)
    s = sampler_of(data, 10, 7, seed=1)
    windows_of(s, 140)
    state = s.state_dict()
    expected = windows_of(s, 10)
    t = sampler_of(data, 10, 7, seed=1)
    t.load_state_dict(state)
    assert windows_of(t, 10) == expected


def test_targets_are_inputs_shifted(tmp_path):
    ids = dataset_of(tmp_path, np.arange(1000), shard_tokens=500)
    inputs, targets = sampler_of(ids, 16, 2).next_batch()
    assert inputs.shape == targets.shape == (2, 16)
    assert (targets[:, :-1] == inputs[:, 1:]).all()
