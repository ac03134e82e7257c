"""Training on documents (data.batching = packed | document): the loaders' rows against brute-force
references, prepare's document index, and the model: a packed row gives the logits, loss and
gradients of running each of its documents alone (one device, and btp / megatron on 8 devices)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_parallel import assert_close_tree, loss_and_grads, par_config

from boost_jax.data import DocumentLoader, PackedLoader, TokenLoader, build_loaders
from boost_jax.data.loader import count_packed_rows, pack_rows
from boost_jax.data.prepare import prepare
from boost_jax.errors import ConfigError
from boost_jax.model.attention import Documents
from boost_jax.runtime.build import build
from boost_jax.validate import validate


def _corpus(rng, n_docs, max_len, segments=2, vocab=50):
    """Random documents split over `segments` token arrays, with their end offsets."""
    lengths = rng.integers(1, max_len, n_docs)
    docs = [rng.integers(0, vocab, n).astype(np.uint16) for n in lengths]
    cut = np.array_split(np.arange(n_docs), segments)
    arrays = [np.concatenate([docs[i] for i in part]) for part in cut]
    ends = [np.cumsum([len(docs[i]) for i in part]).astype(np.int64) for part in cut]
    return docs, arrays, ends


LOADER = dict(global_batch=4, seed=3, vocab_size=64)


@pytest.mark.parametrize("seq_len", [4, 16, 37])
def test_packing_counts_match_the_greedy_packer(seq_len):
    rng = np.random.default_rng(seq_len)
    lengths = rng.integers(0, 3 * seq_len, (50, 9))
    lengths[::7] = 0  # empty documents (and whole empty blocks)
    got = count_packed_rows(lengths, seq_len)
    want = [len(pack_rows(row, seq_len)) for row in lengths]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seq_len", [5, 16])
def test_packed_rows_hold_every_document_once(seq_len):
    rng = np.random.default_rng(seq_len)
    docs, arrays, ends = _corpus(rng, 300, 3 * seq_len)
    loader = PackedLoader(arrays, ends, seq_len=seq_len, name="t", block=16, **LOADER)
    rows = loader.samples(range(loader.n))  # one epoch
    tokens, seg, pos = rows["tokens"], rows["segments"], rows["positions"]
    assert (seg[:, -1] == 0).all()  # the last column is padding: targets stay inside documents
    pieces = []
    for r in range(loader.n):
        for k in range(1, seg[r].max() + 1):
            at = np.flatnonzero(seg[r] == k)
            assert (np.diff(at) == 1).all() and (pos[r, at] == np.arange(len(at))).all()
            pieces.append(tuple(tokens[r, at]))
        assert (seg[r, : np.count_nonzero(seg[r])] > 0).all()  # padding only at the end
    # Every document is its pieces of seq_len tokens (and the rest), each exactly once per epoch.
    want = sorted(tuple(d[i : i + seq_len]) for d in docs for i in range(0, len(d), seq_len))
    assert sorted(pieces) == want
    pad = 1 - (seg[:, :-1] > 0).mean()
    assert pad < 0.08, pad  # first fit over 16 open rows (next fit alone: ~0.2)


def test_document_rows_are_prefixes_and_resume_exactly():
    rng = np.random.default_rng(0)
    docs, arrays, ends = _corpus(rng, 100, 40)
    loader = DocumentLoader(arrays, ends, seq_len=16, name="t", **LOADER)
    assert loader.n == 100
    rows = loader.samples(range(100))
    seen = set()
    for tok, n in zip(rows["tokens"], rows["lengths"]):
        assert (tok[n:] == 0).all()
        match = [i for i, d in enumerate(docs) if len(d[:16]) == n and (d[:16] == tok[:n]).all()]
        assert match
        seen.add(match[0])
    assert len(seen) > 90  # a permutation of the documents (a few random ones may coincide)
    again = DocumentLoader(arrays, ends, seq_len=16, name="t", **LOADER)
    for position in (0, 37, 100, 213):  # any position, epoch boundaries included
        a, b = loader.batch(position), again.batch(position)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(loader.batch(0)["tokens"], loader.batch(100)["tokens"])  # a new epoch's order


def _cola_row(doc, seq_len, eos):
    """CoLA's row of one tokenised document (its ids then EOS, as prepare stores it): the T5 call
    `tokenizer(text, max_length=seq_len, truncation=True)` keeps all of a document that fits and
    otherwise its first seq_len-1 ids, then `</s>`."""
    ids = list(doc[:-1]) if eos is not None else list(doc)
    if len(ids) + (eos is not None) > seq_len:
        ids = ids[: seq_len - (eos is not None)]
    return np.array(ids + ([eos] if eos is not None else []), np.int64)


@pytest.mark.parametrize("eos", [1, None])
def test_document_rows_are_colas_truncation(eos):
    """Fresh random documents ending with EOS (as prepare writes them), rows against CoLA's rule
    re-implemented on the ids: truncated ones keep seq_len-1 ids and their EOS, the rest are whole."""
    rng_seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh inputs each run, named on failure
    rng = np.random.default_rng(rng_seed)
    seq_len = 16
    lengths = rng.integers(1, 3 * seq_len, 60)
    docs = [np.append(rng.integers(2, 60, n), [eos] if eos is not None else []).astype(np.uint16) for n in lengths]
    cut = np.array_split(np.arange(len(docs)), 2)
    arrays = [np.concatenate([docs[i] for i in part]) for part in cut]
    ends = [np.cumsum([len(docs[i]) for i in part]).astype(np.int64) for part in cut]
    loader = DocumentLoader(arrays, ends, seq_len=seq_len, name="t", eos_id=eos, shuffle=False, **LOADER)
    rows = loader.samples(range(len(docs)))
    truncated = 0
    for j, (tok, n) in enumerate(zip(rows["tokens"], rows["lengths"])):
        want = _cola_row(docs[j], seq_len, eos)
        np.testing.assert_array_equal(tok[:n], want, err_msg=f"document {j} (seed {rng_seed})")
        assert (tok[n:] == 0).all()
        truncated += len(docs[j]) > seq_len
    assert truncated > 10  # the rule was exercised
    if eos is not None:  # a document that does not end with EOS keeps its first seq_len ids
        plain = DocumentLoader(
            [arrays[0][:-1]],
            [np.append(ends[0][:-1], len(arrays[0]) - 1)],
            seq_len=seq_len,
            name="t",
            eos_id=eos,
            shuffle=False,
            **LOADER,
        )
        last = plain.samples([plain.n - 1])
        doc = docs[cut[0][-1]][:-1]
        np.testing.assert_array_equal(last["tokens"][0, : last["lengths"][0]], doc[:seq_len])


def test_prepared_documents_keep_their_eos_when_truncated(tmp_path):
    """Through prepare and build_loaders with a tokenizer that has `</s>`: a long document's row ends
    with it, as CoLA's rows do."""
    tokenizers = pytest.importorskip("tokenizers")
    texts = [" ".join(f"word{(i * 7 + k) % 50}" for k in range(3 + 9 * i)) for i in range(30)]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel(
            {**{f"word{k}": k + 2 for k in range(50)}, "<unk>": 0, "</s>": 1}, unk_token="<unk>"
        )
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare([str(tmp_path / "d.jsonl")], tmp_path / "out", str(tmp_path / "tok.json"), progress=False)
    c = _config(tmp_path, "document", source="tokens", path=str(tmp_path / "out"), tokenizer=str(tmp_path / "tok.json"))
    c.data.eval_fraction = 0.2
    c.model.vocab_size = 64
    train, held, _ = build_loaders(c)
    t = c.train.seq_len
    got = sorted(
        tuple(r[:n].tolist()) for loader in (train, held) for r, n in zip(*loader.samples(range(loader.n)).values())
    )
    want = sorted(tuple(_cola_row(np.array(tok.encode(x).ids + [1]), t, 1).tolist()) for x in texts)
    assert got == want and sum(len(r) == t and r[-1] == 1 for r in got) > 5


