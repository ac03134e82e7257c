"""Tensor-train and sparse + low-rank linear kinds against float64 references written from their
definitions (a dense matrix built independently of the kinds' code), and their checkpoints."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests_support import metric_rows

from boost_jax import train
from boost_jax.config import base_config
from boost_jax.errors import ConfigError
from boost_jax.model.kinds.tt import balanced_factors, tt_shapes
from boost_jax.model.linear import Projection, project
from boost_jax.validate import validate


def model_section(kind, **fields):
    m = base_config().model
    m.update(linear=kind, **fields)
    return m


def params_of(proj):
    return {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(proj)).items()}


def check_layer(proj, reference, d_in, rtol=1e-5):
    """Value and gradients (input and every trainable parameter) against `reference(x, params)`
    evaluated in float64."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, d_in)).astype(np.float32)
    graphdef, state = nnx.split(proj)
    params = nnx.to_pure_dict(state)
    trained = {k: v for k, v in params.items() if jnp.issubdtype(v.dtype, jnp.inexact)}
    fixed = {k: v for k, v in params.items() if k not in trained}
    cot = rng.standard_normal((2, 3, proj.d_out)).astype(np.float32)

    def ours(x, t):
        return project([nnx.merge(graphdef, {**t, **fixed})], x, grouped=False)[0]

    def ref(x, t):
        return reference(x, {**{k: jnp.asarray(v) for k, v in fixed.items()}, **t})

    got, vjp = jax.vjp(ours, jnp.asarray(x), trained)
    with jax.enable_x64():
        t64 = jax.tree.map(lambda v: jnp.asarray(v, jnp.float64), trained)
        want, vjp64 = jax.vjp(ref, jnp.asarray(x, jnp.float64), t64)
        grads64 = vjp64(jnp.asarray(cot, jnp.float64))
        want, grads64 = np.asarray(want), jax.tree.map(np.asarray, grads64)
    grads = jax.tree.map(np.asarray, vjp(jnp.asarray(cot)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol * np.abs(want).max())
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads64)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max(), err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------------------------- tensor train


def test_balanced_factors_are_exact_and_most_equal():
    for n, k in itertools.product([1, 7, 12, 64, 96, 360, 1344, 1376], [1, 2, 3]):
        got = balanced_factors(n, k)
        assert len(got) == k and math.prod(got) == n and list(got) == sorted(got, reverse=True)
        # brute force: no k-factorisation of n has a smaller largest factor
        best = (
            min(max(c) for c in itertools.product(range(1, n + 1), repeat=k) if math.prod(c) == n)
            if n <= 96
            else got[0]
        )
        assert got[0] == best


def tt_dense(p, h, d_in, d_out):
    """The TT's d_in x r_mid and r_mid x d_out halves from one einsum each over all cores: input index
    (i_1 .. i_h) with i_1 most significant, output index (o_h .. o_1) with o_h most significant."""
    letters = "abcdefghijkl"
    ins = [p[f"in_{k}"] for k in range(h)]
    outs = [p[f"out_{k}"] for k in range(h)]
    bonds = letters[: h + 1]  # bonds[0] = boundary (size 1), bonds[h] = r_mid
    modes = "mnopqr"[:h]
    spec = ",".join(f"{bonds[k]}{modes[k]}{bonds[k + 1]}" for k in range(h))
    m1 = jnp.einsum(f"{spec}->{bonds[0]}{modes}{bonds[h]}", *ins)[0].reshape(d_in, -1)
    obonds = "STUVWX"[: h + 1]  # obonds[0] = r_mid, obonds[h] = boundary
    omodes = "tuvwxy"[:h]
    ospec = ",".join(f"{obonds[k]}{omodes[k]}{obonds[k + 1]}" for k in range(h))
    m2 = jnp.einsum(f"{ospec}->{obonds[0]}{omodes[::-1]}{obonds[h]}", *outs)[..., 0].reshape(-1, d_out)
    return m1, m2


@pytest.mark.parametrize("cores,activation", [(2, "none"), (4, "silu"), (6, "none"), (6, "silu")])
def test_tt_layer_matches_reconstruction(cores, activation):
    d_in, d_out, r = 48, 40, 6
    m = model_section("tt", rank=r, tt_cores=cores, tt_inner_rank=3, tt_activation=activation)
    proj = Projection(m, d_in, d_out, axes=("embed", "mlp"), group="mlp_in", rngs=nnx.Rngs(params=2))
    h = cores // 2
    shapes = [params_of(proj)[f"in_{k}"].shape for k in range(h)] + [
        params_of(proj)[f"out_{k}"].shape for k in range(h)
    ]
    first, second = tt_shapes(m, d_in, d_out)
    assert shapes == first + second and first[-1][-1] == second[0][0] == r

    def reference(x, p):
        m1, m2 = tt_dense(p, h, d_in, d_out)
        z = x @ m1
        return (jax.nn.silu(z) if activation == "silu" else z) @ m2

    check_layer(proj, reference, d_in)


