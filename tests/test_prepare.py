"""`python -m boost_jax.data.prepare`: shards equal in-process tokenisation (EOS per document, input
order, units cut inside files), an interrupted run resumes keeping its finished shards, and the
`tokens` source refuses shards that do not match the run (dtype, vocabulary, tokenizer)."""
import gzip
import json
import os

import numpy as np
import pytest

from boost_jax.data import build_loaders
from boost_jax.data import prepare as prep
from boost_jax.data.tokenizer import load_tokenizer


def _documents(rng, n):
    words = ["alpha", "beta", "naïve", "über", "训练", "data", "token", "é", "\\n", "the", "of"]
    return [" ".join(rng.choice(words) for _ in range(rng.integers(1, 80))) + ("\n" if i % 7 == 0 else "")
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL file (with blank lines and extra fields), a gzipped JSONL, two text files; the texts in order."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs = _documents(rng, 300)
    with open(root / "a.jsonl", "w") as f:
        for i, d in enumerate(docs[:200]):
            f.write(json.dumps({"id": i, "text": d}) + "\n" + ("\n" if i % 50 == 0 else ""))
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        for d in docs[200:]:
            f.write(json.dumps({"text": d}) + "\n")
    texts = ["first file\n" + "\n".join(docs[:40]), "second file, no newline at the end: " + docs[41]]
    (root / "c.txt").write_text(texts[0])
    (root / "d.txt").write_text(texts[1])
    return root, docs + texts


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, corpus):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(corpus[1], tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    tok.save(str(path))
    return str(path)


def reference(texts, spec):
    """In-process tokenisation: each document's ids, then EOS (when the tokenizer has one)."""
    tok = load_tokenizer(spec)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    return np.array([i for t in texts for i in list(tok.encode(t)) + eos], np.int64)


def stream(out):
    index = json.loads((out / "index.json").read_text())
    return np.concatenate([np.fromfile(out / s["file"], index["dtype"]) for s in index["shards"]]).astype(np.int64)


def inputs(root):
    return [str(root / n) for n in ("a.jsonl", "b.jsonl.gz", "c.txt", "d.txt")]


@pytest.mark.parametrize("tokenizer, workers", [("byte", 0), ("bpe", 2)])
def test_shards_equal_in_process_tokenisation(corpus, bpe, tmp_path, tokenizer, workers):
    root, texts = corpus
    spec = bpe if tokenizer == "bpe" else "byte"
    # 3 kB units cut a.jsonl and c.txt into several shards each, at arbitrary byte offsets.
    index = prep.prepare(inputs(root), tmp_path / "out", spec, workers=workers, unit_bytes=3000, progress=False)
    assert len(index["shards"]) > 8 and index["dtype"] == "uint16"
    np.testing.assert_array_equal(stream(tmp_path / "out"), reference(texts, spec))
    assert index["documents"] == len(texts) and index["tokens"] == len(reference(texts, spec))
    assert index["vocab_size"] == load_tokenizer(spec).vocab_size
    if tokenizer == "bpe":
        assert index["eos_id"] == 1 and (stream(tmp_path / "out") == 1).sum() == len(texts)


def test_resume_after_an_interrupted_run(corpus, tmp_path, monkeypatch):
    root, texts = corpus
    out = tmp_path / "out"
    real = prep.run_unit

    def interrupted(i, *args, **kw):
        if i == 3:
            (out / f"shard_{i:05d}.bin.tmp").write_bytes(b"partial")  # killed while writing this shard
            raise KeyboardInterrupt
        return real(i, *args, **kw)

    monkeypatch.setattr(prep, "run_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(inputs(root), out, unit_bytes=3000, progress=False)
    assert sorted(p.name for p in out.glob("shard_*.json")) == [f"shard_0000{i}.json" for i in range(3)]
    with pytest.raises(ValueError, match="unfinished"):  # the tokens source does not read a half-made dir
        build_loaders(_tokens_config(out, tmp_path))
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_0000[0-2].*")}

    monkeypatch.setattr(prep, "run_unit", real)
    prep.prepare(inputs(root), out, unit_bytes=3000, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard_0000[0-2].*")} == kept  # finished shards kept
    assert not list(out.glob("*.tmp"))
    np.testing.assert_array_equal(stream(out), reference(texts, "byte"))

    # Another tokenizer, field or input set in the same directory is refused, not mixed in.
    with pytest.raises(prep.PrepareError, match="choose a new --out"):
        prep.prepare(inputs(root)[:2], out, unit_bytes=3000, progress=False)


def _tokens_config(out, tmp_path, **overrides):
    from conftest import small_config
    return small_config(tmp_path / "run", **{"data.source": "tokens", "data.path": str(out), **overrides})


def test_tokens_source_reads_and_checks_the_index(corpus, bpe, tmp_path):
    root, texts = corpus
    out = tmp_path / "out"
    prep.prepare(inputs(root), out, bpe, unit_bytes=3000, progress=False)
    want = reference(texts, bpe)
    train, held, tok = build_loaders(_tokens_config(out, tmp_path, **{"data.tokenizer": bpe, "model.vocab_size": 400}))
    assert 300 < tok.vocab_size <= 400 and all(isinstance(s, np.memmap) for s in train.segments)
    row = train.batch(0)[0]  # a window of the token stream
    assert any(np.array_equal(want[s:s + len(row)], row) for s in np.flatnonzero(want == row[0]))
    # The index itself also works as data.path.
    assert build_loaders(_tokens_config(out / "index.json", tmp_path, **{"data.tokenizer": bpe,
                                                                        "model.vocab_size": 400}))[0].n == train.n

    for overrides, field in [({"data.token_dtype": "uint32"}, "data.token_dtype"),
                             ({"model.vocab_size": 300}, "model.vocab_size"),
                             ({"data.tokenizer": "byte"}, "data.tokenizer")]:
        cfg = _tokens_config(out, tmp_path, **{"data.tokenizer": bpe, "model.vocab_size": 400, **overrides})
        with pytest.raises(ValueError, match=f"config field `{field}`"):
            build_loaders(cfg)

    (out / "shard_00002.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="shard_00002.bin: 2 bytes"):
        build_loaders(_tokens_config(out, tmp_path, **{"data.tokenizer": bpe, "model.vocab_size": 400}))


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    assert prep.main([str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o"), "--workers", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert err == (f"error: {tmp_path / 'bad.jsonl'}:2: no field 'text' (its fields: ['body']); "
                   "set data.jsonl_field (prepare: --field)")
    assert prep.main([str(tmp_path / "none*.jsonl"), "--out", str(tmp_path / "o")]) == 1
    assert "inputs: nothing found" in capsys.readouterr().err
    assert prep.main([str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o2"), "--dtype", "uint16",
                      "--tokenizer", str(tmp_path / "missing.json")]) == 1
    assert "data.tokenizer" in capsys.readouterr().err


def test_zst_and_parquet_inputs(corpus, tmp_path, capsys):
    root, texts = corpus
    docs = texts[:200]
    for name, fmt in (("z.jsonl.zst", "zstandard"), ("p.parquet", "pyarrow")):
        try:
            __import__(fmt)
        except ImportError:  # without the library the input is refused in one line
            (tmp_path / name).write_bytes(b"x")
            assert prep.main([str(tmp_path / name), "--out", str(tmp_path / f"o_{fmt}"), "--workers", "0"]) == 1
            assert f"pip install {fmt}" in capsys.readouterr().err
            continue
        if fmt == "zstandard":
            import zstandard
            lines = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
            (tmp_path / name).write_bytes(zstandard.ZstdCompressor().compress(lines))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.table({"text": docs}), tmp_path / name, row_group_size=64)
        prep.prepare([str(tmp_path / name)], tmp_path / f"o_{fmt}", progress=False)
        np.testing.assert_array_equal(stream(tmp_path / f"o_{fmt}"), reference(docs, "byte"))


def test_text_sources_tokenise_once_into_a_cache(corpus, bpe, tmp_path):
    from conftest import small_config
    root, texts = corpus
    cfg = small_config(tmp_path / "run", **{"data.source": "jsonl", "data.path": str(root / "a.jsonl"),
                                            "data.tokenizer": bpe, "model.vocab_size": 400})
    first = build_loaders(cfg)[0]
    cache = list((tmp_path / "run" / "token_cache").glob("*/index.json"))
    assert len(cache) == 1 and json.loads(cache[0].read_text())["documents"] == 200
    stamp = cache[0].stat().st_mtime_ns
    again = build_loaders(cfg)[0]  # a restart memory-maps the cache instead of tokenising again
    assert cache[0].stat().st_mtime_ns == stamp and isinstance(again.segments[0], np.memmap)
    np.testing.assert_array_equal(again.batch(3), first.batch(3))
    held = np.concatenate([np.asarray(s) for s in first.segments]).astype(np.int64)
    want = reference(texts[:200], bpe)
    np.testing.assert_array_equal(held, want[:len(held)])  # the training part: the stream's head

    os.utime(root / "a.jsonl")  # a changed input gets a new cache entry
    build_loaders(cfg)
    assert len(list((tmp_path / "run" / "token_cache").glob("*/index.json"))) == 2
