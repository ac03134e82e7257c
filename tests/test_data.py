"""Data: determinism, resume by position, process sharding, file sources and their errors."""

import json

import numpy as np
import pytest

from boost_jax.data import TokenLoader, build_loaders
from boost_jax.data.tokenizer import ByteTokenizer
from boost_jax.validate import validate


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
    assert any(np.array_equal(tokens[s : s + 17], row) for s in starts)


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
    cfg = make_config(
        **{
            "data.source": "text",
            "data.path": str(path),
            "data.tokenizer": str(tmp_path / "tok.json"),
            "model.vocab_size": 300,
        }
    )
    tr, _, loaded = build_loaders(cfg)
    assert loaded.vocab_size <= 300 and loaded.eos_id == 1
    assert any("def function_" in loaded.decode(row) for row in tr.batch(0))
    with pytest.raises(ValueError, match="model.vocab_size"):
        build_loaders(
            make_config(
                **{
                    "data.source": "text",
                    "data.path": str(path),
                    "data.tokenizer": str(tmp_path / "tok.json"),
                    "model.vocab_size": 100,
                }
            )
        )


def test_sentencepiece_model(make_config, tmp_path):
    spm = pytest.importorskip("sentencepiece")
    path, _ = _corpus(tmp_path)
    spm.SentencePieceTrainer.train(
        input=str(path), model_prefix=str(tmp_path / "sp"), vocab_size=200, model_type="bpe", minloglevel=2
    )
    cfg = make_config(
        **{
            "data.source": "text",
            "data.path": str(path),
            "data.tokenizer": str(tmp_path / "sp.model"),
            "model.vocab_size": 200,
        }
    )
    tr, _, loaded = build_loaders(cfg)
    assert loaded.vocab_size == 200
    assert any("function" in loaded.decode(row) for row in tr.batch(0))


def test_missing_tokenizer_file(make_config, tmp_path):
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        build_loaders(make_config(**{"data.tokenizer": str(tmp_path / "nope.json")}))


# Mixtures. Source k's tokens are 100*k + (0..99), so every row tells which source it came from.
WEIGHTS = [0.55, 0.3, 0.15]


def mixture(weights=WEIGHTS, sizes=(3000, 2000, 1500), **kw):
    from boost_jax.data import MixtureLoader

    rng = np.random.default_rng(5)
    subs = [
        loader((100 * k + rng.integers(0, 100, n)).astype(np.uint16), seed=(1, k))
        for k, n in enumerate(sizes[: len(weights)])
    ]
    args = dict(seed=1, global_batch=4)
    args.update(kw)
    return MixtureLoader(subs, weights, [f"s{k}" for k in range(len(weights))], **args), subs


