"""Every attention implementation that runs on CPU matches the `xla` reference (value and gradient):
causal, GQA, odd lengths, float32 and bfloat16, offsets (KV cache), sharded under btp and megatron."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from test_parallel import assert_close_tree, loss_and_grads, par_config, reference

from boost_jax.errors import ConfigError
from boost_jax.generate import generate
from boost_jax.model import attention as A
from boost_jax.model import build_model, remat
from boost_jax.model.attention import chunked as chunked_impl
from boost_jax.model.attention import pallas as pallas_impl
from boost_jax.model.attention import registry

# (batch, T, heads, kv heads, head dim, block): odd lengths over several blocks with a partial last
# one, GQA groups of 2 and 3, and MHA.
SHAPES = [(2, 13, 4, 2, 8, 4), (1, 37, 6, 2, 16, 8), (2, 16, 4, 4, 8, 16)]
IMPLS = {
    "chunked": lambda q, k, v, off, blk: A.chunked_attention(q, k, v, off, block=blk),
    "pallas": lambda q, k, v, off, blk: A.pallas_attention(q, k, v, off),
}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _qkv(b, t, h, kv, dh, dtype, seed, s=None):
    ks = jax.random.split(jax.random.key(seed), 4)
    s = s or t
    q = jax.random.normal(ks[0], (b, t, h, dh)).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kv, dh)).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kv, dh)).astype(dtype)
    w = jax.random.normal(ks[3], (b, t, h, dh))  # a random functional of the output
    return q, k, v, w


def _value_and_grads(fn, q, k, v, w):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}t{}h{}kv{}d{}blk{}".format(*s))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_xla(impl, shape, dtype):
    b, t, h, kv, dh, blk = shape
    q, k, v, w = _qkv(b, t, h, kv, dh, dtype, seed=t)
    got = _value_and_grads(lambda q, k, v: IMPLS[impl](q, k, v, 0, blk), q, k, v, w)
    # The reference runs in float32 on the same (rounded) inputs.
    ref = _value_and_grads(lambda q, k, v: A.xla_attention(q, k, v, 0), *(x.astype(jnp.float32) for x in (q, k, v)), w)
    for name, g, r in zip(("value", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert g.dtype == (jnp.float32 if name == "value" else dtype)
        assert _rel(g, r) <= TOL[dtype], f"{name}: {_rel(g, r):.2e}"


@pytest.mark.parametrize("offset,t,s", [(5, 3, 12), (0, 5, 12), (11, 1, 12), (7, 9, 16)])
def test_chunked_with_offset_matches_xla(offset, t, s):
    """KV-cache shapes: T new queries at `offset` against S cache slots (later slots hidden)."""
    q, k, v, w = _qkv(2, t, 6, 2, 8, jnp.float32, seed=offset, s=s)
    off = jnp.int32(offset)  # traced, as in a decode step
    got = _value_and_grads(lambda q, k, v: A.chunked_attention(q, k, v, off, block=4), q, k, v, w)
    ref = _value_and_grads(lambda q, k, v: A.xla_attention(q, k, v, off), q, k, v, w)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert _rel(g, r) <= 2e-5


def test_chunked_never_builds_the_score_matrix():
    """Compiled forward+backward at T = 4096: temporaries far below one [T, S] float32 matrix."""
    b, t, h, dh = 1, 4096, 2, 16
    q = jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, t, 1, dh), jnp.float32)

    def temp_bytes(fn):
        grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

    one_score_matrix = t * t * 4
    chunked = temp_bytes(lambda q, k, v: A.chunked_attention(q, k, v, 0, block=256))
    xla = temp_bytes(lambda q, k, v: A.xla_attention(q, k, v, 0))
    assert xla >= one_score_matrix  # the reference does hold it
    assert chunked < one_score_matrix / 8, (chunked, xla)


def test_remat_policies_name_the_attention_residuals(capsys):
    q, k, v, _ = _qkv(1, 8, 2, 1, 4, jnp.float32, seed=0)
    for policy, kept in (("dots", True), ("lowrank", False)):
        f = jax.checkpoint(lambda q, k, v: jnp.sum(A.attend(q, k, v, impl="chunked") ** 2), policy=remat.policy(policy))
        print_saved_residuals(f, q, k, v)
        out = capsys.readouterr().out
        assert (("named 'attn_out'" in out) and ("named 'attn_lse'" in out)) == kept, (policy, out)


def test_auto_and_fallbacks_resolve():
    q = jnp.zeros((1, 8, 2, 4))
    long_k = jnp.zeros((1, A.AUTO_XLA_MAX_KEYS + 1, 2, 4))
    assert A.resolve("auto", q, q, 0) == "xla"  # CPU, short
    assert A.resolve("auto", q, long_k, 0) == "chunked"
    assert A.resolve("pallas", q, q, jnp.int32(3)) == "chunked"  # a decode step
    with pytest.raises(ConfigError, match="model.attention"):
        A.resolve("flash", q, q, 0)


def test_cudnn_is_a_clear_error_on_cpu():
    q = jnp.zeros((1, 8, 2, 4), jnp.bfloat16)
    with pytest.raises(ConfigError, match="model.attention.*GPU"):
        A.attend(q, q, q, impl="cudnn")


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
def test_cached_generation_matches_xla(make_config, monkeypatch, impl):
    monkeypatch.setattr(chunked_impl, "CHUNK", 4)
    prompt = np.random.default_rng(1).integers(0, 256, (2, 6)).astype(np.int32)
    ref_model = build_model(make_config(**{"model.attention": "xla"}).model, seed=5)
    model = build_model(make_config(**{"model.attention": impl}).model, seed=5)
    out = generate(model, prompt, 6)
    np.testing.assert_array_equal(out, generate(ref_model, prompt, 6))
    full, _ = model(jnp.asarray(out))  # no cache: the implementation itself, over several blocks
    want, _ = ref_model(jnp.asarray(out))
    assert _rel(full, want) <= 2e-5


SHARDED = {
    "chunked_btp": ("chunked", "btp", (2, 1, 4), {}),
    "chunked_megatron": ("chunked", "megatron", (2, 1, 4), {}),
    "pallas_btp": ("pallas", "btp", (2, 1, 4), {}),
    "chunked_pipeline_dots_remat": (
        "chunked",
        "btp",
        (2, 1, 2),
        {"parallel.pipeline": 2, "model.n_layers": 4, "remat.policy": "dots"},
    ),
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "chunked_megatron" else c for c in SHARDED]
)
def test_sharded_matches_single_device_xla(make_config, monkeypatch, case):
    """8 emulated devices, GQA, 2 chunks of 8: loss and grads as the one-device xla run."""
    impl, strategy, mesh, kw = SHARDED[case]
    monkeypatch.setattr(chunked_impl, "CHUNK", 8)
    cfg = par_config(make_config, strategy, "cola", mesh, **{"model.n_kv_heads": 4, **kw})
    params, tokens, (ref_loss, ref_grads) = reference(cfg)  # model.attention=auto: xla at this length
    cfg.model.attention = impl
    loss, grads = loss_and_grads(cfg, params, tokens)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)


def test_pallas_attention_lowers_to_triton_for_cuda():
    """The compiled (not interpreted) flash kernels, forward and backward, lower for an NVIDIA GPU
    from this CPU host (GQA, bf16, head dim 64)."""
    q = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    loss = lambda q, k, v: A.pallas_attention(q, k, v, 0, interpret=False).astype(jnp.float32).sum()  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") >= 2


def test_pallas_runs_the_public_mha_when_the_private_backward_changed(monkeypatch):
    """A jax whose private _mha_backward has another signature gets the module's public mha (its own
    custom_vjp), with a warning; value and gradients still match xla."""
    mod = pallas_impl._pallas_mha_module()
    assert pallas_impl._private_backward_ok(mod)  # this jax: the fused path with the remat residuals
    monkeypatch.setattr(mod, "_mha_backward", lambda sm_scale, causal, block_q, block_k, res, do: None)
    q, k, v, w = _qkv(2, 13, 4, 2, 8, jnp.float32, seed=3)
    with pytest.warns(UserWarning, match="public mha"):
        got = _value_and_grads(lambda q, k, v: A.pallas_attention(q, k, v, 0), q, k, v, w)
    ref = _value_and_grads(lambda q, k, v: A.xla_attention(q, k, v, 0), q, k, v, w)
    for name, g, r in zip(("value", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert _rel(g, r) <= TOL[jnp.float32], f"{name}: {_rel(g, r):.2e}"


def test_chunked_adds_no_collective_under_btp(make_config, monkeypatch):
    """The blockwise loops stay head-local: the compiled train step's collectives (kind, axes, count,
    elements) are those of the xla attention (data 2 x tensor 4, GQA, 4 chunks of 64)."""
    from boost_jax.tools.comm_report.programs import compile_program
    from boost_jax.tools.hlo_comm import parse_collectives, summarize

    monkeypatch.setattr(chunked_impl, "CHUNK", 64)
    found = {}
    for impl in ("xla", "chunked"):
        cfg = par_config(
            make_config,
            "btp",
            "cola",
            (2, 1, 4),
            **{
                "model.n_kv_heads": 4,
                "model.max_seq_len": 256,
                "train.seq_len": 256,
                "train.global_batch": 4,
                "model.attention": impl,
            },
        )
        compiled, mesh, _ = compile_program(cfg, "train_step", jax.devices()[:8], 2, False)
        found[impl] = summarize(parse_collectives(compiled.as_text(), mesh), by=("kind", "axes"))
    assert found["chunked"] == found["xla"]


# ---------------------------------------------------------------------------------------- documents

# Rows of document lengths (the rest of the row is padding, segment 0), T = 40, blocks of 8: a
# document over several blocks, boundaries inside blocks, rows of different layouts, a one-token
# document, a whole-row document.
PACKED = [[5, 20, 10], [8, 8, 3, 1, 12, 8], [3, 30], [40]]


def _segments(rows, t):
    """int32 [B, T]: documents 1, 2, ... of each row's lengths, then padding 0."""
    seg = np.zeros((len(rows), t), np.int32)
    for b, lengths in enumerate(rows):
        ends = np.cumsum(lengths)
        for d, (start, end) in enumerate(zip(ends - lengths, ends)):
            seg[b, start:end] = d + 1
    return seg


