"""Each registry is the one source of its names: an attention implementation, a linear kind and a
strategy registered from this file alone run through config validation, the trainer's step, the
comm report and the planner, with nothing else changed anywhere.

- toy attention: causal softmax attention written here in plain jnp (repeating KV heads, unlike the
  xla implementation's grouped einsum), with a cost class of its own (scores in blocks of 128 keys);
- toy kind: a low-rank B·relu(A·x) projection declared here (its parameters, axes, FLOPs, counts);
- scaled kind: y = s·B·(A·x) with s a hyperparameter of its own (`model.scaled_lowrank_scale`), its
  own FLOPs (the r products by s) and its own Hugging Face layout (PEFT-like lora_A [r, in] and
  lora_B [out, r], model_type scaled_lowrank, config.json's lr_scale), so that the config, the
  trainer's step, the planner, the comm report and export/import all meet a kind they have never seen;
- toy strategy: a rule table no registered strategy has: BTP's MLP (row-parallel A, r-wide
  all-reduce, column-parallel B) with the attention replicated over `tensor` (its qkv A row-parallel
  with an all-reduce of its 3r outputs, its o B column-parallel), as one would run heads that the
  tensor size does not divide. The planner reads its layout from the table alone.
The math each computes is checked against an independent formula or the twin it copies.
"""

import ast
import dataclasses
import io
import json
import math
import tokenize
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boost_jax.config import Field
from boost_jax.model import attention, kinds
from boost_jax.model.kinds.base import HFLayout, LinearKind, factor_init
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


@dataclasses.dataclass(frozen=True)
class ScaledLayout(HFLayout):
    """A layout no built-in kind has: the factors stored transposed (PEFT's lora_A [r, in], lora_B
    [out, r]) and s in config.json's lr_scale."""

    model_type: str = "scaled_lowrank"
    architecture: str = "ScaledLowRankForCausalLM"
    tensors: tuple = (("a", "lora_A", True), ("b", "lora_B", True))

    def config(self, m):
        return {**super().config(m), "rank": int(m.rank), "lr_scale": float(m.scaled_lowrank_scale)}

    def fields(self, hf):
        return {"rank": hf.get("rank"), "scaled_lowrank_scale": hf.get("lr_scale")}

    def problems(self, hf, fields):
        return [f"{k} is missing" for k in ("rank", "lr_scale") if k not in hf]


class ScaledLowRank(LinearKind):
    """y = s·B·(A·x), s = model.scaled_lowrank_scale: declared entirely in this test file."""

    fields = {"scaled_lowrank_scale": Field(0.5, "scaled_lowrank: s of y = s·B·(A·x)")}
    hf = ScaledLayout()

    def __init__(self, m, d_in, d_out, *, axes, group, rngs, param_dtype):
        super().__init__(m, d_in, d_out, axes=axes, group=group, rngs=rngs, param_dtype=param_dtype)
        r, self.scale = self.width, float(m.scaled_lowrank_scale)
        self.a = nnx.Param(factor_init(rngs.params(), (d_in, r), d_in, d_out, r, param_dtype), axes=self.first_axes)
        self.b = nnx.Param(factor_init(rngs.params(), (r, d_out), d_in, d_out, r, param_dtype), axes=self.second_axes)

    @classmethod
    def flops(cls, m, d_in, d_out):
        return 2 * int(m.rank) * (d_in + d_out) + int(m.rank)  # the two GEMMs and s·h

    @classmethod
    def n_params(cls, m, d_in, d_out):
        return int(m.rank) * (d_in + d_out)

    @classmethod
    def validate(cls, m, widths):
        s = m.scaled_lowrank_scale
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            return f"model.scaled_lowrank_scale: {s} must be a positive number, e.g. 0.5"
        return super().validate(m, widths)

    def first_weight(self, use):
        return use(self.a[...], self.first_axes)

    def second_weight(self, use):
        return use(self.b[...], self.second_axes)

    def bottleneck(self, h):
        return h * self.scale


