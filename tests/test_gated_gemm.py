"""The gate product inside the down projection's first GEMM (boost_jax/kernels/gated_gemm.py): the
three Pallas kernels under the interpreter against float64 numpy, forward and every gradient, on
fresh random inputs; under nested vmap; the model with them against XLA's; their sm_90 compile on
this CPU host, named for the step-time table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.kernels.gated_gemm import act_matmuls, gated_matmul, gated_reference


def _np_gated(g, u, w, ds, act):
    """float64: (s, dg, du, dw) of s = (act(g)·u) @ w against the cotangent ds."""
    g, u, w, ds = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (g, u, w, ds))
    if act == "silu":
        sig = 1 / (1 + np.exp(-g))
        a, da = g * sig, sig * (1 + g * (1 - sig))
    else:
        a, da = g, np.ones_like(g)
    h, dh = a * u, ds @ w.T
    rows = h.reshape(-1, h.shape[-1])
    return h @ w, dh * u * da, dh * a, rows.T @ ds.reshape(-1, ds.shape[-1])


def _close(got, want, tol):
    got, want = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


@pytest.mark.parametrize(
    "act,lead,f,r,dtype,tol",
    [("none", (3, 13), 56, 24, jnp.float32, 1e-5), ("silu", (40,), 33, 17, jnp.float32, 1e-5)]
    + [("none", (2, 20), 80, 48, jnp.bfloat16, 2e-2)],
    ids=["gate_times_up", "swiglu_odd", "bf16"],
)
def test_gated_gemm_matches_float64(act, lead, f, r, dtype, tol):
    """Forward, dg, du and dw on shapes that fill no tile (each last tile overlaps the one before it
    and masks what that one covered, in the output and in the K loop); w given in float32."""
    rng = np.random.default_rng()
    g, u = (jnp.asarray(rng.normal(size=(*lead, f)), dtype) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(f, r)) / np.sqrt(f), jnp.float32)
    ds = jnp.asarray(rng.normal(size=(*lead, r)), dtype)
    s, pull = jax.vjp(lambda g, u, w: gated_matmul(g, u, w, act, interpret=True), g, u, w)
    assert s.dtype == dtype
    got = (s, *pull(ds))
    assert got[3].dtype == jnp.float32
    for a, b in zip(got, _np_gated(g, u, w, ds, act)):
        _close(a, b, tol)


def test_gated_gemm_under_nested_vmap():
    """The data-parallel island's vmap and a pipeline's (nested): w shared by the batch (more rows),
    and w batched (one call per element); loss and every gradient equal plain jnp's."""
    k = jax.random.split(jax.random.key(5), 4)
    g, u = (jax.random.normal(k[i], (2, 2, 3, 16, 24)) for i in range(2))
    w = jax.random.normal(k[2], (24, 16)) / 5
    probe = jax.random.normal(k[3], (2, 2, 3, 16, 16))

    def run(fn, w_axis):
        loss = lambda g, u, w, p: (fn(g, u, w) * p).sum()  # noqa: E731
        grads = jax.value_and_grad(loss, argnums=(0, 1, 2))
        inner = jax.vmap(grads, (0, 0, w_axis, 0))
        return jax.jit(jax.vmap(inner, (0, 0, w_axis, 0)))(g, u, w if w_axis is None else jnp.stack([w] * 2), probe)

    for w_axis in (None, 0):
        if w_axis == 0:  # stacked per pipeline stage: (2, 2, 24, 16) after the inner stack
            w = jnp.stack([w] * 2)
        got = run(lambda g, u, w: gated_matmul(g, u, w, "silu", interpret=True), w_axis)
        want = run(lambda g, u, w: gated_reference(g, u, w, "silu"), w_axis)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _close(a, b, 1e-5)


def test_gated_gemm_refuses_bad_input_and_falls_back_on_small_sides():
    x = jnp.ones((20, 24))
    with pytest.raises(ValueError, match="impl='triton'"):
        gated_matmul(x, x, jnp.ones((24, 16)), impl="triton")
    with pytest.raises(ValueError, match="do not fit"):
        gated_matmul(x, x, jnp.ones((16, 16)))
    small = jax.make_jaxpr(lambda x, w: gated_matmul(x, x, w, interpret=True))(x, jnp.ones((24, 8)))
    assert "pallas_call" not in str(small)  # a side under 16: plain jnp


