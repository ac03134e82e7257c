"""The MLP's gate·up product kernel (boost_jax/kernels/gate.py): the Pallas kernels under the
interpreter against float64 numpy, forward and gradient, on fresh random inputs; under nested vmap;
the model with the kernel against XLA's product; its sm_90 compile on this CPU host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.kernels.gate import gate_product, gate_reference


def _np_gate(g, u, dh, act):
    """float64: (h, dg, du) of h = act(g)·u against the cotangent dh."""
    g, u, dh = (np.asarray(a, np.float64) for a in (g, u, dh))
    if act == "silu":
        sig = 1 / (1 + np.exp(-g))
        a, da = g * sig, sig * (1 + g * (1 - sig))
    else:
        a, da = g, np.ones_like(g)
    return a * u, dh * u * da, dh * a


def _inputs(shape, dtype, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k[i], shape, jnp.float32).astype(dtype) for i in range(3))


def _close(got, want, tol):
    got, want = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


@pytest.mark.parametrize("act", ["none", "silu"])
@pytest.mark.parametrize(
    "shape,dtype,tol",
    [((3, 5, 37), jnp.float32, 1e-6), ((2, 4096 + 3), jnp.float32, 1e-6), ((7,), jnp.float32, 1e-6)]
    + [((4, 9, 130), jnp.bfloat16, 1e-2)],
    ids=["rows", "past_one_block", "tiny", "bf16"],
)
def test_gate_kernel_matches_float64(act, shape, dtype, tol):
    """Forward and both gradients, on shapes that fill no power-of-two block (the last block overlaps
    the one before it and masks what that one wrote)."""
    g, u, dh = _inputs(shape, dtype, seed=len(shape) + shape[-1])
    h, pull = jax.vjp(lambda g, u: gate_product(g, u, act, impl="pallas", interpret=True), g, u)
    assert h.dtype == dtype
    want = _np_gate(g.astype(jnp.float32), u.astype(jnp.float32), dh.astype(jnp.float32), act)
    for got, w in zip((h, *pull(dh)), want):
        _close(got, w, tol)


def test_gate_kernel_under_nested_vmap():
    """The data-parallel island's vmap and a pipeline's (nested), with one input shared by the batch:
    loss and gradients equal plain jnp's."""
    k = jax.random.split(jax.random.key(11), 3)
    g, probe = (jax.random.normal(k[i], (2, 3, 5, 24)) for i in range(2))
    u = jax.random.normal(k[2], (5, 24))  # unbatched: broadcast by the vmap rule

    def run(product):
        loss = lambda g, u, p: (product(g, u) * p).sum()  # noqa: E731
        grads = jax.value_and_grad(loss, argnums=(0, 1))
        return jax.jit(jax.vmap(jax.vmap(grads, (0, None, 0)), (0, None, 0)))(g, u, probe)

    got = run(lambda g, u: gate_product(g, u, "silu", impl="pallas", interpret=True))
    want = run(lambda g, u: gate_reference(g, u, "silu"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _close(a, b, 1e-5)


def test_gate_kernel_refuses_an_unknown_impl():
    g = jnp.ones((4,))
    with pytest.raises(ValueError, match="model.gate_kernel='triton'"):
        gate_product(g, g, impl="triton")


@pytest.mark.parametrize("only_lr_act", [True, False], ids=["gate_times_up", "swiglu"])
def test_the_model_with_the_gate_kernel_equals_xlas_product(make_config, only_lr_act):
    """A cola model whose MLP runs the kernel (interpreted) computes XLA's logits and gradients."""
    from flax import nnx

    from boost_jax.model import build_model

    cfg = make_config(**{"model.n_layers": 2, "model.only_lr_act": only_lr_act})
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 256, (2, 12)))
    probe = jax.random.normal(jax.random.key(8), (2, 12, cfg.model.vocab_size))
    runs = {}
    for impl in ("pallas", "xla"):
        cfg.model.gate_kernel = impl
        graphdef, state = nnx.split(build_model(cfg.model, seed=3))

        def loss(state, graphdef=graphdef):
            logits, _ = nnx.merge(graphdef, state)(tokens)
            return (logits * probe).sum(), logits

        runs[impl] = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    (_, got), got_grads = runs["pallas"]
    (_, want), want_grads = runs["xla"]
    _close(got, want, 1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        _close(a, b, 1e-4)


def test_gate_kernels_compile_for_h100_without_a_gpu():
    """Both kernels lower through Pallas's Triton backend for a deviceless H100 (bf16, a shape that
    is no multiple of the block): the program holds them as named Triton calls."""
    from jax.sharding import SingleDeviceSharding

    from boost_jax.kernels import platform
    from boost_jax.tools import aot

    dev = aot.devices("h100", 1)[0]
    x = jax.ShapeDtypeStruct((3, 100, 547), jnp.bfloat16, sharding=SingleDeviceSharding(dev))

    def step(g, u, dh):
        h, pull = jax.vjp(lambda g, u: gate_product(g, u, "silu", impl="pallas"), g, u)
        return h, pull(dh)

    with platform.target([dev]):  # what the builder sets: the kernels (and their probe) compile for the H100
        text = jax.jit(step).lower(x, x, x).compile().as_text()
    kernels = aot.kernels(text)
    assert kernels.get("triton kernel gate_fwd") == 1 and kernels.get("triton kernel gate_bwd") == 1, kernels


def test_a_jax_without_pallas_triton_runs_xlas_product_loudly(monkeypatch):
    """Where the kernels cannot compile (here: no Pallas Triton backend), XLA's product runs, with a
    warning naming why."""
    from boost_jax.kernels import gate

    monkeypatch.setattr(gate, "plgpu", None)
    monkeypatch.setattr(gate, "_LOWERS", {})
    g, u, dh = _inputs((3, 17), jnp.float32, seed=21)
    with pytest.warns(UserWarning, match="no Pallas Triton backend"):
        h, pull = jax.vjp(lambda g, u: gate_product(g, u, "silu", impl="pallas"), g, u)
    for got, want in zip((h, *pull(dh)), _np_gate(g, u, dh, "silu")):
        _close(got, want, 1e-6)