# The MLP and residual split along d as BTP splits them; the heads (and so q, k, v, the attention and
# o's input) whole on every tensor shard: qkv's A is row-parallel over d, o's B column-parallel over d.
TOY_RULES = (
    ("embed", "tensor"),
    ("norm", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("act_embed", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_heads", None),
    ("act_kv_heads", None),
    ("act_rank", None),
    ("embed", "fsdp"),
    ("rank", "fsdp"),
    ("heads", "fsdp"),
    ("kv_heads", "fsdp"),
    ("mlp", "fsdp"),
    ("vocab_in", "fsdp"),
    ("head_embed", "fsdp"),
    ("vocab", "fsdp"),
    ("act_batch", BATCH),
    ("layers", "pipeline"),
    ("head_norm", None),
    ("act_seq", None),
    ("act_res_seq", None),
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
        kinds.unregister("toy_relu_lowrank")
        strategies.REGISTRY.pop("toy_split")


@pytest.fixture
def scaled():
    """Register the scaled kind (and so its config field) for one test, and remove both again."""
    kinds.register("scaled_lowrank", ScaledLowRank)
    try:
        yield
    finally:
        kinds.unregister("scaled_lowrank")


def small(make_config, **kw):
    return make_config(**{"parallel.data": 2, "parallel.tensor": 4, "model.n_kv_heads": 4, **kw})


def first_losses(cfg, steps=2):
    built = build(cfg)
    state = built.init_state()
    rng = np.random.default_rng(0)
    t = cfg.train
    out = []
    for _ in range(steps):
        tokens = rng.integers(
            0, cfg.model.vocab_size, (t.grad_accum, t.global_batch // t.grad_accum, t.seq_len + 1), dtype=np.int32
        )
        state, metrics = built.train_step(state, jax.device_put(tokens, built.batch_sharding))
        out.append(float(metrics["loss"]))
    return np.array(out)


def test_unregistered_names_are_config_errors(make_config):
    from boost_jax.errors import ConfigError

    for field, value in (
        ("model.attention", "toy_attention"),
        ("model.linear", "toy_relu_lowrank"),
        ("parallel.strategy", "toy_split"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            validate(make_config(**{field: value}))


def test_toys_run_the_trainers_step(make_config, toys):
    """The toy attention and strategy train as their twins do (xla attention, btp: the same model
    under another layout); the toy strategy lays out the weights as its table says; the toy kind trains
    (finite, decreasing) and its projection is relu(x·A)·B."""
    base = first_losses(small(make_config))
    np.testing.assert_allclose(
        first_losses(small(make_config, **{"model.attention": "toy_attention"})), base, rtol=1e-5
    )
    np.testing.assert_allclose(first_losses(small(make_config, **{"parallel.strategy": "toy_split"})), base, rtol=1e-5)
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
    from boost_jax.tools.comm_report import command as comm_report

    c = base_config()
    r = 32
    c.model.update(
        d_model=128,
        n_heads=4,
        n_kv_heads=4,
        d_ff=256,
        rank=r,
        n_layers=2,
        vocab_size=512,
        max_seq_len=64,
        attention="toy_attention",
    )
    rep = comm_report.report(
        c,
        mesh=(1, 1, 4),
        strategies="toy_split,toy_split:toy_relu_lowrank",
        batch=2,
        seq=64,
        dtype="float32",
        memory=False,
        programs=("forward",),
    )
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
    from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for, search
    from boost_jax.planner.ops.operators import Attn, Block, Ctx
    from boost_jax.planner.ops.projections import group_choices
    from boost_jax.planner.ops.strategy_tables import strategy_layers, uniform_plan
    from boost_jax.planner.pricing import cost
    from boost_jax.planner.verify import compare

    cluster = load_cluster(str(ROOT / "configs" / "clusters" / "a100_4x.py"))

    residual, choices, attn, act = uniform_plan("toy_split")
    assert (residual, attn, act) == ("H", "R", "H")
    # qkv, o and mlp_in are split as no other table splits them (mlp_in: BTP's split without the
    # online norm); mlp_out exactly as BTP's.
    assert choices == ("toy_split", "toy_split", "toy_split", "btp")
    table = strategy_layers(True)[-1]
    assert [(s.first, s.second) for s in table.splits] == [("in", ""), ("", "out"), ("in", "out"), ("in", "out")]

    # The toy cost class against its formula: blocks of 128 keys, (blocks + 1) / (2 blocks) of them computed.
    a = Attn(queries=4096, keys=4096, heads=8, head_dim=128, imbalance=1.0)
    flops = 4 * 4096 * 4096 * 128 * 8
    gemm = flops / (cluster.peak_flops * cost.gemm_efficiency(4096, 128, 128, cluster))
    traffic = 4096 * 4096 * 8 / cluster.hbm_bandwidth
    visible = (32 + 1) / (2 * 32)
    fwd, bwd = cost.attention_seconds(a, "toy_blocks", cluster)
    assert fwd == pytest.approx(visible * (gemm + 10 * traffic)) and bwd == pytest.approx(
        visible * (3 * gemm + 30 * traffic)
    )

    cfg = sized_config("1b", "cola")
    opts = dict(batch=64, seq=2048, check_memory=False)
    price = lambda strategy, attn, c=cfg: plan_for(  # noqa: E731
        c, cluster, Mesh(1, 1, 4), 1, "none", Layer(*uniform_plan(strategy)), Options(attention=attn, **opts), 1.0
    )
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
    ctx = Ctx(Block.from_config(gqa), 4, 2048, 2048)
    assert [c[0] for c in group_choices(ctx, "qkv")] == ["vanilla", "toy_split"]
    assert [c[0] for c in group_choices(ctx, "o")] == ["vanilla", "toy_split"]
    plan = plan_for(
        gqa,
        cluster,
        Mesh(1, 2, 4),
        1,
        "none",
        Layer(*uniform_plan("toy_split")),
        Options(attention="toy_attention", **opts),
        1.0,
    )
    assert (plan.runnable, plan.strategy) == ("yes", "toy_split")
    assert "--config.parallel.strategy=toy_split " in plan.overrides
    res = search(gqa, cluster, 8, Options(batch=64, seq=2048, attention="toy_attention", top=200, pipeline=(1,)), 1.0)
    assert any("toy_split" in p.layer.choices for p in res.plans if p.mesh.tensor == 4)

    small = base_config()
    small.model.update(
        d_model=512, n_heads=8, n_kv_heads=8, d_ff=1376, rank=128, n_layers=2, vocab_size=1024, max_seq_len=64
    )
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
    for path in sorted((ROOT / "boost_jax").glob("planner/**/*.py")) + sorted((ROOT / "boost_jax").glob("tools/*.py")):
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


def test_a_kind_declares_its_own_config_fields(make_config, scaled):
    """The kind's field is a config key while it is registered (default, override, the kind's own
    check, its help in the config listing) and an unknown key once it is not; the built-in kinds'
    fields reach the command line, where a misspelt one is still a one-line error."""
    from boost_jax.config import base_config, config_docs
    from boost_jax.errors import ConfigError

    assert base_config().model.scaled_lowrank_scale == 0.5
    assert config_docs()["model.scaled_lowrank_scale"] == "scaled_lowrank: s of y = s·B·(A·x)"
    cfg = validate(make_config(**{"model.linear": "scaled_lowrank", "model.scaled_lowrank_scale": 2.5}))
    assert cfg.model.scaled_lowrank_scale == 2.5
    with pytest.raises(ConfigError, match=r"`model\.scaled_lowrank_scale`: -1\.0 must be a positive number"):
        validate(make_config(**{"model.linear": "scaled_lowrank", "model.scaled_lowrank_scale": -1.0}))
    with pytest.raises(ConfigError, match="already declared by scaled_lowrank"):
        kinds.register("clash", type("Clash", (ScaledLowRank,), {"fields": {"scaled_lowrank_scale": Field(1.0, "")}}))
    assert "clash" not in kinds.names()
    with pytest.raises(ConfigError, match="already a key of the model section"):
        kinds.register("clash", type("Clash", (ScaledLowRank,), {"fields": {"rank": Field(1, "")}}))
    kinds.unregister("scaled_lowrank")
    try:
        assert "scaled_lowrank_scale" not in base_config().model
        with pytest.raises(AttributeError, match="scaled_lowrank_scale"):
            base_config().model.scaled_lowrank_scale = 1.0
    finally:
        kinds.register("scaled_lowrank", ScaledLowRank)

    import os
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "boost_jax.train", "--config.model.tt_coress=6"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "unknown key 'tt_coress'" in r.stderr and '"tt_cores"' in r.stderr, r.stderr


def test_a_new_kind_runs_the_trainers_step(make_config, scaled):
    """The trainer's step runs the scaled kind under BTP on data 2 x tensor 4: with s = 1 it trains
    as its twin lowrank does (the same parameters and math), with s = 2.5 otherwise (finite); and its
    projection computes s·B·(A·x) with the configured s (a plain jnp reference)."""
    twin = first_losses(small(make_config, **{"model.linear": "lowrank"}), steps=3)
    one = first_losses(
        small(make_config, **{"model.linear": "scaled_lowrank", "model.scaled_lowrank_scale": 1.0}), steps=3
    )
    np.testing.assert_allclose(one, twin, rtol=1e-5)
    scaled = first_losses(
        small(make_config, **{"model.linear": "scaled_lowrank", "model.scaled_lowrank_scale": 2.5}), steps=3
    )
    assert np.all(np.isfinite(scaled)) and not np.allclose(scaled, twin, rtol=1e-3), (scaled, twin)

    from boost_jax.model.linear import Projection, project

    m = small(make_config, **{"model.linear": "scaled_lowrank", "model.scaled_lowrank_scale": 2.5}).model
    proj = Projection(m, 16, 24, axes=("embed", "mlp"), group="mlp_in", rngs=nnx.Rngs(params=1))
    x = jax.random.normal(jax.random.key(3), (2, 3, 16))
    want = 2.5 * jnp.einsum("btr,ro->bto", jnp.einsum("bti,ir->btr", x, proj.a[...]), proj.b[...])
    np.testing.assert_allclose(np.asarray(project([proj], x)[0]), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_the_planner_prices_a_new_kind_by_its_own_flops(scaled):
    """The plan's MFU counts the kind's own FLOPs (2r(in+out) + r per projection and token, against
    the formula written out here); its step time is the low-rank twin's (same shapes)."""
    from boost_jax.config import sized_config
    from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for
    from boost_jax.planner.ops.strategy_tables import uniform_plan

    cluster = load_cluster(str(ROOT / "configs" / "clusters" / "a100_4x.py"))
    twin = sized_config("1b", "lowrank")
    cfg = twin.copy_and_resolve_references()
    cfg.model.linear = "scaled_lowrank"
    opts = Options(batch=64, seq=2048, check_memory=False, attention="xla")
    plan = lambda c: plan_for(c, cluster, Mesh(1, 1, 4), 1, "none", Layer(*uniform_plan("btp")), opts)  # noqa: E731
    ours, theirs = plan(cfg), plan(twin)
    assert ours.runnable == "yes" and ours.step_s == pytest.approx(theirs.step_s)
    m = cfg.model
    d, r, q, kv, ff = m.d_model, m.rank, m.d_model, m.n_kv_heads * (m.d_model // m.n_heads), m.d_ff
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, ff), (d, ff), (ff, d)]
    per_token = 3 * (m.n_layers * (sum(2 * r * (a + b) + r for a, b in shapes) + 4 * 2048 * d) + 2 * d * m.vocab_size)
    assert ours.mfu == pytest.approx(per_token * ours.tokens_per_s / (4 * cluster.peak_flops), rel=1e-12)
    assert ours.mfu / theirs.mfu == pytest.approx(per_token / (per_token - 3 * m.n_layers * 7 * r), rel=1e-12)


def test_the_comm_report_runs_a_new_kind(scaled):
    """Under BTP the scaled kind's traffic is the low-rank twin's: the r-wide partial products of
    the row-parallel A's and the norm statistics."""
    from boost_jax.config import base_config
    from boost_jax.tools.comm_report import command as comm_report

    c = base_config()
    c.model.update(
        d_model=128,
        n_heads=4,
        n_kv_heads=4,
        d_ff=256,
        rank=32,
        n_layers=2,
        vocab_size=512,
        max_seq_len=64,
        attention="xla",
    )
    rep = comm_report.report(
        c,
        mesh=(1, 1, 4),
        strategies="btp:scaled_lowrank,btp:lowrank",
        batch=2,
        seq=64,
        dtype="float32",
        memory=False,
        programs=("forward",),
    )
    ours, twin = (col["per_layer_forward"]["tensor"] for col in rep["strategies"].values())
    assert ours["elements_per_token"] == twin["elements_per_token"] > 0, (ours, twin)


def test_export_round_trips_a_new_kind_through_its_own_layout(make_config, scaled, tmp_path):
    """The kind's own mapping writes lora_A/lora_B (transposed) and config.json's lr_scale; an import
    reads them back (the kind chosen by model_type, s and the GQA heads restored) and an export of the
    imported run writes the same files; the layouts export lists come from the registry."""
    from safetensors.numpy import load_file, save_file

    from boost_jax import export
    from boost_jax.errors import ExportError
    from boost_jax.model import build_model
    from boost_jax.runtime.build import load_model

    assert list(export.layouts()) == ["dense", "lowrank", "cola", "scaled_lowrank"]
    cfg = make_config(**{"model.linear": "scaled_lowrank", "model.scaled_lowrank_scale": 2.5})
    m = cfg.model
    params = nnx.to_pure_dict(nnx.state(build_model(m, seed=4)))
    tensors = export.to_hf(params, m)
    a, b = params["layers"]["attn"]["k"]["a"][1], params["layers"]["attn"]["k"]["b"][1]
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.k_proj.lora_A"], np.asarray(a).T)
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.k_proj.lora_B"], np.asarray(b).T)
    hf = json.loads(json.dumps(export.hf_config(m)))
    assert (hf["model_type"], hf["architectures"], hf["lr_scale"], hf["rank"]) == (
        "scaled_lowrank",
        ["ScaledLowRankForCausalLM"],
        2.5,
        8,
    )
    fields = export.model_fields(hf)
    assert fields == {k: m[k] for k in fields} and fields["linear"] == "scaled_lowrank", fields
    back = export.from_hf(tensors, params, m)
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, params))
    with pytest.raises(ExportError, match="lr_scale is missing"):
        export.model_fields({k: v for k, v in hf.items() if k != "lr_scale"})

    src = tmp_path / "hf"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(hf))
    step, imported = export.import_hf(str(src), str(tmp_path / "run"))
    assert (imported.model.linear, imported.model.scaled_lowrank_scale, imported.model.n_kv_heads) == (
        "scaled_lowrank",
        2.5,
        m.n_kv_heads,
    )
    model, _, _ = load_model(str(step))
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model))),
        jax.tree.map(np.asarray, params),
    )
    out = export.export(str(tmp_path / "run"), str(tmp_path / "again"))
    again = load_file(str(out / "model.safetensors"))
    assert sorted(again) == sorted(tensors)
    for k in tensors:
        np.testing.assert_array_equal(again[k], tensors[k], err_msg=k)
    written = json.loads((out / "config.json").read_text())
    assert {k: written[k] for k in ("model_type", "lr_scale", "rank")} == {
        k: hf[k] for k in ("model_type", "lr_scale", "rank")
    }


