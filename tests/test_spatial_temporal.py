"""PrimePar P(n x n) (boost_jax.parallel.spatial_temporal) on emulated CPU devices.

n = 2 runs in the pytest process (8 devices). n = 4 needs 16 devices, but XLA's device count is
fixed at jax import, so the n = 4 checks run once in a subprocess (this file run as a script with
16 emulated devices) and each pytest test reads its check's verdict.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.parallel import spatial_temporal as st
from boost_jax.tools.hlo_comm import parse_collectives

RTOL = 1e-5


def grid_mesh(n: int, names: tuple[str, ...], batch: int = 1) -> Mesh:
    shape = (batch, n, n) if batch > 1 else (n, n)
    devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def put(x, mesh: Mesh, spec: P):
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))


def fwd_bwd(mesh, row, col, batch_axes=None, row_dim=-2):
    """jit(x, w, g) -> (O, dI, dW) through jax.vjp of st_matmul (no loss reduction => no all-reduce)."""

    def f(i, w, g):
        o, vjp = jax.vjp(
            lambda a, b: st.st_matmul(
                a, b, mesh=mesh, row_axis=row, col_axis=col, batch_axes=batch_axes, row_dim=row_dim
            ),
            i,
            w,
        )
        return (o, *vjp(g))

    return jax.jit(f)


def reference(i, w, g):
    """Unsharded float32 O, dI, dW on one device."""
    o, vjp = jax.vjp(lambda a, b: jnp.einsum("...mn,nk->...mk", a, b), jnp.asarray(i), jnp.asarray(w))
    return (o, *vjp(jnp.asarray(g)))


# ---------------------------------------------------------------- checks (shared by n=2 and n=4)


def check_layouts(n: int, seed: int = 0) -> None:
    """Block (r, c) of the skewed arrays is I<r, r+c> / W<r+c, c>; unskew inverts skew."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 2 * n, 3 * n)).astype(np.float32)
    w = rng.standard_normal((3 * n, 2 * n)).astype(np.float32)
    xs, ws = np.asarray(st.skew_input(x, n)), np.asarray(st.skew_weight(w, n))
    blk = lambda a, r, c, bm, bk: a[..., r * bm : (r + 1) * bm, c * bk : (c + 1) * bk]
    for r in range(n):
        for c in range(n):
            np.testing.assert_array_equal(blk(xs, r, c, 2, 3), blk(x, r, (r + c) % n, 2, 3))
            np.testing.assert_array_equal(blk(ws, r, c, 3, 2), blk(w, (r + c) % n, c, 3, 2))
    np.testing.assert_array_equal(st.unskew_input(xs, n), x)
    np.testing.assert_array_equal(st.unskew_weight(ws, n), w)
    np.testing.assert_array_equal(st.skew_input(st.unskew_input(x, n), n), x)
    np.testing.assert_array_equal(st.skew_weight(st.unskew_weight(w, n), n), w)
    x2 = x[0]  # 2-D activations too
    np.testing.assert_array_equal(st.unskew_input(st.skew_input(x2, n), n), x2)


