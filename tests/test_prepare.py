"""spes data prepare: a corpus into fixed-size token shards and an index; every token accounted for, the
validation documents held out by name, an interrupted preparation resumed to the same bytes, and every
shard checked before it is used."""

import hashlib
import json
import random
import threading

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save

from spes_p2p.data import prepare as prep
from spes_p2p.data.corpus import EOS, held_out, iter_documents
from spes_p2p.data.prepare import prepare
from spes_p2p.data.recipe import Recipe
from spes_p2p.data.shards import DatasetIndex, decode_shard, read_shard
from spes_p2p.data.tokenizer import load_tokenizer
from spes_p2p.errors import DataError

WORDS = "the of swarm expert peer round token shard update holder weights loss data model train".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of 150 documents in .txt, .md, .py and .jsonl files."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))

    for i in range(40):
        (root / f"doc{i:02d}{('.txt', '.md', '.py')[i % 3]}").write_text(text())
    (root / "more").mkdir()
    for i in range(11):
        lines = [json.dumps({"text": text()}) for _ in range(10)]
        (root / "more" / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    return root


RECIPE = dict(vocab_size=300, shard_tokens=1000, val_percent=10.0)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "ds"
    return out, prepare(Recipe(str(corpus), **RECIPE), out)


def test_every_token_of_every_document_is_in_a_shard_of_its_split(corpus, prepared):
    out, index = prepared
    tok = load_tokenizer(out / "tokenizer.json", 300)
    eos = tok.token_to_id(EOS)
    docs = list(iter_documents(str(corpus)))
    assert index.documents == len(docs) == 150
    for split in ("train", "val"):
        chosen = [d for d in docs if held_out(d, 10.0) == (split == "val")]
        expected = [t for d in chosen for t in [*tok.encode(d.text).ids, eos]]
        shards = getattr(index, split)
        tokens = np.concatenate([read_shard(out, s, index) for s in shards])
        assert tokens.tolist() == expected
        assert [s.tokens for s in shards[:-1]] == [1000] * (len(shards) - 1) and shards[-1].tokens <= 1000
        for s in shards:
            assert hashlib.sha256((out / s.name).read_bytes()).hexdigest() == s.sha256
    assert len(index.train) >= 10 and len(index.val) >= 1
    assert index.tokenizer_sha256 == hashlib.sha256(tok.to_str().encode()).hexdigest()
    assert index.dtype == "uint16" and index.vocab_size == tok.get_vocab_size() <= 300
    assert (
        DatasetIndex.read(out).digest
        == index.digest
        == hashlib.sha256((out / "index.json").read_bytes()).hexdigest()
    )
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "tokenizer.json", "train", "val"]


def test_an_interrupted_preparation_resumes_to_the_same_bytes(corpus, prepared, tmp_path, monkeypatch):
    _, whole = prepared
    monkeypatch.setattr(prep, "BATCH_DOCUMENTS", 7)  # checkpoints along the way
    seen = []

    def interrupt(progress):
        seen.append(progress)
        if progress.shards >= 5:
            raise KeyboardInterrupt

    out = tmp_path / "ds"
    with pytest.raises(KeyboardInterrupt):
        prepare(Recipe(str(corpus), **RECIPE), out, interrupt)
    assert (out / ".prepare.json").exists() and not (out / "index.json").exists()
    assert len(list(out.glob(".pending-*"))) == 1
    resumed = []
    index = prepare(Recipe(str(corpus), **RECIPE), out, resumed.append)
    assert resumed[0].documents > 7  # it went on from where it was, not from the start
    assert index.digest == whole.digest
    assert index == whole
    assert not list(out.glob(".p*"))


def test_a_complete_dataset_is_returned_as_it_is(corpus, prepared):
    out, index = prepared
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert prepare(Recipe(str(corpus), **RECIPE), out) == index
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_another_recipe_or_a_foreign_folder_is_refused_and_nothing_is_lost(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "BATCH_DOCUMENTS", 7)
    out = tmp_path / "ds"

    def stop(progress):
        if progress.shards:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(Recipe(str(corpus), **RECIPE), out, stop)
    files = sorted(out.rglob("*"))
    with pytest.raises(DataError, match="shard_tokens 1000; resume it with the same settings"):
        prepare(Recipe(str(corpus), **{**RECIPE, "shard_tokens": 2000}), out)
    assert sorted(out.rglob("*")) == files
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(DataError, match="not empty and holds no preparation"):
        prepare(Recipe(str(corpus), **RECIPE), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_corpus_with_no_validation_document_is_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "only.txt").write_text("one document only " * 50)
    with pytest.raises(DataError, match="none fell in the validation split; use a larger corpus or a larger"):
        prepare(Recipe(str(tmp_path / "c"), vocab_size=300, shard_tokens=100), tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_a_given_tokenizer_is_used_and_one_too_large_refused(corpus, prepared, tmp_path):
    out, index = prepared
    again = prepare(Recipe(str(corpus), tokenizer=str(out / "tokenizer.json"), **RECIPE), tmp_path / "ds")
    assert again.tokenizer_sha256 == index.tokenizer_sha256 and again.train == index.train
    with pytest.raises(Exception, match=r"has .* tokens but the model's vocab_size is 260"):
        prepare(
            Recipe(str(corpus), tokenizer=str(out / "tokenizer.json"), **{**RECIPE, "vocab_size": 260}),
            tmp_path / "x",
        )


def test_parquet_rows_are_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["first row", "", None, "fourth row"]}), tmp_path / "t.parquet")
    docs = list(iter_documents(str(tmp_path / "t.parquet")))
    assert [(d.name, d.text) for d in docs] == [("t.parquet#0", "first row"), ("t.parquet#3", "fourth row")]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "u.parquet")
    with pytest.raises(DataError, match='no "text" column'):
        list(iter_documents(str(tmp_path / "u.parquet")))