def _kind_literals(path: Path, skip=()) -> list[str]:
    """The strings in `path`'s code (docstrings aside; prose may mention a kind) that are a registered
    kind's name or a kind's field, or a list of them, and the names that are a kind's field (m.tt_cores);
    `skip`: top-level functions and assignments not read."""
    names = set(kinds.names())
    fields = {f for n in kinds.names() for f in kinds.kind_class(n).fields}
    source = path.read_text()
    skipped = set()
    for node in ast.parse(source).body:
        named = (
            {node.name}
            if isinstance(node, ast.FunctionDef)
            else {t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}
        )
        if named & set(skip):
            skipped |= set(range(node.lineno, node.end_lineno + 1))
    found = []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        docstring = i == 0 or tokens[i - 1].type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if tok.start[0] in skipped or (docstring and tok.type == tokenize.STRING):
            continue
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except ValueError:  # an f-string: its literal parts
                value = tok.string
            words = set(value.replace(",", " ").replace(":", " ").split()) if isinstance(value, str) else set()
            if words and (words <= names or words <= fields):
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string}")
        elif tok.type == tokenize.NAME and tok.string in fields:  # m.tt_cores and the like
            found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string}")
    return found


def test_export_and_config_name_no_kind():
    """Export knows kinds only through their layouts and the config schema only through the declared
    fields: no string in export.py, the comm report or the trainer is a kind's name or field, and no
    code of boost_jax/config/ names a kind or a kind's field, except the zoo presets (sized_config, tt_config,
    sltrain_config and their tables: recipes that pick a kind and set its fields, as configs/*.py do)
    and model.linear's default value."""
    found = []
    for path in ("export.py", "tools/comm_report/command.py", "train.py"):
        found += _kind_literals(ROOT / "boost_jax" / path)
    assert not found, found
    config = ROOT / "boost_jax" / "config" / "schema.py"
    default = [
        i + 1 for i, line in enumerate(config.read_text().splitlines()) if line.strip().startswith("m.linear = ")
    ]
    assert len(default) == 1
    schema = [f for f in _kind_literals(config) if int(f.split(":")[1]) != default[0]]
    for other in ("checks.py", "files.py", "__init__.py"):
        schema += _kind_literals(ROOT / "boost_jax" / "config" / other)
    schema += _kind_literals(
        ROOT / "boost_jax" / "config" / "presets.py",
        skip=("sized_config", "tt_config", "sltrain_config", "TT_SIZES", "SLTRAIN_RECIPE"),
    )
    assert not schema, schema