def test_stream_with_numpy_order_is_the_old_permutation():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 60, 5000).astype(np.uint16)
    loader = TokenLoader([tokens], seq_len=15, name="t", order="numpy", **LOADER)
    n = 5000 // 16
    for i in (0, 5, n - 1, n, 3 * n + 2):
        epoch, j = divmod(i, n)
        w = int(np.random.default_rng([3, epoch]).permutation(n)[j])
        np.testing.assert_array_equal(loader.windows([i])[0], tokens[w * 16 : (w + 1) * 16])


def test_prepare_records_document_boundaries(tmp_path):
    texts = [f"document {i} " + "x" * (i * 7 % 23) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    index = prepare([str(tmp_path / "d.jsonl")], tmp_path / "out", "byte", unit_bytes=300, progress=False)
    assert index["documents"] == 40 and len(index["shards"]) > 1
    c = _config(tmp_path, "document", source="tokens", path=str(tmp_path / "out"))
    c.data.eval_fraction = 0.2
    train, held, _ = build_loaders(c)
    got = sorted(
        bytes(r[:n].astype(np.uint8)).decode()
        for loader in (train, held)
        for r, n in zip(*loader.samples(range(loader.n)).values())
    )
    assert got == sorted(t[: c.train.seq_len] for t in texts)  # every document, whole, once; none split


def _config(tmp_path, batching, **data):
    from conftest import small_config

    c = small_config(tmp_path / "run")
    c.data.batching = batching
    for k, v in data.items():
        c.data[k] = v
    return c


def test_bad_input_names_the_field(tmp_path):
    tokens = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(tokens)
    c = _config(tmp_path, "packed", source="tokens", path=str(tokens))
    c.model.vocab_size = 1024
    with pytest.raises(ValueError, match="data.batching"):
        build_loaders(c)
    c = _config(tmp_path, "document")
    c.train.seq_len = 1
    with pytest.raises(ConfigError, match="train.seq_len"):
        validate(c)
    c = _config(tmp_path, "packed")
    c.model.attention = "cudnn"  # takes one document per row (lengths) only
    with pytest.raises(ConfigError, match="model.attention"):
        validate(c)


# ------------------------------------------------------------------------------------------ model


def _packed(rng, layouts, t, vocab):
    """A packed batch (rows of the given document lengths) and the documents."""
    b = len(layouts)
    tokens, seg, pos = (np.zeros((b, t + 1), np.int32) for _ in range(3))
    docs = []
    for r, lengths in enumerate(layouts):
        at = 0
        for k, n in enumerate(lengths):
            doc = rng.integers(0, vocab, n).astype(np.int32)
            tokens[r, at : at + n], seg[r, at : at + n], pos[r, at : at + n] = doc, k + 1, np.arange(n)
            docs.append((r, at, doc))
            at += n
    return {"tokens": tokens, "segments": seg, "positions": pos}, docs


LAYOUTS = [[5, 9, 2], [16], [3, 3, 3, 4], [7, 8]]  # each fits 16 inputs (the last column is padding)
# The same kinds of rows from four document lengths: the references below compile once per length.
DOC_LAYOUTS = [[5, 9, 2], [16], [2, 5, 5], [9, 5]]
MORE_ROWS = [[16], [5, 5, 5], [1, 9, 5], [9]]  # 8 rows: every pipeline micro-batch holds some


def _by_length(docs) -> dict:
    """{length: [documents of that length]}: documents of one length run alone side by side, as the
    rows of one stream batch (rows never see each other)."""
    out: dict = {}
    for _, _, doc in docs:
        out.setdefault(len(doc), []).append(doc)
    return out


def _alone(cfg, params, docs):
    """Loss sum and gradients of every document run alone (stream rows of its own length)."""
    single = cfg.copy_and_resolve_references()
    single.parallel.update(
        pipeline=1, data=1, fsdp=1, tensor=1, num_devices=1, pipeline_schedule="gpipe", pipeline_repeats=1
    )
    total, grads = 0.0, None
    for n, same in _by_length(docs).items():
        if n < 2:
            continue
        single.train.seq_len = n - 1
        single.data.batching = "stream"
        loss, g = loss_and_grads(single, params, np.stack(same))
        scale = len(same) * (n - 1)  # the stream loss is a mean over its targets; the packed one a sum
        total += loss * scale
        g = jax.tree.map(lambda x: x * scale, g)
        grads = g if grads is None else jax.tree.map(np.add, grads, g)
    return total, grads


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "chunked", "pallas"])
def test_packed_row_equals_documents_alone(make_config, impl):
    cfg = make_config(
        **{"model.attention": impl, "data.batching": "packed", "model.vocab_size": 256, "parallel.num_devices": 1}
    )
    cfg.model.loss_chunk = 8  # the chunked loss with a mask
    built = build(cfg.copy_and_resolve_references())
    params = jax.device_get(built.init_state()["params"])
    rng = np.random.default_rng(7)
    batch, docs = _packed(rng, DOC_LAYOUTS, cfg.train.seq_len, 256)
    loss, grads = loss_and_grads(cfg, params, batch)
    want_loss, want_grads = _alone(cfg, params, docs)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert_close_tree(grads, want_grads, 1e-4)
    # Logits of every document's positions as when it runs alone.
    model = nnx.merge(built.spec.graphdef, params)
    t = cfg.train.seq_len
    logits, _ = built.bind(
        lambda: model(
            jnp.asarray(batch["tokens"][:, :t]),
            jnp.asarray(batch["positions"][:, :t]),
            docs=Documents.packed(jnp.asarray(batch["segments"][:, :t])),
        )
    )()
    alone = {n: built.bind(lambda: model(jnp.asarray(np.stack(same))))()[0] for n, same in _by_length(docs).items()}
    seen = {n: 0 for n in alone}
    for r, at, doc in docs:
        row, seen[len(doc)] = seen[len(doc)], seen[len(doc)] + 1
        n = min(len(doc), t - at)
        np.testing.assert_allclose(logits[r, at : at + n], alone[len(doc)][row, :n], rtol=1e-4, atol=1e-5)


