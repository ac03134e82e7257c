"""Each registry is the one source of its names: an attention implementation, a linear kind and a
strategy registered from this file alone run through config validation, the trainer's step, the
comm report and the planner, with nothing else changed anywhere.

- toy attention: causal softmax attention written here in plain jnp (repeating KV heads, unlike the
  xla implementation's grouped einsum), with a cost class of its own (scores in blocks of 128 keys);
- toy kind: a low-rank B·relu(A·x) projection declared here (its parameters, axes, FLOPs, counts);
- toy strategy: a rule table no registered strategy has: BTP's MLP (row-parallel A, r-wide
  all-reduce, column-parallel B) with the attention replicated over `tensor` (its qkv A row-parallel
  with an all-reduce of its 3r outputs, its o B column-parallel), as one would run heads that the
  tensor size does not divide. The planner reads its layout from the table alone.
The math each computes is checked against an independent formula or the twin it copies.
"""
import ast
import io
import tokenize
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boost_jax.model import attention, kinds
from boost_jax.model.kinds.base import LinearKind, factor_init
from boost_jax.parallel import strategies
from boost_jax.parallel.strategies import BATCH
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


# The MLP and residual split along d as BTP splits them; the heads (and so q, k, v, the attention and
# o's input) whole on every tensor shard: qkv's A is row-parallel over d, o's B column-parallel over d.
TOY_RULES = (
    ("embed", "tensor"), ("norm", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
    ("act_embed", "tensor"), ("act_mlp", "tensor"), ("act_vocab", "tensor"),
    ("act_heads", None), ("act_kv_heads", None), ("act_rank", None),
    ("embed", "fsdp"), ("rank", "fsdp"), ("heads", "fsdp"), ("kv_heads", "fsdp"), ("mlp", "fsdp"),
    ("vocab_in", "fsdp"), ("head_embed", "fsdp"), ("vocab", "fsdp"), ("act_batch", BATCH),
    ("layers", "pipeline"), ("head_norm", None), ("act_seq", None), ("act_res_seq", None),
)
# Scores in blocks of 128 keys, recomputed three times in the backward; what it keeps as the chunked class.
TOY_COST = attention.CostClass("toy_blocks", backward=3.0, score_bytes=(10, 30), block=128, kept=5)


@pytest.fixture
def toys():
    """Register the three toys for one test, and remove them again."""
    attention.implementation("toy_attention", cost=TOY_COST)(toy_attention)
    kinds.register("toy_relu_lowrank", ToyReluLowRank)
    strategies.register(strategies.Registered("toy_split", TOY_RULES))
    try:
        yield
    finally:
        attention.IMPLEMENTATIONS.pop("toy_attention")
        attention.COST_CLASSES.pop("toy_blocks")
        kinds.REGISTRY.pop("toy_relu_lowrank")
        strategies.REGISTRY.pop("toy_split")


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
                         ("parallel.strategy", "toy_split")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            validate(make_config(**{field: value}))


def test_toys_run_the_trainers_step(make_config, toys):
    """The toy attention and strategy train as their twins do (xla attention, btp: the same model
    under another layout); the toy strategy lays out the weights as its table says; the toy kind trains
    (finite, decreasing) and its projection is relu(x·A)·B."""
    base = first_losses(small(make_config))
    np.testing.assert_allclose(first_losses(small(make_config, **{"model.attention": "toy_attention"})), base,
                               rtol=1e-5)
    np.testing.assert_allclose(first_losses(small(make_config, **{"parallel.strategy": "toy_split"})), base,
                               rtol=1e-5)
    specs = build(small(make_config, **{"parallel.strategy": "toy_split"})).spec.shardings["params"]["layers"]
    spec = lambda *path: tuple(specs[path[0]][path[1]][path[2]].spec)[1:]  # noqa: E731 - without the layer axis
    assert spec("attn", "q", "a") == ("tensor",) and spec("attn", "q", "b") in ((), (None,), (None, None))
    assert spec("attn", "o", "b") == (None, "tensor") and spec("mlp", "gate", "b") == (None, "tensor")
    toy = first_losses(small(make_config, **{"model.linear": "toy_relu_lowrank"}), steps=3)
    assert np.all(np.isfinite(toy)) and toy[-1] < toy[0], toy

    from boost_jax.model.linear import Projection, project
    m = small(make_config, **{"model.linear": "toy_relu_lowrank"}).model
    proj = Projection(m, 16, 24, axes=("embed", "mlp"), group="mlp_in", rngs=nnx.Rngs(params=1))
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    want = np.maximum(x @ np.asarray(proj.a[...], np.float64), 0) @ np.asarray(proj.b[...], np.float64)
    np.testing.assert_allclose(np.asarray(project([proj], jnp.asarray(x))[0]), want, rtol=1e-5, atol=1e-6)


def test_toys_in_the_comm_report(toys):
    """The report takes the registered names: per token per layer forward, the toy strategy
    all-reduces the r-wide partial products of the row-parallel A's (qkv's 3, mlp_in's 2, mlp_out's
    1; o's A is whole) and one statistic per norm (its rows are split along d), with the toy kind and
    the toy attention too."""
    from boost_jax.config import base_config
    from boost_jax.tools import comm_report
    c = base_config()
    r = 32
    c.model.update(d_model=128, n_heads=4, n_kv_heads=4, d_ff=256, rank=r, n_layers=2, vocab_size=512,
                   max_seq_len=64, attention="toy_attention")
    rep = comm_report.report(c, mesh=(1, 1, 4), strategies="toy_split,toy_split:toy_relu_lowrank", batch=2, seq=64,
                             dtype="float32", memory=False, programs=("forward",))
    for col in rep["strategies"].values():
        fwd = col["per_layer_forward"]["tensor"]
        assert fwd["elements_per_token"] == pytest.approx((3 + 2 + 1) * r + 2)


def test_toys_in_the_planner(toys):
    """The planner reads the toy strategy's layout from its table (qkv row-parallel into a replicated
    attention, o column-parallel, BTP's MLP without online norm), prices the toy attention by its own
    cost class (against the formula written out here) and the toy kind through its declared
    interface; a search over heads the tensor size does not divide finds the toy strategy runnable,
    and --verify agrees with the toy strategy's compiled step."""
    from boost_jax.config import base_config, sized_config
    from boost_jax.planner import Layer, Mesh, Options, cost, load_cluster, plan_for, search
    from boost_jax.planner import partitions as P
    from boost_jax.planner.verify import compare
    cluster = load_cluster(str(ROOT / "configs" / "clusters" / "a100_4x.py"))

    residual, choices, attn, act = P.uniform_plan("toy_split")
    assert (residual, attn, act) == ("H", "R", "H")
    # qkv, o and mlp_in are split as no other table splits them (mlp_in: BTP's split without the
    # online norm); mlp_out exactly as BTP's.
    assert choices == ("toy_split", "toy_split", "toy_split", "btp")
    table = P.strategy_layers(True)[-1]
    assert [(s.first, s.second) for s in table.splits] == [("in", ""), ("", "out"), ("in", "out"), ("in", "out")]

    # The toy cost class against its formula: blocks of 128 keys, (blocks + 1) / (2 blocks) of them computed.
    a = P.Attn(queries=4096, keys=4096, heads=8, head_dim=128, imbalance=1.0)
    flops = 4 * 4096 * 4096 * 128 * 8
    gemm = flops / (cluster.peak_flops * cost.gemm_efficiency(4096, 128, 128, cluster))
    traffic = 4096 * 4096 * 8 / cluster.hbm_bandwidth
    visible = (32 + 1) / (2 * 32)
    fwd, bwd = cost.attention_seconds(a, "toy_blocks", cluster)
    assert fwd == pytest.approx(visible * (gemm + 10 * traffic)) and bwd == pytest.approx(visible * (3 * gemm + 30 * traffic))

    cfg = sized_config("1b", "cola")
    opts = dict(batch=64, seq=2048, check_memory=False)
    price = lambda strategy, attn, c=cfg: plan_for(  # noqa: E731
        c, cluster, Mesh(1, 1, 4), 1, "none", Layer(*P.uniform_plan(strategy)), Options(attention=attn, **opts), 1.0)
    toy = price("toy_split", "toy_attention")
    assert (toy.runnable, toy.strategy) == ("yes", "toy_split")
    chunked = price("toy_split", "chunked")
    assert toy.step_s != chunked.step_s and toy.memory["total"] == pytest.approx(chunked.memory["total"])
    relu = cfg.copy_and_resolve_references()
    relu.model.linear = "toy_relu_lowrank"
    assert price("toy_split", "xla", relu).step_s == pytest.approx(price("toy_split", "xla").step_s)  # same shapes

    # 6 heads on tensor 4: BTP and Megatron cannot split them; the toy strategy's qkv and o run, and
    # its layer is a plan the trainer runs; the search mixes its groups with the others'.
    gqa = cfg.copy_and_resolve_references()
    gqa.model.update(n_heads=6, n_kv_heads=6, d_model=1536)
    ctx = P.Ctx(P.Block.from_config(gqa), 4, 2048, 2048)
    assert [c[0] for c in P.group_choices(ctx, "qkv")] == ["vanilla", "toy_split"]
    assert [c[0] for c in P.group_choices(ctx, "o")] == ["vanilla", "toy_split"]
    plan = plan_for(gqa, cluster, Mesh(1, 2, 4), 1, "none", Layer(*P.uniform_plan("toy_split")),
                    Options(attention="toy_attention", **opts), 1.0)
    assert (plan.runnable, plan.strategy) == ("yes", "toy_split")
    assert "--config.parallel.strategy=toy_split " in plan.overrides
    res = search(gqa, cluster, 8, Options(batch=64, seq=2048, attention="toy_attention", top=40, pipeline=(1,)), 1.0)
    assert any("toy_split" in p.layer.choices for p in res.plans if p.mesh.tensor == 4)

    small = base_config()
    small.model.update(d_model=512, n_heads=8, n_kv_heads=8, d_ff=1376, rank=128, n_layers=2, vocab_size=1024,
                       max_seq_len=64)
    rows = compare(small, cluster, Mesh(1, 2, 2), "toy_split", batch=4, seq=64, memory=True)
    assert [r["traffic"] for r in rows][:2] == ["tensor fwd: all-reduce", "tensor bwd: all-reduce"]
    for r in rows:
        assert r["ok"] and r["measured"] > 0, r


def test_planner_and_tools_name_no_strategy():
    """The planner and the tools know strategies only through the registry: no string in their code
    (comments, docstrings and messages aside) is a registered strategy's name, or a list of them, or
    the st choice."""
    from boost_jax.config import ST
    names = set(strategies.names()) | {ST}
    found = []
    for path in sorted((ROOT / "boost_jax").glob("planner/*.py")) + sorted((ROOT / "boost_jax").glob("tools/*.py")):
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        for i, tok in enumerate(tokens):
            docstring = i == 0 or tokens[i - 1].type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
            if tok.type == tokenize.STRING and not docstring:
                try:
                    value = ast.literal_eval(tok.string)
                except ValueError:  # an f-string: its literal parts
                    value = tok.string
                words = set(value.replace(",", " ").replace(":", " ").split()) if isinstance(value, str) else set()
                if words and words <= names:  # a name, or a list of them (prose may mention one)
                    found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string}")
    assert not found, found
