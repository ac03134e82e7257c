"""Linear-layer grouping (fewer dots, same outputs) and activation checkpointing policies (same
gradients; under BTP the low-rank policy recomputes without any collective)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.model import autos, model_from_config
from boost_jax.parallel.mesh import BATCH_AXES
from boost_jax.runtime.build import build
from boost_jax.runtime.step import next_token_loss
from boost_jax.tools.hlo_comm import parse_collectives

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 17)), jnp.int32)


def one_layer(make_config, **kw):
    return make_config(**{"model.n_layers": 1, "parallel.num_devices": 1, "parallel.data": 1, **kw})


def count_dots(hlo: str) -> int:
    return len(re.findall(r"\bdot\(", hlo))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_grouping_uses_fewer_dots_and_same_outputs(make_config, kv_heads):
    outs, dots = {}, {}
    for grouped in (True, False, "first"):
        cfg = one_layer(make_config, **{"model.group_linears": grouped, "model.n_kv_heads": kv_heads})
        model = model_from_config(autos.apply(cfg, autos.chosen(cfg)))  # `auto` resolved for one device
        graphdef, params = nnx.split(model)
        fwd = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[0])
        outs[grouped] = np.asarray(fwd(params, TOKENS[:, :-1]))
        dots[grouped] = count_dots(fwd.lower(params, TOKENS[:, :-1]).compile().as_text())
    np.testing.assert_allclose(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs["first"], outs[False], rtol=1e-5, atol=1e-5)
    # Ungrouped: 7 projections x 2 factors + 2 attention einsums + head = 17 dots.
    assert dots[False] == 17
    assert dots[True] < dots[False]
    assert dots["first"] == 17 - 3  # q/k/v's A's one dot, gate/up's one dot; every B its own


def test_first_stages_grouped_keep_gradients(make_config):
    """group_linears=first: the stacked A's gradients (and the input's, one GEMM) equal the ungrouped."""
    base = grads_under(one_layer(make_config, **{"model.group_linears": False}))
    got = grads_under(one_layer(make_config, **{"model.group_linears": "first"}))
    assert jax.tree.structure(got) == jax.tree.structure(base)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def grads_under(cfg):
    model = model_from_config(autos.apply(cfg, autos.chosen(cfg)))
    graphdef, params = nnx.split(model)
    return jax.jit(jax.grad(lambda p, t: next_token_loss(graphdef, p, t)))(params, TOKENS)


@pytest.mark.parametrize("policy", ["full", "dots", "lowrank", "offload_lowrank"])
def test_remat_policies_keep_gradients(make_config, policy):
    base = grads_under(make_config(**{"parallel.num_devices": 1, "parallel.data": 1}))
    got = grads_under(make_config(**{"parallel.num_devices": 1, "parallel.data": 1, "remat.policy": policy}))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def btp_grad_collectives(make_config, policy):
    cfg = make_config(
        **{
            "parallel.strategy": "btp",
            "parallel.data": 2,
            "parallel.tensor": 4,
            "remat.policy": policy,
            "model.d_model": 64,
            "model.n_heads": 8,
            "model.n_kv_heads": 8,
            "model.d_ff": 128,
            "model.rank": 16,
        }
    )
    built = build(cfg)
    spec, mesh = built.spec, built.mesh
    tokens = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=NamedSharding(mesh, P(BATCH_AXES)))
    fn = jax.jit(jax.grad(built.loss_fn()))
    hlo = fn.lower(spec.abstract["params"], tokens).compile().as_text()
    found = parse_collectives(hlo, mesh)
    return sorted((c.kind, c.elements) for c in found if c.axes == ("tensor",))


def test_lowrank_remat_recomputes_without_collectives_under_btp(make_config):
    none = btp_grad_collectives(make_config, "none")
    assert btp_grad_collectives(make_config, "lowrank") == none
    assert len(btp_grad_collectives(make_config, "full")) > len(none)  # full remat re-runs the all-reduces