def test_act_matmuls_match_float64():
    """σ read into each of a group's second-stage GEMMs: outputs, the group's input gradient (each
    member's columns) and every weight gradient, on widths that fill no tile."""
    rng = np.random.default_rng()
    h = jnp.asarray(rng.normal(size=(2, 20, 3, 24)), jnp.float32)
    ws = tuple(jnp.asarray(rng.normal(size=(24, d)) / 5, jnp.float32) for d in (40, 17, 33))
    dys = tuple(jnp.asarray(rng.normal(size=(2, 20, d)), jnp.float32) for d in (40, 17, 33))
    ys, pull = jax.vjp(lambda h, ws: act_matmuls(h, ws, "silu", interpret=True), h, ws)
    dh, dws = pull(dys)
    hn = np.asarray(h, np.float64)
    sig = 1 / (1 + np.exp(-hn))
    a, da = hn * sig, sig * (1 + hn * (1 - sig))
    for i, (w, dy) in enumerate(zip(ws, dys)):
        w, dy = np.asarray(w, np.float64), np.asarray(dy, np.float64)
        _close(ys[i], a[:, :, i] @ w, 1e-5)
        _close(dh[:, :, i], (dy @ w.T) * da[:, :, i], 1e-5)
        _close(dws[i], np.einsum("btr,btd->rd", a[:, :, i], dy), 1e-5)