def test_tt_init_keeps_dense_variance():
    """E[W_ij²] of the reconstructed weight is the dense init's 1/(d_in + d_out) (averaged over seeds:
    a product of Gaussian cores is heavy-tailed, one draw is noisy)."""
    d_in, d_out = 96, 64
    m = model_section("tt", rank=16, tt_cores=6, tt_inner_rank=6)
    second_moments = []
    for seed in range(48):
        proj = Projection(m, d_in, d_out, axes=("embed", "mlp"), group="mlp_in", rngs=nnx.Rngs(params=seed))
        m1, m2 = tt_dense({k: jnp.asarray(v) for k, v in params_of(proj).items()}, 3, d_in, d_out)
        second_moments.append(float(np.mean(np.asarray(m1 @ m2) ** 2)))
    assert abs(np.mean(second_moments) * (d_in + d_out) - 1) < 0.12, np.mean(second_moments) * (d_in + d_out)


def test_tt_config_errors_name_the_field():
    c = base_config()
    c.model.update(linear="tt", tt_cores=3)
    with pytest.raises(ConfigError, match="model.tt_cores"):
        validate(c)
    c.model.update(tt_cores=4, tt_activation="relu")
    with pytest.raises(ConfigError, match="model.tt_activation"):
        validate(c)


# --------------------------------------------------------------------------- sparse + low-rank


@pytest.mark.parametrize("block", [1, 4])
def test_sltrain_layer_matches_dense_formula(block):
    d_in, d_out, r = 32, 48, 6
    m = model_section("sltrain", rank=r, sparse_block=block, sparse_density=0.2, sltrain_alpha=4.0)
    proj = Projection(m, d_in, d_out, axes=("embed", "mlp"), group="mlp_in", rngs=nnx.Rngs(params=5))
    proj.b[...] = jnp.asarray(np.random.default_rng(1).standard_normal((r, d_out)).astype(np.float32))
    p = params_of(proj)
    nb = p["s"].shape[0]
    assert nb == round(0.2 * (d_in // block) * (d_out // block))
    pairs = set(zip(p["s_in"].tolist(), p["s_out"].tolist()))
    assert len(pairs) == nb  # distinct blocks

    def reference(x, p):
        dense = jnp.zeros((d_in // block, d_out // block, block, block), x.dtype)
        dense = dense.at[p["s_in"], p["s_out"]].set(p["s"]).transpose(0, 2, 1, 3).reshape(d_in, d_out)
        return 4.0 / r * (x @ p["a"]) @ p["b"] + x @ dense

    check_layer(proj, reference, d_in)


def test_sltrain_support_differs_per_layer_and_is_not_trained(make_config):
    from boost_jax.model import build_model

    cfg = make_config(**{"model.linear": "sltrain", "model.sparse_block": 4, "model.sparse_density": 0.2})
    state = nnx.to_pure_dict(nnx.state(build_model(cfg.model)))
    s_in = np.asarray(state["layers"]["attn"]["q"]["s_in"])  # [layers, blocks]
    assert s_in.dtype == np.int32 and not np.array_equal(s_in[0], s_in[1])


@pytest.mark.parametrize("linear", ["tt", "sltrain"])
def test_kind_resumes_bit_for_bit(make_config, tmp_path, linear):
    """A run stopped and resumed from its checkpoint continues exactly (the sltrain support is part of
    the saved state: its integer arrays are restored with the parameters)."""
    kw = {
        "model.linear": linear,
        "model.sparse_block": 4,
        "train.log_every": 1,
        "train.steps": 4,
        "train.eval_every": 0,
        "checkpoint.every": 2,
        "parallel.num_devices": 1,
    }
    straight = make_config(run_dir=str(tmp_path / "a"), **kw)
    train.run(straight)
    split = make_config(run_dir=str(tmp_path / "b"), **kw, **{"train.stop_at_step": 2})
    train.run(split)
    split.train.stop_at_step = 0
    train.run(split)
    a, b = metric_rows(tmp_path / "a"), metric_rows(tmp_path / "b")
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]


@pytest.mark.parametrize("linear", ["dense", "lowrank", "cola", "tt", "sltrain"])
def test_kind_parameter_counts_match_the_state(linear):
    """Each kind's n_params, summed over a block's projections, is what the model really holds."""
    from boost_jax.model import build_model
    from boost_jax.model.kinds import kind_class
    from boost_jax.model.transformer import projection_shapes

    m = model_section(
        linear,
        d_model=96,
        d_ff=160,
        n_heads=4,
        n_kv_heads=2,
        rank=12,
        n_layers=2,
        tt_cores=6,
        tt_inner_rank=5,
        sparse_block=4,
    )
    state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(m))))
    layer = state["layers"]
    proj = {**{k: layer["attn"][k] for k in "qkvo"}, **{k: layer["mlp"][k] for k in ("gate", "up", "down")}}
    held = sum(math.prod(x.shape) for x in jax.tree.leaves(proj) if jnp.issubdtype(x.dtype, jnp.inexact))
    want = m.n_layers * sum(kind_class(linear).n_params(m, a, b) for a, b in projection_shapes(m))
    assert held == want