def rows_first(f, x, n: int, groups: int = 1):
    """Apply a global skew helper `f` (which cuts dim -2 into n blocks) to an activation whose
    grid rows split dim 0 (row_dim=0), that dim being cut into `groups` batch-axis chunks first."""
    x = np.asarray(x)
    b = np.moveaxis(x.reshape(groups, x.shape[0] // groups, *x.shape[1:]), 1, -2)
    return np.moveaxis(np.asarray(f(b, n)), -2, 1).reshape(x.shape)


def check_sharded_skew(n: int, mesh: Mesh, row: str, col: str, seed: int = 1, row_dim: int = -2) -> None:
    """skew_sharded == skew_input as global values, inverted by unskew_sharded, one permute each."""
    x = np.random.default_rng(seed).standard_normal((2 * n, 2 * n, 4 * n)).astype(np.float32)
    xd = put(x, mesh, st._x_spec(3, row, col, None, row_dim))
    kw = dict(mesh=mesh, row_axis=row, col_axis=col, row_dim=row_dim)
    skew = jax.jit(lambda a: st.skew_sharded(a, **kw))
    unskew = jax.jit(lambda a: st.unskew_sharded(a, **kw))
    xs = skew(xd)
    want = st.skew_input(x, n) if row_dim == -2 else rows_first(st.skew_input, x, n)
    np.testing.assert_array_equal(xs, want)
    np.testing.assert_array_equal(unskew(xs), x)
    kinds = [c.kind for c in parse_collectives(skew.lower(xd).compile().as_text(), mesh)]
    assert kinds == ["collective-permute"], kinds


def check_weight_skew(n: int, mesh: Mesh, row: str, col: str, seed: int = 4) -> None:
    """skew_weight_sharded == skew_weight from every stored layout over the grid axes, with at
    most one collective-permute (none when the layout needs only local slices); its transpose
    returns a cotangent to the plain layout (unskew_weight)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((2 * n, 3 * n)).astype(np.float32)
    g = rng.standard_normal((2 * n, 3 * n)).astype(np.float32)
    for dims in [(row, col), (col, row), (row, None), (None, row), (col, None), (None, col), (None, None)]:
        f = jax.jit(lambda a, dims=dims: st.skew_weight_sharded(a, dims, mesh=mesh, row_axis=row, col_axis=col))
        wd = put(w, mesh, P(*dims))
        out = f(wd)
        np.testing.assert_array_equal(out, st.skew_weight(w, n), err_msg=str(dims))
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(row, col)), 2), dims
        colls = parse_collectives(f.lower(wd).compile().as_text(), mesh)
        assert [c.kind for c in colls] in ([], ["collective-permute"]), (dims, colls)
        assert colls or dims in [(None, col), (None, None)], dims  # only those need no traffic
        _, vjp = jax.vjp(f, wd)
        np.testing.assert_allclose(vjp(put(g, mesh, P(row, col)))[0], st.unskew_weight(g, n), err_msg=str(dims))


def check_numerics(
    n: int, mesh: Mesh, row: str, col: str, batch_axes=None, shape=(4, 2, 3, 5), seed: int = 2, row_dim: int = -2
) -> None:
    """O, dI, dW vs the unsharded reference, in the promised layouts, nothing replicated.
    row_dim=0: the grid rows split the batch dim (shape[0] is then per device, like bm)."""
    rng = np.random.default_rng(seed)
    b, bm, bn, bk = shape  # batch and per-device block sizes
    groups = mesh.shape[batch_axes] if batch_axes else 1
    if row_dim == 0:
        b *= n * groups
    lead = (b,) if b else ()
    i = rng.standard_normal((*lead, bm * n, bn * n)).astype(np.float32)
    w = rng.standard_normal((bn * n, bk * n)).astype(np.float32)
    g = rng.standard_normal((*lead, bm * n, bk * n)).astype(np.float32)
    x_spec = st._x_spec(i.ndim, row, col, batch_axes if b else None, row_dim)
    skew, unskew = (
        (st.skew_input, st.unskew_input)
        if row_dim == -2
        else (
            lambda x, n: rows_first(st.skew_input, x, n, groups),
            lambda x, n: rows_first(st.unskew_input, x, n, groups),
        )
    )
    args = (put(skew(i, n), mesh, x_spec), put(st.skew_weight(w, n), mesh, P(row, col)), put(g, mesh, x_spec))
    o, di, dw = fwd_bwd(mesh, row, col, batch_axes, row_dim)(*args)
    o_ref, di_ref, dw_ref = reference(i, w, g)
    assert rel_err(o, o_ref) <= RTOL, rel_err(o, o_ref)
    assert rel_err(unskew(di, n), di_ref) <= RTOL
    assert rel_err(st.unskew_weight(dw, n), dw_ref) <= RTOL
    # Gradients come back exactly as the inputs were laid out; every tensor is split n x n.
    assert di.sharding.is_equivalent_to(args[0].sharding, di.ndim)
    assert dw.sharding.is_equivalent_to(args[1].sharding, dw.ndim)
    for a in (o, di, dw):
        rows = 0 if row_dim == 0 and a is not dw else -2
        shard = a.sharding.shard_shape(a.shape)
        assert (shard[rows], shard[-1]) == (a.shape[rows] // (n * (groups if rows == 0 else 1)), a.shape[-1] // n)


def check_hlo(n: int, mesh: Mesh, row: str, col: str) -> None:
    """Forward + backward compile to collective-permutes only: 2 per step boundary per phase."""
    bm, bn, bk = 2, 3, 5
    x_spec = P(None, row, col)
    i = put(jnp.ones((2, bm * n, bn * n)), mesh, x_spec)
    w = put(jnp.ones((bn * n, bk * n)), mesh, P(row, col))
    g = put(jnp.ones((2, bm * n, bk * n)), mesh, x_spec)
    colls = parse_collectives(fwd_bwd(mesh, row, col).lower(i, w, g).compile().as_text(), mesh)
    assert {c.kind for c in colls} == {"collective-permute"}, {c.kind for c in colls}
    assert len(colls) == 6 * (n - 1), len(colls)
    # Only single blocks travel (I, W or dO block), never a gathered tensor.
    assert {c.elements for c in colls} <= {2 * bm * bn, bn * bk, 2 * bm * bk}, {c.elements for c in colls}


def check_model(n: int, mesh: Mesh, row: str, col: str, seed: int = 3, steps: int = 3, lr: float = 0.1) -> None:
    """x -> st_matmul(W1) -> relu -> skew_sharded -> st_matmul(W2) -> MSE, 3 SGD steps: same loss
    curve and final weights as the single-device model; weights live in the skewed layout."""
    rng = np.random.default_rng(seed)
    b, m, d, h = 4, 2 * n, 3 * n, 4 * n
    x = rng.standard_normal((b, m, d)).astype(np.float32)
    y = rng.standard_normal((b, m, d)).astype(np.float32)
    w1 = (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((h, d)) / np.sqrt(h)).astype(np.float32)
    kw = {"mesh": mesh, "row_axis": row, "col_axis": col}

    def loss_st(params, xs, y):
        hid = jax.nn.relu(st.st_matmul(xs, params[0], **kw))  # plain layout
        return jnp.mean((st.st_matmul(st.skew_sharded(hid, **kw), params[1], **kw) - y) ** 2)

    def loss_ref(params, x, y):
        return jnp.mean((jax.nn.relu(x @ params[0]) @ params[1] - y) ** 2)

    def sgd(loss_fn):
        @jax.jit
        def step(params, *batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
            return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

        return step

    x_spec = P(None, row, col)
    params = (put(st.skew_weight(w1, n), mesh, P(row, col)), put(st.skew_weight(w2, n), mesh, P(row, col)))
    batch = (put(st.skew_input(x, n), mesh, x_spec), put(y, mesh, x_spec))
    ref_params, ref_batch = (jnp.asarray(w1), jnp.asarray(w2)), (jnp.asarray(x), jnp.asarray(y))
    step, ref_step = sgd(loss_st), sgd(loss_ref)
    losses, ref_losses = [], []
    for _ in range(steps):
        params, loss = step(params, *batch)
        ref_params, ref_loss = ref_step(ref_params, *ref_batch)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert ref_losses[-1] < ref_losses[0]  # it actually trains
    assert rel_err(st.unskew_weight(params[0], n), ref_params[0]) <= RTOL
    assert rel_err(st.unskew_weight(params[1], n), ref_params[1]) <= RTOL
    # The whole training step reduces nothing but the scalar loss.
    colls = parse_collectives(step.lower(params, *batch).compile().as_text(), mesh)
    assert all(c.kind == "collective-permute" or c.elements == 1 for c in colls), colls


# ---------------------------------------------------------------- n = 2 in process

N2_AXES = ("st_row", "st_col")


@pytest.fixture(scope="module")
def mesh2() -> Mesh:
    assert jax.device_count() >= 4
    return grid_mesh(2, N2_AXES)


def test_layouts_n2():
    check_layouts(2)


@pytest.mark.parametrize("row_dim", [-2, 0])
def test_sharded_skew_n2(mesh2, row_dim):
    check_sharded_skew(2, mesh2, *N2_AXES, row_dim=row_dim)


def test_weight_skew_n2(mesh2):
    check_weight_skew(2, mesh2, *N2_AXES)


def test_numerics_n2_rows_on_batch(mesh2):
    check_numerics(2, mesh2, *N2_AXES, shape=(2, 3, 2, 4), row_dim=0)


@pytest.mark.parametrize("shape", [(4, 2, 3, 5), (0, 3, 2, 4)], ids=["batched", "2d"])
def test_numerics_n2(mesh2, shape):
    check_numerics(2, mesh2, *N2_AXES, shape=shape)


def test_numerics_n2_with_batch_axis():
    """Batch split over a third mesh axis: dW gets the (conventional) data-parallel psum."""
    mesh = grid_mesh(2, ("data", *N2_AXES), batch=2)
    check_numerics(2, mesh, *N2_AXES, batch_axes="data")
    check_numerics(2, mesh, *N2_AXES, batch_axes="data", shape=(1, 3, 2, 4), row_dim=0)


def test_hlo_n2(mesh2):
    check_hlo(2, mesh2, *N2_AXES)


def test_model_n2(mesh2):
    check_model(2, mesh2, *N2_AXES)


def test_rejects_non_square_grid():
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match="square"):
        st.st_matmul(jnp.ones((4, 8)), jnp.ones((8, 8)), mesh=mesh, row_axis="a", col_axis="b")


# ---------------------------------------------------------------- n = 4 in a 16-device subprocess

N4_AXES = ("data", "tensor")  # the axis names a model mesh would lend to the grid


def run_checks(n: int) -> dict[str, str]:
    mesh = grid_mesh(n, N4_AXES)
    checks = {
        "layouts": lambda: check_layouts(n),
        "sharded_skew": lambda: check_sharded_skew(n, mesh, *N4_AXES),
        "sharded_skew_rows_on_batch": lambda: check_sharded_skew(n, mesh, *N4_AXES, row_dim=0),
        "weight_skew": lambda: check_weight_skew(n, mesh, *N4_AXES),
        "numerics_rows_on_batch": lambda: check_numerics(n, mesh, *N4_AXES, shape=(1, 2, 3, 2), row_dim=0),
        "numerics": lambda: check_numerics(n, mesh, *N4_AXES),
        "numerics_2d": lambda: check_numerics(n, mesh, *N4_AXES, shape=(0, 1, 2, 3)),
        "hlo": lambda: check_hlo(n, mesh, *N4_AXES),
        "model": lambda: check_model(n, mesh, *N4_AXES),
    }
    out = {}
    for name, fn in checks.items():
        try:
            fn()
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - report every check, not just the first failure
            out[name] = traceback.format_exc()
    return out


N4_CHECKS = [
    "layouts",
    "sharded_skew",
    "sharded_skew_rows_on_batch",
    "weight_skew",
    "numerics",
    "numerics_rows_on_batch",
    "numerics_2d",
    "hlo",
    "model",
]


@pytest.fixture(scope="module")
def n4_results() -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=16").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.mark.parametrize("name", N4_CHECKS)
def test_n4(n4_results, name):
    assert n4_results[name] == "ok", n4_results[name]


if __name__ == "__main__":  # the subprocess: XLA_FLAGS already asks for 16 devices
    n_grid = int(sys.argv[1])
    assert jax.device_count() >= n_grid * n_grid, jax.device_count()
    print("RESULTS " + json.dumps(run_checks(n_grid)))