def test_mixture_is_deterministic_resumable_and_walks_each_source_in_order():
    from boost_jax.data.loader import MIX_BLOCK

    mix, subs = mixture()
    positions = list(range(0, 400, 4)) + [MIX_BLOCK - 2]  # the last batch straddles two blocks
    seq = [mix.batch(p) for p in positions]
    fresh, _ = mixture()  # a resumed run builds a new loader and only knows the position
    for p, b in list(zip(positions, seq))[::-7]:
        np.testing.assert_array_equal(fresh.batch(p), b)
    assert not np.array_equal(mixture(seed=2)[0].batch(0), seq[0])
    # source k's rows, in run order, are exactly source k's own stream 0, 1, 2, ...: nothing is
    # skipped or repeated, and each source keeps its own epochs and permutations
    rows = np.concatenate(seq[:-1])
    for k, sub in enumerate(subs):
        mine = rows[rows[:, 0] // 100 == k]
        np.testing.assert_array_equal(mine, sub.windows(range(len(mine))))


def test_mixture_fractions_match_weights_and_every_batch_is_mixed():
    from boost_jax.data.loader import MIX_BLOCK

    mix, _ = mixture(global_batch=16)
    n = 2 * MIX_BLOCK + 12_345  # across block boundaries and a partial block
    source = np.array([mix.sample(i)[0] for i in range(n)])
    counts = np.bincount(source, minlength=3)
    # long run: within 1/MIX_BLOCK of the weight per sample plus 2 samples of the partial block
    np.testing.assert_array_less(np.abs(counts - np.array(WEIGHTS) * n), n / MIX_BLOCK + 2)
    # and every batch of 16 holds each source's share to within 4 samples
    per_batch = np.stack([np.bincount(source[i : i + 16], minlength=3) for i in range(0, n - 16, 16)])
    assert np.abs(per_batch - 16 * np.array(WEIGHTS)).max() <= 4
    # source_tokens counts what the batches held (identified by token value), times seq_len
    rows = np.concatenate([mix.batch(p) for p in range(0, 320, 16)])
    held = np.bincount(rows[:, 0] // 100, minlength=3) * 7
    assert mix.source_tokens(320) == {f"tokens/s{k}": int(held[k]) for k in range(3)}


def test_mixture_process_shards_tile_the_global_batch():
    whole = mixture(global_batch=8)[0].batch(24)
    parts = [mixture(global_batch=8, process_index=i, process_count=2)[0].batch(24) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def _token_files(tmp_path, sizes=(6000, 3000)):
    rng = np.random.default_rng(7)
    paths = []
    for k, n in enumerate(sizes):
        paths.append(tmp_path / f"src{k}.bin")
        (100 * k + rng.integers(0, 100, n)).astype(np.uint16).tofile(paths[-1])
    return paths


def test_mixture_resumes_through_the_trainer_with_per_source_counts(make_config, tmp_path, monkeypatch):
    from boost_jax import train
    from boost_jax.data import MixtureLoader

    a, b = _token_files(tmp_path)
    seen: list[tuple[int, np.ndarray]] = []  # the train batches (the eval loader does not shuffle)
    original = MixtureLoader.batch

    def recording(self, position):
        out = original(self, position)
        if self.loaders[0].shuffle:
            seen.append((position, out))
        return out

    monkeypatch.setattr(MixtureLoader, "batch", recording)
    data = {"data.source": "tokens", "data.path": f"{a}:0.7,{b}:0.3", "train.log_every": 1}
    train.run(make_config(**data, run_dir=str(tmp_path / "straight")))
    straight, seen[:] = dict(seen), []
    split = make_config(**data, run_dir=str(tmp_path / "split"), **{"train.stop_at_step": 3})
    assert train.run(split)["step"] == 3
    split.train.stop_at_step = 0
    assert train.run(split)["step"] == 8
    resumed = dict(seen)
    assert sorted(straight) == sorted(resumed) == list(range(0, 64, 8))
    for p in straight:
        np.testing.assert_array_equal(straight[p], resumed[p])
    rows = [json.loads(line) for line in open(tmp_path / "split" / "metrics.jsonl")]
    logged = {r["step"]: (r["tokens/src0"], r["tokens/src1"]) for r in rows if "loss" in r}
    assert sorted(logged) == list(range(1, 9))
    for step, counts in logged.items():
        batches = np.concatenate([straight[p] for p in range(0, 8 * step, 8)])
        assert counts == tuple(int((batches[:, 0] // 100 == k).sum()) * 16 for k in range(2))
    assert logged[8][0] + logged[8][1] == 8 * 8 * 16 and logged[8][0] > logged[8][1]


@pytest.mark.parametrize(
    "spec,match",
    [
        ("{a}:0.7,{missing}:0.3", "data.path.*nothing found"),
        ("{a}:0.7,{b}:0", "data.path.*weights must be positive"),
        ("{a}:-1", "data.path.*weights must be positive"),
        ("{a},,{b}", "data.path.*empty source"),
        ("{a}:1,{a}:2", "data.path.*twice"),
    ],
)
def test_bad_mixture_specs(make_config, tmp_path, spec, match):
    a, b = _token_files(tmp_path)
    path = spec.format(a=a, b=b, missing=tmp_path / "nope.bin")
    cfg = make_config(**{"data.source": "tokens", "data.path": path})
    with pytest.raises((FileNotFoundError, ValueError), match=match) as err:
        build_loaders(validate(cfg))
    assert "\n" not in str(err.value)


def test_mixture_of_differently_tokenised_sources(make_config, tmp_path):
    from boost_jax.data.prepare import prepare

    (tmp_path / "t.txt").write_text("some text to tokenise\n" * 200)
    prepare([str(tmp_path / "t.txt")], tmp_path / "p16", "byte", dtype="uint16", progress=False)
    prepare([str(tmp_path / "t.txt")], tmp_path / "p32", "byte", dtype="uint32", progress=False)
    cfg = make_config(**{"data.source": "tokens", "data.path": f"{tmp_path / 'p16'}:1,{tmp_path / 'p32'}:1"})
    with pytest.raises(ValueError, match=r"data.path.*tokenised differently.*uint16.*uint32"):
        build_loaders(cfg)