def test_a_shard_is_checked_before_its_tokens_are_used(prepared):
    out, index = prepared
    shard = index.train[0]
    good = (out / shard.name).read_bytes()
    assert decode_shard(good, shard, index).tolist()[:3]
    with pytest.raises(DataError, match="SHA-256"):
        decode_shard(good[:-2] + b"\0\0", shard, index)

    def forged(tensors, **changes):  # bytes whose hash the index lists: only the schema can refuse them
        data = save(tensors)
        return data, shard.__class__(
            shard.name, changes.get("tokens", shard.tokens), hashlib.sha256(data).hexdigest()
        )

    for tensors, match in [
        ({"tokens": np.zeros(shard.tokens, np.int64)}, "1-D uint16"),
        ({"tokens": np.zeros(shard.tokens, np.uint16), "x": np.zeros(1, np.uint16)}, "1-D uint16"),
        ({"tokens": np.zeros((2, 500), np.uint16)}, "1-D uint16"),
        ({"tokens": np.zeros(shard.tokens - 1, np.uint16)}, "tokens or a token id past"),
        ({"tokens": np.full(shard.tokens, 65535, np.uint16)}, "tokens or a token id past"),
    ]:
        data, listed = forged(tensors)
        with pytest.raises(DataError, match=match):
            decode_shard(data, listed, index)
    junk = b"\xff" * 64
    listed = shard.__class__(shard.name, shard.tokens, hashlib.sha256(junk).hexdigest())
    with pytest.raises(DataError, match="not a safetensors file"):
        decode_shard(junk, listed, index)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.update(format="other/1"), "format"),
        (lambda d: d.update(extra=1), "unknown field"),
        (lambda d: d["train"][0].update(sha256="00"), "sha256"),
        (lambda d: d["train"][0].update(name="../../etc/passwd"), "name"),
        (lambda d: d["train"].reverse(), "in order"),
        (lambda d: d["train"][0].update(tokens=999), "but the last"),
        (lambda d: d.update(val=[]), "val"),
    ],
)
def test_a_malformed_index_is_one_line(prepared, change, match):
    out, _ = prepared
    raw = json.loads((out / "index.json").read_bytes())
    change(raw)
    with pytest.raises(DataError, match=match):
        DatasetIndex.decode(json.dumps(raw).encode(), "index.json")


def test_the_command_prepares_and_names_a_bad_source(corpus, tmp_path):
    from spes_cli.main import spes

    args = ["data", "prepare", str(corpus), "--out", str(tmp_path / "ds"), "--vocab-size", "300"]
    result = CliRunner().invoke(spes, [*args, "--shard-tokens", "1024"])
    assert result.exit_code == 0, result.output
    index = DatasetIndex.read(tmp_path / "ds")
    assert f"dataset {index.digest}" in result.output and "training tokens in" in result.output
    limited = [*args[:4], str(tmp_path / "part"), "--vocab-size", "300", "--shard-tokens", "1024"]
    assert CliRunner().invoke(spes, [*limited, "--max-corpus-mb", "0.02"]).exit_code == 0
    assert 0 < DatasetIndex.read(tmp_path / "part").documents < index.documents
    bad = CliRunner().invoke(spes, ["data", "prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "x")])
    assert bad.exit_code == 1 and "does not exist" in bad.output and "Traceback" not in bad.output


def test_processes_that_ask_for_a_cached_corpus_at_once_prepare_it_once(corpus, tmp_path, monkeypatch):
    trained = []
    train = prep.train_tokenizer
    monkeypatch.setattr(prep, "train_tokenizer", lambda *a: trained.append(1) or train(*a))
    recipe = Recipe(str(corpus), **RECIPE)
    stale = prep.prepare_cached(Recipe(str(corpus), **{**RECIPE, "shard_tokens": 999}), tmp_path)
    (stale / "index.json").unlink()  # a preparation that died before its first shard left files, no state
    (stale / ".prepare.json").unlink(missing_ok=True)
    folders = []
    threads = [
        threading.Thread(target=lambda: folders.append(prep.prepare_cached(recipe, tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert (
        len(folders) == 3 and len(set(folders)) == 1 and len(trained) == 2
    )  # (the stale one's, and this one)
    assert DatasetIndex.read(folders[0]).train == prepare(recipe, tmp_path / "direct").train
    again = prep.prepare_cached(Recipe(str(corpus), **{**RECIPE, "shard_tokens": 999}), tmp_path)
    assert again == stale and DatasetIndex.read(again).shard_tokens == 999 and len(trained) == 4