def _runs(seg):
    """(row, start, end, id) of every contiguous run of a segments array."""
    out = []
    for b, row in enumerate(np.asarray(seg)):
        cut = [0, *(np.flatnonzero(row[1:] != row[:-1]) + 1), len(row)]
        out += [(b, s, e, int(row[s])) for s, e in itertools.pairwise(cut)]
    return out


def _alone(seg):
    """The reference: every document run alone through `xla_attention` (no documents), put back in
    place; padding positions get zeros."""
    runs = [r for r in _runs(seg) if r[3] != 0]

    def fn(q, k, v):
        out = jnp.zeros(q.shape, jnp.float32)
        for b, s, e, _ in runs:
            y = A.xla_attention(q[b : b + 1, s:e], k[b : b + 1, s:e], v[b : b + 1, s:e], 0)
            out = out.at[b : b + 1, s:e].set(y.astype(jnp.float32))
        return out

    return fn


def _assert_documents_alone(fn, seg, h=4, kv=2, dh=8, tol=2e-5, seed=0):
    """fn(q, k, v) on packed rows == every document alone (value outside padding; dq, dk, dv), and
    its gradients with the padding outputs in the loss are finite."""
    b, t = seg.shape
    q, k, v, w = _qkv(b, t, h, kv, dh, jnp.float32, seed=seed)
    real = jnp.asarray(seg != 0)[:, :, None, None]
    got = _value_and_grads(fn, q, k, v, jnp.where(real, w, 0.0))
    ref = _value_and_grads(_alone(seg), q, k, v, jnp.where(real, w, 0.0))
    for name, g, r in zip(("value", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert _rel(g, r) <= tol, f"{name}: {_rel(g, r):.2e}"
    out = np.asarray(fn(q, k, v).reshape(q.shape))
    np.testing.assert_allclose(np.where(np.asarray(real), out, 0), _alone(seg)(q, k, v), atol=tol * np.abs(out).max())
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(_value_and_grads(fn, q, k, v, w)))


DOC_IMPLS = {
    "xla": lambda q, k, v, docs: A.xla_attention(q, k, v, 0, docs=docs),
    "chunked": lambda q, k, v, docs: A.chunked_attention(q, k, v, 0, block=8, docs=docs),
    "attend_chunked": lambda q, k, v, docs: A.attend(q, k, v, impl="chunked", docs=docs).reshape(q.shape),
}


@pytest.mark.parametrize("impl", list(DOC_IMPLS))
def test_packed_rows_match_documents_alone(impl, monkeypatch):
    monkeypatch.setattr(chunked_impl, "CHUNK", 8)
    seg = _segments(PACKED, 40)
    docs = A.Documents.packed(seg)
    _assert_documents_alone(lambda q, k, v: DOC_IMPLS[impl](q, k, v, docs), seg)


def test_chunked_documents_with_mha_and_odd_blocks():
    """MHA, T = 37 with blocks of 5 (a partial last block), documents aligned across rows (blocks skipped)."""
    seg = _segments([[12, 20, 5], [12, 9, 11], [12, 25]], 37)
    docs = A.Documents.packed(seg)
    _assert_documents_alone(lambda q, k, v: A.chunked_attention(q, k, v, 0, block=5, docs=docs), seg, h=3, kv=3)


def test_pallas_packed_rows_match_documents_alone():
    """The interpreted kernel with segment ids, padded from T = 20 to blocks of 8 (GQA)."""
    seg = _segments([[5, 9, 2], [3, 17]], 20)
    docs = A.Documents.packed(seg)
    _assert_documents_alone(lambda q, k, v: A.pallas_attention(q, k, v, 0, block=8, docs=docs), seg)


def test_pallas_public_mha_takes_the_segment_ids(monkeypatch):
    monkeypatch.setattr(pallas_impl, "_private_backward_ok", lambda mod: False)
    seg = _segments([[5, 9, 2], [3, 17]], 20)
    docs = A.Documents.packed(seg)
    with pytest.warns(UserWarning, match="public mha"):
        _assert_documents_alone(lambda q, k, v: A.pallas_attention(q, k, v, 0, block=8, docs=docs), seg)


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_one_document_per_row_is_packed_with_one_document(impl, monkeypatch):
    monkeypatch.setattr(chunked_impl, "CHUNK", 4)
    lengths = np.array([7, 16, 1, 10], np.int32)
    one = A.Documents.one_per_row(jnp.asarray(lengths), 16)
    packed = A.Documents.packed(_segments([[n] for n in lengths], 16))
    assert packed.lengths is None and one.kind == "lengths" and packed.kind == "segments"
    np.testing.assert_array_equal(one.lengths, lengths)
    for a, b in zip(jax.tree.leaves(one)[:3], jax.tree.leaves(packed)):
        np.testing.assert_array_equal(a, b)
    q, k, v, w = _qkv(4, 16, 4, 2, 8, jnp.float32, seed=4)

    def run(docs):
        return _value_and_grads(lambda q, k, v: A.attend(q, k, v, impl=impl, docs=docs).reshape(q.shape), q, k, v, w)

    got, want = run(one), run(packed)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


def test_document_spans_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        seg = _segments([_random_layout(rng, 23) for _ in range(3)], 23)
        docs = A.Documents.packed(seg)
        first, last = np.full(23, 23), np.full(23, -1)
        for b, s, e, _ in _runs(seg):
            first[s:e] = np.minimum(first[s:e], s)
            last[s:e] = np.maximum(last[s:e], e - 1)
        np.testing.assert_array_equal(docs.first_key, first)
        np.testing.assert_array_equal(docs.last_query, last)


def _random_layout(rng, t):
    lengths, left = [], int(rng.integers(t // 2, t + 1))  # the rest is padding
    while left:
        lengths.append(int(rng.integers(1, left + 1)))
        left -= lengths[-1]
    return lengths


@pytest.mark.parametrize("t,block", [(40, 8), (37, 5), (16, 4)])
def test_chunked_visits_exactly_the_key_blocks_some_row_needs(t, block):
    """Block (i, j) is visited (forward and dq: key blocks of query block i; dk/dv: query blocks of
    key block j) iff some row has a query of block i that sees a key of block j; with documents
    aligned across rows, fewer blocks than causality alone."""
    rng = np.random.default_rng(t)
    layouts = [[_random_layout(rng, t) for _ in range(3)] for _ in range(10)]
    layouts.append([[t // 2, t - t // 2]] * 2)  # one boundary shared by every row
    for rows in layouts:
        seg = _segments(rows, t)
        bq, nq = chunked_impl._blocks(t, block)
        bk, nk = bq, nq
        pos = np.arange(t)
        visible = (pos[:, None] >= pos[None, :]) & (seg[:, :, None] == seg[:, None, :])  # [B, T, S]
        needed = np.zeros((nq, nk), bool)
        for i in range(nq):
            for j in range(nk):
                needed[i, j] = visible[:, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()
        first_k, end_q = (np.asarray(x) for x in chunked_impl._document_bounds(A.Documents.packed(seg), bq, nq, bk, nk))
        ii, jj = np.meshgrid(np.arange(nq), np.arange(nk), indexing="ij")
        n_k = np.array([chunked_impl._n_visible_k_blocks(i, bq, bk, 0, nk) for i in range(nq)])
        first_q = np.array([chunked_impl._first_visible_q_block(j, bq, bk, 0) for j in range(nk)])
        causal = jj < n_k[:, None]
        by_query = (jj >= first_k[:, None]) & causal
        by_key = (ii >= first_q[None, :]) & (ii < end_q[None, :])
        np.testing.assert_array_equal(by_query, needed, err_msg=str(rows))
        # dk/dv: the causal start (unchanged by documents) may take one query block wholly above the
        # diagonal (masked there); the documents' end is exact.
        np.testing.assert_array_equal(by_key & (ii >= jj), needed, err_msg=str(rows))
        assert not (by_key & (ii < jj - 1)).any(), rows
        np.testing.assert_array_equal(end_q, [np.flatnonzero(needed[:, j]).max() + 1 for j in range(nk)])
    assert needed.sum() < causal.sum()  # the shared boundary: blocks wholly across it are skipped


def test_chunked_with_documents_never_builds_the_score_matrix():
    """Compiled forward+backward at T = 4096 with packed rows: temporaries far below one [T, T]
    float32 matrix, and hardly above those without documents."""
    b, t, h, dh = 2, 4096, 2, 16
    q = jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, t, 1, dh), jnp.float32)
    docs = A.Documents.packed(_segments([[700, 2000, 300], [100, 3996]], t))

    def temp_bytes(fn, *args):
        grad = jax.grad(lambda q, k, v, *a: jnp.sum(fn(q, k, v, *a)), argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, kv, kv, *args).compile().memory_analysis().temp_size_in_bytes

    one_score_matrix = t * t * 4
    with_docs = temp_bytes(lambda q, k, v, docs: A.chunked_attention(q, k, v, 0, block=256, docs=docs), docs)
    without = temp_bytes(lambda q, k, v: A.chunked_attention(q, k, v, 0, block=256))
    assert with_docs < one_score_matrix / 4, (with_docs, without)
    assert with_docs < 1.05 * without, (with_docs, without)


def test_resolve_with_documents(monkeypatch):
    """auto never runs cudnn on packed rows (and says so once); naming an implementation that cannot
    take the documents is a config error naming both fields."""
    q = jnp.zeros((2, 8, 2, 8))
    long_k = jnp.zeros((2, A.AUTO_XLA_MAX_KEYS + 1, 2, 8))
    packed = A.Documents.packed(_segments([[3, 5], [8]], 8))
    one = A.Documents.one_per_row(jnp.array([5, 8]), 8)
    monkeypatch.setattr(registry, "_WARNED", set())
    with warnings.catch_warnings(record=True) as rec:  # on CPU auto runs xla anyway: nothing to say
        warnings.simplefilter("always")
        assert A.resolve("auto", q, q, 0, packed) == "xla"
    assert not rec
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # where auto would pick cudnn
    half = q.astype(jnp.bfloat16)
    assert A.resolve("auto", half, half, 0) == "cudnn"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert [A.resolve("auto", half, half, 0, packed) for _ in range(3)] == ["xla"] * 3
    notice = "model.attention=auto: packed rows (data.batching=packed) run xla; cudnn takes one document per row only"
    assert [str(w.message) for w in rec] == [notice]
    with pytest.warns(UserWarning, match="run chunked"):
        long = long_k.astype(jnp.bfloat16)
        assert A.resolve("auto", long, long, 0, packed) == "chunked"
    assert A.resolve("auto", half, half, 0, one) == "cudnn"  # one document per row keeps cudnn
    monkeypatch.undo()
    assert A.resolve("auto", q, q, 0, one) == "xla"  # CPU
    # The GPU choice, as the planner asks it: document rows keep cudnn, packed rows never get it.
    assert A.auto_impl(True, True, 64, 2048, 2048) == "cudnn"
    assert A.auto_impl(True, True, 64, 2048, 2048, documents="lengths") == "cudnn"
    assert A.auto_impl(True, True, 64, 2048, 2048, documents="segments") == "chunked"
    assert A.auto_impl(True, True, 64, 512, 512, documents="segments") == "xla"
    assert A.resolve("cudnn", q, q, 0, one) == "cudnn"
    with pytest.raises(ConfigError, match=r"model\.attention.*cudnn.*data\.batching=packed.*chunked"):
        A.resolve("cudnn", q, q, 0, packed)
    for name in ("xla", "chunked", "pallas"):
        assert A.takes_documents(name, "segments") and A.takes_documents(name, "lengths")
    assert A.takes_documents("cudnn", "lengths") and not A.takes_documents("cudnn", "segments")
    assert A.takes_documents("auto", "segments")


def test_an_implementation_without_documents(monkeypatch):
    """Registered without `documents`: called with four arguments when there are none, a config
    error when there are."""
    monkeypatch.setattr(registry, "IMPLEMENTATIONS", dict(registry.IMPLEMENTATIONS))
    A.implementation("toy", cost="materialized")(lambda q, k, v, offset: A.xla_attention(q, k, v, offset))
    q, k, v, _ = _qkv(2, 8, 4, 2, 8, jnp.float32, seed=1)
    np.testing.assert_array_equal(A.attend(q, k, v, impl="toy"), A.attend(q, k, v, impl="xla"))
    assert not A.takes_documents("toy", "segments") and not A.takes_documents("toy", "lengths")
    for docs in (A.Documents.packed(_segments([[3, 5], [8]], 8)), A.Documents.one_per_row(jnp.array([5, 8]), 8)):
        with pytest.raises(ConfigError, match=r"model\.attention.*toy.*data\.batching"):
            A.attend(q, k, v, impl="toy", docs=docs)
    with pytest.raises(ValueError, match="documents"):
        A.implementation("bad", cost="materialized", documents=("mask",))


def test_attention_module_keeps_documents_apart(make_config):
    """The layer (projections, RoPE at positions restarting per document) on a packed row gives every
    document what it gives the document alone; with a KV cache the documents are ignored."""
    from flax import nnx

    from boost_jax.model.linear import RMSNorm

    m = make_config(**{"model.attention": "xla"}).model
    attn = A.Attention(m, rngs=nnx.Rngs(params=0), param_dtype=jnp.float32)
    norm = RMSNorm(m.d_model, eps=m.norm_eps)
    seg = _segments([[6, 10], [16]], 16)
    x = jax.random.normal(jax.random.key(2), (2, 16, m.d_model))
    positions = jnp.asarray(np.concatenate([np.r_[0:6, 0:10][None], np.arange(16)[None]]))
    out, _ = attn(x, norm, positions, docs=A.Documents.packed(seg))
    for b, s, e, _ in _runs(seg):
        alone, _ = attn(x[b : b + 1, s:e], norm, jnp.arange(e - s)[None])
        assert _rel(out[b : b + 1, s:e], alone) <= 2e-5
    cache = {n: jnp.zeros((2, 16, m.n_kv_heads, m.d_model // m.n_heads)) for n in ("k", "v")}
    pos = jnp.broadcast_to(jnp.arange(4), (2, 4))
    with_docs, _ = attn(x[:, :4], norm, pos, cache, docs=A.Documents.packed(seg[:, :4]))
    np.testing.assert_array_equal(with_docs, attn(x[:, :4], norm, pos, cache)[0])


def test_cudnn_pads_a_head_dim_it_does_not_take():
    """cudnn's wrapper zero-pads head dim 10 to 16 at the unpadded scale: value and gradients equal the
    causal softmax attention at dim 10 in float64 (numpy), on fresh inputs; auto takes it on a GPU."""
    from boost_jax.model.attention.cudnn import padded_head_dim

    rng = np.random.default_rng()
    b, t, h, d = 2, 7, 3, 10
    q, k, v, w = (rng.standard_normal((b, t, h, d)) for _ in range(4))
    seen = []

    def xla(q, k, v, **kw):
        seen.append(q.shape[-1])
        return jax.nn.dot_product_attention(q, k, v, **kw)

    def loss(q, k, v):
        out = padded_head_dim(xla)(q, k, v, is_causal=True, implementation="xla")
        return jnp.sum(out * w), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v))
    )
    assert seen == [16] and out.shape == (b, t, h, d)

    def ref(q, k, v):  # numpy float64, causal
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)

    np.testing.assert_allclose(out, ref(q, k, v), rtol=1e-4, atol=1e-5)
    eps = 1e-6
    for i, g in enumerate(grads):  # central differences of sum(ref * w) along a random direction
        u = rng.standard_normal(g.shape)
        args = [q, k, v]
        hi, lo = list(args), list(args)
        hi[i], lo[i] = args[i] + eps * u, args[i] - eps * u
        fd = (np.sum(ref(*hi) * w) - np.sum(ref(*lo) * w)) / (2 * eps)
        np.testing.assert_allclose(np.sum(np.asarray(g) * u), fd, rtol=1e-3, atol=1e-4)
    assert A.auto_impl(True, True, 100, 4096, 4096) == "cudnn"  # 3B's head dim, padded to 104
    assert A.auto_impl(True, True, 130, 4096, 4096) == "chunked"  # 136 padded: past cuDNN's 128