def test_act_matmuls_with_rope_match_float64():
    """RoPE inside two members' σ kernels (32-wide heads: two 16-wide halves each), the third plain:
    outputs, the input gradient and the weight gradients against float64 numpy, positions at random."""
    from boost_jax.kernels.gated_gemm import rope_table

    rng = np.random.default_rng()
    b, t, r, d, theta = 2, 20, 24, 32, 10000.0
    h = jnp.asarray(rng.normal(size=(b, t, 3, r)), jnp.float32)
    ws = tuple(jnp.asarray(rng.normal(size=(r, n)) / 5, jnp.float32) for n in (3 * d, d, 2 * d))
    dys = tuple(jnp.asarray(rng.normal(size=(b, t, w.shape[1])), jnp.float32) for w in ws)
    pos = jnp.asarray(rng.integers(0, 4096, size=(b, t)))
    flags = (True, True, False)
    ys, pull = jax.vjp(
        lambda h, ws: act_matmuls(h, ws, "silu", rope=(rope_table(pos, theta, d), flags), interpret=True), h, ws
    )
    dh, dws = pull(dys)
    hn = np.asarray(h, np.float64)
    sig = 1 / (1 + np.exp(-hn))
    a, da = hn * sig, sig * (1 + hn * (1 - sig))
    table = np.asarray(rope_table(pos, theta, d), np.float64)[:, :, None]  # the float32 angles RoPE uses
    cos, sin = table[..., : d // 2], table[..., d // 2 :]
    ang = np.asarray(pos, np.float64)[..., None, None] * theta ** (-np.arange(d // 2) / (d // 2))
    np.testing.assert_allclose(cos, np.cos(ang), atol=2e-3)  # the table is RoPE's, to float32 angles
    for i, (w, dy, f) in enumerate(zip(ws, dys, flags)):
        w, dy = np.asarray(w, np.float64), np.asarray(dy, np.float64)
        x = (a[:, :, i] @ w).reshape(b, t, -1, d)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        y = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1) if f else x
        g = dy.reshape(b, t, -1, d)
        g1, g2 = g[..., : d // 2], g[..., d // 2 :]
        pre = (np.concatenate([g1 * cos + g2 * sin, g2 * cos - g1 * sin], -1) if f else g).reshape(b, t, -1)
        _close(ys[i], y.reshape(b, t, -1), 1e-5)
        _close(dh[:, :, i], (pre @ w.T) * da[:, :, i], 1e-5)
        _close(dws[i], np.einsum("btr,btd->rd", a[:, :, i], pre), 1e-5)


@pytest.mark.parametrize(
    "only_lr_act", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["gate_times_up", "swiglu"]
)
def test_the_model_with_the_gate_and_sigma_in_its_gemms_equals_xlas(make_config, only_lr_act):
    """A cola model whose MLP runs `model.gate_kernel=gemm` and whose projections read σ into their B
    GEMMs, q's and k's with RoPE inside (`model.bottleneck_kernel`, auto: norm with the gate;
    interpreted) computes XLA's logits and gradients."""
    from flax import nnx

    from boost_jax.model import build_model

    heads = {"model.d_model": 64, "model.n_heads": 2, "model.n_kv_heads": 2}  # 32-wide heads: RoPE in the kernels
    cfg = make_config(**{"model.n_layers": 1, "model.only_lr_act": only_lr_act, "model.rank": 16, **heads})
    tokens = jnp.asarray(np.random.default_rng().integers(0, 256, (2, 12)))
    probe = jax.random.normal(jax.random.key(8), (2, 12, cfg.model.vocab_size))
    runs = {}
    for impl in ("gemm", "xla"):
        cfg.model.gate_kernel = impl
        cfg.model.group_linears = "first"  # q/k/v and gate/up: one member each of a group's kernels
        graphdef, state = nnx.split(build_model(cfg.model, seed=3))

        def loss(state, graphdef=graphdef):
            logits, _ = nnx.merge(graphdef, state)(tokens)
            return (logits * probe).sum(), logits

        jaxpr = str(jax.make_jaxpr(loss)(state))
        kernels = ("gated_gemm_fwd", "silu_gemm_fwd", "silu_rope_gemm_fwd")  # (the forward's jaxpr)
        assert tuple(k in jaxpr for k in kernels) == (impl == "gemm",) * 3
        runs[impl] = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    (_, got), got_grads = runs["gemm"]
    (_, want), want_grads = runs["xla"]
    _close(got, want, 1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        _close(a, b, 1e-4)


def test_gated_gemm_kernels_compile_for_h100_without_a_gpu():
    """The three kernels lower through Pallas's Triton backend for a deviceless H100 (bf16, sides that
    are no multiple of a tile); each Triton call's name carries its GEMM, which the step-time table
    prices as that GEMM."""
    from jax.sharding import SingleDeviceSharding

    from boost_jax.kernels import platform
    from boost_jax.tools import aot
    from boost_jax.tools.step_profile.kernels import kernels

    dev = aot.devices("h100", 1)[0]
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(dev))  # noqa: E731
    m, f, r = 300, 547, 72

    def step(g, u, w, ds):
        s, pull = jax.vjp(lambda g, u, w: gated_matmul(g, u, w, "silu"), g, u, w)
        return s, pull(ds)

    with platform.target([dev]):
        text = jax.jit(step).lower(sd(3, 100, f), sd(3, 100, f), sd(f, r), sd(3, 100, r)).compile().as_text()
    gemms = {k.backend.split()[-1]: (k.gemm[:4], k.flops) for k in kernels(text) if k.kind == "gemm"}
    assert gemms == {
        f"gated_gemm_fwd__gemm_1x{m}x{r}x{f}": ((1, m, r, f), 2.0 * m * r * f),
        f"gated_gemm_dx__gemm_1x{m}x{f}x{r}": ((1, m, f, r), 2.0 * m * f * r),
        f"gated_gemm_dw__gemm_1x{f}x{r}x{m}": ((1, f, r, m), 2.0 * f * r * m),
    }, gemms


def test_a_groups_input_gradient_is_one_kernel_for_h100_without_a_gpu():
    """q/k/v-shaped (two members rotated by RoPE, 32-wide heads): the σ kernels lower for a deviceless
    H100 and the group's input gradient is ONE kernel writing every member's columns, named for the
    GEMM of its FLOPs; no member's own input-gradient kernel and no stack after."""
    from jax.sharding import SingleDeviceSharding

    from boost_jax.kernels import platform
    from boost_jax.kernels.gated_gemm import rope_table
    from boost_jax.tools import aot
    from boost_jax.tools.step_profile.kernels import kernels

    dev = aot.devices("h100", 1)[0]
    sd = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(dev))  # noqa: E731
    m, r, n = 300, 40, 96

    def step(h, ws, pos, dys):
        rope = (rope_table(pos, 10000.0, 32), (True, True, False))
        ys, pull = jax.vjp(lambda h, ws: act_matmuls(h, ws, "silu", rope=rope), h, ws)
        return ys, pull(dys)

    with platform.target([dev]):
        args = sd(3, 100, 3, r), (sd(r, n),) * 3, sd(3, 100, dt=jnp.int32), (sd(3, 100, n),) * 3
        text = jax.jit(step).lower(*args).compile().as_text()
    names = [k.backend.split()[-1] for k in kernels(text) if k.kind == "gemm"]
    assert [x for x in names if "_dx" in x] == [f"silu_rope_group_gemm_dx__gemm_1x{m}x{3 * r}x{n}"], names
    assert sum("_fwd" in x for x in names) == sum("_dw" in x for x in names) == 3, names


def test_a_jax_without_pallas_triton_runs_the_references_loudly(monkeypatch):
    """Where the kernels cannot compile (here: no Pallas Triton backend), plain jnp runs, with a warning
    naming why: the same values."""
    from boost_jax.kernels import gated_gemm

    monkeypatch.setattr(gated_gemm, "plgpu", None)
    monkeypatch.setattr(gated_gemm, "_LOWERS", {})
    rng = np.random.default_rng()
    g, u = (jnp.asarray(rng.normal(size=(20, 24)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(24, 16)), jnp.float32)
    with pytest.warns(UserWarning, match="no Pallas Triton backend"):
        s = gated_matmul(g, u, w, "silu")
    _close(s, _np_gated(g, u, w, np.zeros((20, 16)), "silu")[0], 1e-6)
    (y,) = act_matmuls(g.reshape(20, 1, 24), [w], "silu")  # warned once per key: no second warning
    _close(y, _np_gated(g, np.ones_like(g), w, np.zeros((20, 16)), "silu")[0], 1e-6)