PIPE = {"parallel.pipeline": 2, "model.n_layers": 4}
CIRCULAR = {**PIPE, "parallel.pipeline_schedule": "circular", "parallel.pipeline_repeats": 2}


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "strategy,mesh,extra",
    [
        ("btp", (1, 1, 8), {}),
        pytest.param("megatron", (2, 1, 4), {}, marks=SLOW),
        pytest.param("btp", (2, 2, 2), {}, marks=SLOW),
        ("btp", (1, 2, 2), PIPE),
        pytest.param("megatron", (2, 1, 2), PIPE, marks=SLOW),
        pytest.param("btp", (1, 2, 2), CIRCULAR, marks=SLOW),
    ],
    ids=[
        "btp_1x1x8",
        "megatron_2x1x4",
        "btp_2x2x2",
        "btp_pipeline2_1x2x2",
        "megatron_pipeline2_2x1x2",
        "btp_circular2_1x2x2",
    ],
)
def test_packed_rows_under_tensor_parallelism(make_config, strategy, mesh, extra):
    cfg = par_config(
        make_config, strategy, "cola", mesh, **{"data.batching": "packed", "model.attention": "chunked", **extra}
    )
    single = cfg.copy_and_resolve_references()
    single.parallel.update(
        pipeline=1, data=1, fsdp=1, tensor=1, num_devices=1, pipeline_schedule="gpipe", pipeline_repeats=1
    )
    params = jax.device_get(build(single).init_state()["params"])
    batch, docs = _packed(np.random.default_rng(11), DOC_LAYOUTS + MORE_ROWS, cfg.train.seq_len, cfg.model.vocab_size)
    loss, grads = loss_and_grads(cfg, params, batch)
    want_loss, want_grads = _alone(cfg, params, docs)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert_close_tree(grads, want_grads, 1e-4)


