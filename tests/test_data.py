"""Data: determinism, resume by position, process sharding, file sources and their errors."""
import json

import numpy as np
import pytest

from boost_jax.data import TokenLoader, build_loaders
from boost_jax.data.tokenizer import ByteTokenizer


def loader(tokens, **kw):
    args = dict(seq_len=7, global_batch=4, seed=1, vocab_size=1000, name="t")
    args.update(kw)
    return TokenLoader([tokens], **args)


def test_batches_are_deterministic_and_resumable():
    tokens = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.uint16)
    a = loader(tokens)
    seq = [a.batch(p) for p in range(0, 40 * 4, 4)]
    b = loader(tokens)  # a "resumed" loader only needs the position
    np.testing.assert_array_equal(b.batch(20 * 4), seq[20])
    assert not np.array_equal(seq[0], seq[1])
    assert seq[0].shape == (4, 8) and seq[0].dtype == np.int32


def test_epoch_visits_every_window_once():
    tokens = np.arange(8 * 10, dtype=np.uint32)  # 10 windows of 8
    ld = loader(tokens, global_batch=5)
    seen = np.concatenate([ld.batch(0), ld.batch(5)])
    assert sorted(seen[:, 0].tolist()) == list(range(0, 80, 8))
    assert not np.array_equal(ld.batch(10), ld.batch(0))  # a new epoch is a new permutation


def test_process_shards_tile_the_global_batch():
    tokens = np.random.default_rng(1).integers(0, 1000, 5000).astype(np.uint16)
    whole = loader(tokens, global_batch=8).batch(16)
    parts = [loader(tokens, global_batch=8, process_index=i, process_count=2).batch(16) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_token_out_of_vocab_is_an_error():
    with pytest.raises(ValueError, match="vocab_size"):
        loader(np.full(100, 999, np.uint16), vocab_size=500).batch(0)


def test_too_little_data_is_an_error():
    with pytest.raises(ValueError, match="seq_len"):
        loader(np.zeros(5, np.uint16))


def test_embedded_default_split(make_config):
    tr, ev, tok = build_loaders(make_config())
    assert isinstance(tok, ByteTokenizer) and tr.n > 10 * ev.n > 0
    text = tok.decode(tr.batch(0)[0])
    assert len(text) > 0


def test_memmap_token_files(make_config, tmp_path):
    tokens = np.random.default_rng(2).integers(0, 300, 4000).astype(np.uint16)
    tokens.tofile(tmp_path / "a.bin")
    cfg = make_config(**{"data.source": "tokens", "data.path": str(tmp_path / "a.bin"), "model.vocab_size": 300})
    tr, ev, _ = build_loaders(cfg)
    assert isinstance(tr.segments[0], np.memmap)
    row = tr.batch(0)[0]
    # every window is a contiguous slice of the file
    starts = np.flatnonzero(tokens[: len(tokens) - 17] == row[0])
    assert any(np.array_equal(tokens[s:s + 17], row) for s in starts)


def test_memmap_vocab_too_small(make_config, tmp_path):
    np.full(400, 299, np.uint16).tofile(tmp_path / "a.bin")
    cfg = make_config(**{"data.source": "tokens", "data.path": str(tmp_path / "a.bin")})  # vocab 256
    with pytest.raises(ValueError, match="vocab_size"):  # checked when loading, not at the first bad batch
        build_loaders(cfg)


def test_jsonl_and_text_sources(make_config, tmp_path):
    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"document {i} " * 5}) + "\n")
    tr, _, tok = build_loaders(make_config(**{"data.source": "jsonl", "data.path": str(tmp_path / "d.jsonl")}))
    assert "document" in tok.decode(tr.batch(0).ravel())
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("hello world " * 300)
    tr, _, tok = build_loaders(make_config(**{"data.source": "text", "data.path": str(tmp_path / "txt")}))
    assert "hello" in tok.decode(tr.batch(0).ravel())


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_missing_or_empty_path(make_config, tmp_path, kind):
    path = tmp_path / "x.bin"
    if kind == "empty":
        path.touch()
    cfg = make_config(**{"data.source": "tokens", "data.path": str(path)})
    with pytest.raises((FileNotFoundError, ValueError), match="data.path"):
        build_loaders(cfg)


def _corpus(tmp_path):
    lines = [f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n" for i in range(300)]
    (tmp_path / "corpus.txt").write_text("".join(lines))
    return tmp_path / "corpus.txt", lines


def test_hf_tokenizers_json(make_config, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path, lines = _corpus(tmp_path)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tok.json"))
    cfg = make_config(**{"data.source": "text", "data.path": str(path), "data.tokenizer": str(tmp_path / "tok.json"),
                         "model.vocab_size": 300})
    tr, _, loaded = build_loaders(cfg)
    assert loaded.vocab_size <= 300 and loaded.eos_id == 1
    assert "def function_" in loaded.decode(tr.batch(0)[0])
    with pytest.raises(ValueError, match="model.vocab_size"):
        build_loaders(make_config(**{"data.source": "text", "data.path": str(path),
                                     "data.tokenizer": str(tmp_path / "tok.json"), "model.vocab_size": 100}))


def test_sentencepiece_model(make_config, tmp_path):
    spm = pytest.importorskip("sentencepiece")
    path, _ = _corpus(tmp_path)
    spm.SentencePieceTrainer.train(input=str(path), model_prefix=str(tmp_path / "sp"), vocab_size=200,
                                   model_type="bpe", minloglevel=2)
    cfg = make_config(**{"data.source": "text", "data.path": str(path), "data.tokenizer": str(tmp_path / "sp.model"),
                         "model.vocab_size": 200})
    tr, _, loaded = build_loaders(cfg)
    assert loaded.vocab_size == 200
    assert "function" in loaded.decode(tr.batch(0)[0])


def test_missing_tokenizer_file(make_config, tmp_path):
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        build_loaders(make_config(**{"data.tokenizer": str(tmp_path / "nope.json")}))
