"""parallel/placement.py `PerShardNorm`: a kernel norm run per shard equals the norm on one device (value and
gradients, float64 reference); under tensor parallelism alone (Megatron's and vanilla's replicated rows)
its backward all-reduces nothing; rows split over `data` sum the scale's gradient there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.config import base_config
from boost_jax.parallel import rules
from boost_jax.parallel.mesh import AXES
from boost_jax.parallel.placement import PerShardNorm
from boost_jax.parallel.strategies import get_strategy
from boost_jax.tools.hlo_comm import parse_collectives

NAMES = ("act_batch", "act_res_seq", "act_embed")
EPS = 1e-6


def rows(x, scale, impl=None):
    """A plain-jnp stand-in for the kernel (statistics in float32)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS) * scale).astype(x.dtype)


def reference(x, scale, g):
    """(y, dx, dscale) in float64 numpy."""
    x, scale, g = (np.asarray(a, np.float64) for a in (x, scale, g))
    inv = 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS)
    y = x * inv * scale
    dscale = (g * x * inv).sum((0, 1))
    gs = g * scale
    dx = inv * gs - x * inv**3 * np.mean(gs * x, -1, keepdims=True)
    return y, dx, dscale


@pytest.mark.parametrize("sizes", [(1, 1, 1, 1, 4), (1, 2, 1, 1, 2)], ids=["tensor4", "data2_tensor2"])
def test_per_shard_norm_equals_one_device_and_sends_nothing_under_tensor_alone(sizes):
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(sizes), AXES)
    p = base_config().parallel
    p.strategy = "megatron"
    strategy = get_strategy(p)
    k = jax.random.split(jax.random.key(sum(sizes)), 3)
    x = jax.random.normal(k[0], (4, 8, 32), jnp.float32)
    scale = 1 + 0.1 * jax.random.normal(k[1], (32,), jnp.float32)
    g = jax.random.normal(k[2], x.shape, jnp.float32)

    def loss(x, scale):
        with rules.use_rules(mesh, strategy):
            y = PerShardNorm(mesh)(rows, x, scale, NAMES)
        return jnp.sum(y * g), y

    placed = jax.device_put(x, NamedSharding(mesh, P("data")))
    fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    (dx, dscale), y = fn(placed, scale)
    ry, rdx, rdscale = reference(x, scale, g)
    np.testing.assert_allclose(y, ry, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dx, rdx, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(dscale, rdscale, rtol=2e-4, atol=2e-4)
    colls = parse_collectives(fn.lower(placed, scale).compile().as_text(), mesh)
    if sizes[1] == 1:
        assert colls == [], colls
    else:  # rows split over data: the scale's gradient is summed there
        assert [c for c in colls if c.kind == "all-reduce" and "data" in c.axes], colls