def test_document_rows_equal_documents_alone(make_config):
    cfg = make_config(**{"data.batching": "document", "model.attention": "xla", "parallel.num_devices": 1})
    params = jax.device_get(build(cfg.copy_and_resolve_references()).init_state()["params"])
    rng = np.random.default_rng(5)
    t = cfg.train.seq_len
    lengths = np.array([16, 3, 9, 1])
    tokens = np.zeros((4, t + 1), np.int32)
    docs = []
    for r, n in enumerate(lengths):
        tokens[r, :n] = rng.integers(0, cfg.model.vocab_size, n)
        tokens[r, n:] = rng.integers(0, cfg.model.vocab_size, t + 1 - n)  # padding's value must not matter
        docs.append((r, 0, tokens[r, :n].copy()))
    loss, grads = loss_and_grads(cfg, params, {"tokens": tokens, "lengths": lengths.astype(np.int32)})
    want_loss, want_grads = _alone(cfg, params, docs)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert_close_tree(grads, want_grads, 1e-4)


@pytest.mark.parametrize("batching", ["packed", "document"])
def test_mixtures_and_text_sources_carry_documents(tmp_path, batching):
    """A weighted mixture of two prepared sources and a text source (tokenised into the run's cache):
    rows come from both sources, each row's tokens are whole pieces of one source's documents."""
    docs = {}
    for name, letter in (("a", "x"), ("b", "y")):
        texts = [letter * (3 + (7 * i) % 40) for i in range(60)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        prepare([str(tmp_path / f"{name}.jsonl")], tmp_path / name, "byte", progress=False)
        docs[name] = texts
    c = _config(tmp_path, batching, source="tokens", path=f"{tmp_path / 'a'}:0.5,{tmp_path / 'b'}:0.5")
    train_data, _, _ = build_loaders(c)
    batch = train_data.batch(0)
    letters = set()
    for row in batch["tokens"]:
        text = bytes(row[row > 0].astype(np.uint8)).decode()
        assert set(text) in ({"x"}, {"y"}), text
        letters |= set(text)
    assert letters == {"x", "y"}
    (tmp_path / "t.txt").write_text("one document per text file\n" * 20)
    c = _config(tmp_path, batching, source="text", path=str(tmp_path / "t.txt"))
    rows = build_loaders(c)[0].batch(0)
    assert (rows["tokens"][:, 0] > 0).all()  # every row starts with a token
