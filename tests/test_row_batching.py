"""vmap of a norm kernel whose primitive has no batching rule (boost_jax/kernels/row_batching.py).

The stand-in kernel is a numpy RMSNorm (float64) behind `jax.pure_callback` without a vmap method,
which, like a jax-triton call, refuses to be batched; wrapped by `row_batching`, it runs under the
vmaps the trainer puts around the model (a shared scale in the data-parallel gradient island,
per-stage scales in a pipeline, nested vmaps) and its gradients match plain jnp's on fresh inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.kernels import row_batching
from boost_jax.kernels.rmsnorm import rmsnorm_reference

EPS = 1e-6


def _np_fwd(x, w):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    s = (x * x).sum(-1)
    return (x / np.sqrt(s / x.shape[-1] + EPS)[:, None] * w).astype(np.float32), s.astype(np.float32)


def _np_bwd(x, w, dy, ds):
    x, w, dy, ds = (np.asarray(a, np.float64) for a in (x, w, dy, ds))
    d = x.shape[-1]
    r = 1 / np.sqrt((x * x).sum(-1) / d + EPS)
    c = (dy * w * x).sum(-1) * r**3 / d
    dx = dy * w * r[:, None] - x * c[:, None] + 2 * x * ds[:, None]
    return dx.astype(np.float32), (dy * x * r[:, None]).sum(0).astype(np.float32)


def _unbatchable(fn, *shapes):
    """`fn` through pure_callback with no vmap method: vmap raises unless a custom rule intervenes."""
    return lambda *args: jax.pure_callback(fn, [jax.ShapeDtypeStruct(s(*args), jnp.float32) for s in shapes], *args)


_FWD = row_batching.forward(_unbatchable(_np_fwd, lambda x, w: x.shape, lambda x, w: x.shape[:1]))
_BWD = row_batching.backward(_unbatchable(_np_bwd, lambda x, *_: x.shape, lambda x, w, *_: w.shape))


@jax.custom_vjp
def kernel_norm(x2, w):
    return _FWD(x2, w)


kernel_norm.defvjp(lambda x2, w: (_FWD(x2, w), (x2, w)), lambda res, cts: _BWD(res[0], res[1], *cts))


def _loss(norm, w, x, probe):
    """A loss through both outputs: y feeds a product with `probe`, s a small term."""
    y, s = norm(x.reshape(-1, x.shape[-1]), w)
    return (y.reshape(x.shape) * probe).sum() + 1e-3 * s.sum()


_KERNEL = functools.partial(_loss, kernel_norm)
_REFERENCE = functools.partial(_loss, lambda x2, w: rmsnorm_reference(x2, w, EPS))


def _inputs(seed, *lead, d=24):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (*lead, 5, d))
    return x, 1 + 0.1 * jax.random.normal(k[1], (d,)), jax.random.normal(k[2], x.shape)


def test_the_stand_in_refuses_vmap_without_the_rule():
    x, w, _ = _inputs(0, 3)
    bare = _unbatchable(_np_fwd, lambda x, w: x.shape, lambda x, w: x.shape[:1])
    with pytest.raises(NotImplementedError):
        jax.vmap(bare, in_axes=(0, None))(x, w)


@pytest.mark.parametrize("replicas", [1, 3])
def test_gradient_island_shape_shared_scale(replicas):
    """vmap(grad) over replicas with one scale (the data-parallel gradient island): per-replica grads."""
    x, w, probe = _inputs(replicas, replicas)
    grad = jax.grad(_KERNEL, argnums=(0, 1))
    ref = jax.grad(_REFERENCE, argnums=(0, 1))
    got = jax.jit(jax.vmap(grad, in_axes=(None, 0, 0)))(w, x, probe)
    want = jax.vmap(ref, in_axes=(None, 0, 0))(w, x, probe)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)
    assert got[0].shape == (replicas, *w.shape)  # dscale stays per replica


def test_pipeline_shape_per_stage_scales_and_nested_vmaps():
    """vmap over stages (each its own scale) of vmap over replicas (shared within a stage), forward
    and grad, and grad of the vmapped loss from outside."""
    stages, replicas = 2, 3
    x, _, probe = _inputs(7, stages, replicas)
    w = 1 + 0.1 * jax.random.normal(jax.random.key(8), (stages, x.shape[-1]))

    def per_stage(fn):
        return jax.vmap(jax.vmap(jax.grad(fn, argnums=(0, 1)), in_axes=(None, 0, 0)), in_axes=(0, 0, 0))

    got = jax.jit(per_stage(_KERNEL))(w, x, probe)
    want = per_stage(_REFERENCE)(w, x, probe)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)

    def total(fn):
        return lambda w, x, p: jax.vmap(jax.vmap(fn, in_axes=(None, 0, 0)))(w, x, p).sum()

    got = jax.grad(total(_KERNEL), argnums=(0, 1))(w, x, probe)
    want = jax.grad(total(_REFERENCE), argnums=(0, 1))(w, x, probe)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)
