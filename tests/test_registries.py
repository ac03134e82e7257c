"""Each registry is the one source of its names: an attention implementation, a linear kind and a
strategy registered from this file alone run through config validation, the trainer's step, the
comm report and the planner, with nothing else changed anywhere.

- toy attention: causal softmax attention written here in plain jnp (repeating KV heads, unlike the
  xla implementation's grouped einsum), priced by the planner as "materialized";
- toy kind: a low-rank B·relu(A·x) projection declared here (its parameters, axes, FLOPs, counts);
- toy strategy: BTP's rule table under a new name, priced by the planner as BTP.
The math each computes is checked against an independent formula or the twin it copies.
"""
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boost_jax.model import attention, kinds
from boost_jax.model.kinds.base import LinearKind, factor_init
from boost_jax.parallel import strategies
from boost_jax.runtime.build import build
from boost_jax.validate import validate

ROOT = Path(__file__).resolve().parents[1]


def toy_attention(q, k, v, offset):
    """Causal attention with KV heads repeated to the query heads, float32 softmax."""
    b, t, h, dh = q.shape
    s = k.shape[1]
    rep = h // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) / np.sqrt(dh)
    visible = (offset + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v.astype(jnp.float32)).astype(q.dtype)


class ToyReluLowRank(LinearKind):
    """y = relu(x·A)·B: a bottleneck kind declared entirely in this test file."""

    def __init__(self, m, d_in, d_out, *, axes, group, rngs, param_dtype):
        super().__init__(m, d_in, d_out, axes=axes, group=group, rngs=rngs, param_dtype=param_dtype)
        r = self.width
        self.a = nnx.Param(factor_init(rngs.params(), (d_in, r), d_in, d_out, r, param_dtype), axes=self.first_axes)
        self.b = nnx.Param(factor_init(rngs.params(), (r, d_out), d_in, d_out, r, param_dtype), axes=self.second_axes)

    @classmethod
    def n_params(cls, m, d_in, d_out):
        return int(m.rank) * (d_in + d_out)

    @classmethod
    def nonlinear(cls, m):
        return True

    def first_weight(self, use):
        return use(self.a[...], self.first_axes)

    def second_weight(self, use):
        return use(self.b[...], self.second_axes)

    def bottleneck(self, h):
        return jax.nn.relu(h)


@pytest.fixture
def toys():
    """Register the three toys for one test, and remove them again."""
    attention.implementation("toy_attention", cost="materialized")(toy_attention)
    kinds.register("toy_relu_lowrank", ToyReluLowRank)
    strategies.register(dataclasses.replace(strategies.registered("btp"), name="toy_btp"))
    try:
        yield
    finally:
        attention.IMPLEMENTATIONS.pop("toy_attention")
        kinds.REGISTRY.pop("toy_relu_lowrank")
        strategies.REGISTRY.pop("toy_btp")


def small(make_config, **kw):
    return make_config(**{"parallel.data": 2, "parallel.tensor": 4, "model.n_kv_heads": 4, **kw})


def first_losses(cfg, steps=2):
    built = build(cfg)
    state = built.init_state()
    rng = np.random.default_rng(0)
    t = cfg.train
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, cfg.model.vocab_size, (t.grad_accum, t.global_batch // t.grad_accum, t.seq_len + 1),
                              dtype=np.int32)
        state, metrics = built.train_step(state, jax.device_put(tokens, built.batch_sharding))
        out.append(float(metrics["loss"]))
    return np.array(out)


def test_unregistered_names_are_config_errors(make_config):
    from boost_jax.errors import ConfigError
    for field, value in (("model.attention", "toy_attention"), ("model.linear", "toy_relu_lowrank"),
                         ("parallel.strategy", "toy_btp")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            validate(make_config(**{field: value}))


def test_toys_run_the_trainers_step(make_config, toys):
    """The toy attention and strategy train exactly as their twins (xla attention, btp); the toy kind
    trains (finite, decreasing) and its projection is relu(x·A)·B."""
    base = first_losses(small(make_config))
    np.testing.assert_allclose(first_losses(small(make_config, **{"model.attention": "toy_attention"})), base,
                               rtol=1e-5)
    np.testing.assert_array_equal(first_losses(small(make_config, **{"parallel.strategy": "toy_btp"})), base)
    toy = first_losses(small(make_config, **{"model.linear": "toy_relu_lowrank"}), steps=3)
    assert np.all(np.isfinite(toy)) and toy[-1] < toy[0], toy

    from boost_jax.model.linear import Projection, project
    m = small(make_config, **{"model.linear": "toy_relu_lowrank"}).model
    proj = Projection(m, 16, 24, axes=("embed", "mlp"), group="mlp_in", rngs=nnx.Rngs(params=1))
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    want = np.maximum(x @ np.asarray(proj.a[...], np.float64), 0) @ np.asarray(proj.b[...], np.float64)
    np.testing.assert_allclose(np.asarray(project([proj], jnp.asarray(x))[0]), want, rtol=1e-5, atol=1e-6)


def test_toys_in_the_comm_report(toys):
    """The report takes the registered names: the toy strategy moves BTP's 7r per token per layer
    forward, with the toy kind and the toy attention too."""
    from boost_jax.config import base_config
    from boost_jax.tools import comm_report
    c = base_config()
    r = 32
    c.model.update(d_model=128, n_heads=4, n_kv_heads=4, d_ff=256, rank=r, n_layers=2, vocab_size=512,
                   max_seq_len=64, attention="toy_attention")
    rep = comm_report.report(c, mesh=(1, 1, 4), strategies="toy_btp,toy_btp:toy_relu_lowrank", batch=2, seq=64,
                             dtype="float32", memory=False, programs=("forward",))
    for col in rep["strategies"].values():
        fwd = col["per_layer_forward"]["tensor"]
        assert fwd["elements_per_token"] == pytest.approx(7 * r + 2)  # + one norm statistic per norm


def test_toys_in_the_planner(toys):
    """The planner prices the toy strategy as BTP, the toy attention as materialised scores (as xla),
    the toy kind through its declared interface; a search over the toy kind and attention runs."""
    from boost_jax.config import sized_config
    from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for, search
    from boost_jax.planner import partitions as P
    cluster = load_cluster(str(ROOT / "configs" / "clusters" / "a100_4x.py"))
    cfg = sized_config("1b", "cola")
    opts = dict(batch=64, seq=2048, check_memory=False)
    price = lambda strategy, attn, c=cfg: plan_for(  # noqa: E731
        c, cluster, Mesh(1, 1, 4), 1, "none", Layer(*P.uniform_plan(strategy)), Options(attention=attn, **opts), 1.0)
    assert price("toy_btp", "toy_attention").step_s == pytest.approx(price("btp", "xla").step_s)
    toy = cfg.copy_and_resolve_references()
    toy.model.linear = "toy_relu_lowrank"
    assert price("toy_btp", "xla", toy).step_s == pytest.approx(price("btp", "xla").step_s)  # same shapes
    res = search(toy, cluster, 8, Options(batch=64, seq=2048, attention="toy_attention", top=40), 1.0)
    assert any(p.runnable == "yes" for p in res.plans)
