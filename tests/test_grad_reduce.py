"""Gradients are reduced over `data` once per optimizer step, whatever grad_accum is, and the
accumulated step equals the one-device gradient; under GPipe, once per pass over data and fsdp."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_parallel import assert_close_tree, par_config, reference
from tests_support import compiled_step

from boost_jax.parallel import grad_reduce
from boost_jax.parallel.pipeline import gspmd, stack
from boost_jax.parallel.strategies import get_strategy
from boost_jax.runtime.build import build
from boost_jax.runtime.state import trainable
from boost_jax.runtime.step import next_token_loss
from boost_jax.tools.hlo_comm import parse_collectives


def data_all_reduce(cfg):
    """(elements all-reduced over `data` inside loops, outside loops) in the compiled train step."""
    compiled, built, _ = compiled_step(cfg)
    spec, mesh = built.spec, built.mesh
    text = compiled.as_text()
    n_params = sum(x.size for x in jax.tree.leaves(spec.abstract["params"]))
    ops = [c for c in parse_collectives(text, mesh) if c.kind == "all-reduce" and "data" in c.axes]
    return (sum(c.elements for c in ops if c.in_loop), sum(c.elements for c in ops if not c.in_loop), n_params)


@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 2, 2)], ids=["data8", "2x2x2"])
def test_one_data_reduction_per_step_whatever_grad_accum(make_config, mesh):
    counts = {}
    for accum in (1, 4):
        cfg = par_config(make_config, "btp", "cola", mesh, **{"train.grad_accum": accum, "train.global_batch": 32})
        counts[accum] = data_all_reduce(cfg)
    (loop1, once1, n_params), (loop4, once4, _) = counts[1], counts[4]
    assert loop1 == loop4 == 0  # nothing over `data` runs per micro-batch
    assert once1 == once4  # the same elements executed per step for grad_accum 1 and 4
    assert once4 >= n_params // (mesh[1] * mesh[2])  # the whole device-local gradient is in it


def test_without_the_island_the_reduction_runs_per_micro_batch(make_config, monkeypatch):
    """The check above can fail: GSPMD's own placement reduces inside the accumulation loop."""
    monkeypatch.setattr(grad_reduce, "island_applies", lambda mesh, strategy: False)
    cfg = par_config(make_config, "btp", "cola", (8, 1, 1), **{"train.grad_accum": 4, "train.global_batch": 32})
    in_loop, _, n_params = data_all_reduce(cfg)
    assert in_loop >= n_params // 2  # most of the gradient, executed grad_accum times


@pytest.mark.parametrize(
    "mesh,reduce_dtype,compute",
    [
        ((2, 2, 2), "float32", "float32"),
        ((4, 1, 2), "float32", "float32"),
        ((2, 2, 2), "bfloat16", "float32"),
        ((2, 2, 2), "float32", "bfloat16"),
    ],
)
def test_accumulated_gradient_matches_single_device(make_config, mesh, reduce_dtype, compute):
    """Against the one-device gradient in the same compute dtype (bf16: within bf16 rounding)."""
    cfg = par_config(
        make_config, "btp", "cola", mesh, **{"parallel.grad_reduce_dtype": reduce_dtype, "model.dtype": compute}
    )
    (loss, grads), (ref_loss, ref_grads), *_ = accumulated(cfg)
    tol = 1e-5 if reduce_dtype == compute == "float32" else 2e-2 if compute == "float32" else 5e-2
    assert abs(float(loss) - ref_loss) <= (1e-5 if compute == "float32" else 1e-2) * abs(ref_loss)
    assert_close_tree(jax.device_get(grads), ref_grads, tol)


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 4, 2)], ids=["island", "plain"])
def test_the_gpu_accumulation_loop_matches_single_device(make_config, monkeypatch, mesh):
    """The loop a GPU step runs (trip count hidden from XLA: grad_reduce.each_micro_batch), here on
    CPU devices: the same loss and gradient as one device, through the data island (data 2) and the
    plain loop (data 1), and the compiled step has a loop of unknown trip count (the scan's has one)."""
    monkeypatch.setattr(grad_reduce, "hides_trip_count", lambda: True)
    cfg = par_config(make_config, "btp", "cola", mesh, **{"train.grad_accum": 2})
    (loss, grads), (ref_loss, ref_grads), collectives, _ = accumulated(cfg)
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(jax.device_get(grads), ref_grads, 1e-5)
    assert any(c.trips is None for c in collectives()), "no loop of unknown trip count"


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_one_micro_batch_island_matches_single_device(make_config, monkeypatch, reduce_dtype):
    """grad_accum 1 through the data island (no accumulation loop: each gradient summed over `data`
    straight from the backward), data 2 x fsdp 2 x tensor 2, as a GPU step builds it: the one-device
    loss and gradient, and the step runs no accumulation loop (the GPU's is a `while`:
    grad_reduce.each_micro_batch) and sums the gradient over `data` outside any loop."""
    monkeypatch.setattr(grad_reduce, "hides_trip_count", lambda: True)
    cfg = par_config(make_config, "btp", "cola", (2, 2, 2), **{"parallel.grad_reduce_dtype": reduce_dtype})
    (loss, grads), (ref_loss, ref_grads), collectives, jaxpr = accumulated(cfg, micro_batches=1)
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(jax.device_get(grads), ref_grads, 1e-5 if reduce_dtype == "float32" else 2e-2)
    assert "while[" not in str(jaxpr()), "an accumulation loop at grad_accum 1"
    ops = [c for c in collectives() if c.kind == "all-reduce" and "data" in c.axes]
    assert ops and not any(c.in_loop for c in ops)


def accumulated(cfg, micro_batches=2):
    """((loss, grads) of grad_reduce.accumulate_grads over `micro_batches` on cfg's mesh, the
    one-device (loss, grads), functions giving the compiled step's collectives and its jaxpr)."""
    params_host, tokens, ref = reference(cfg)
    built = build(cfg)
    m, spec = built.mesh, built.spec
    params = jax.device_put(params_host, spec.shardings["params"])
    rows = NamedSharding(m, P(None, ("data", "fsdp")))
    batch = jax.device_put(tokens.reshape(micro_batches, -1, tokens.shape[-1]), rows)
    grad_fn = jax.value_and_grad(lambda p, x: next_token_loss(spec.graphdef, p, x))
    step = jax.jit(built.bind(lambda p, b: grad_reduce.accumulate_grads(grad_fn, p, b, m, built.strategy)))
    collectives = lambda: parse_collectives(step.lower(params, batch).compile().as_text(), m)  # noqa: E731
    return step(params, batch), ref, collectives, lambda: jax.make_jaxpr(step)(params, batch)


# ------------------------------------------------------------------ GPipe: once per pass

# 2 stages of 2 layers on mesh pipeline 2 x data 2 x fsdp 2; 4 GPipe micro-batches of 4 rows.
PIPELINE_KW = {"parallel.pipeline": 2, "model.n_layers": 4, "train.global_batch": 16}


def pipeline_program(cfg):
    """(spec, compiled train step with plain SGD at lr 1 (new params = params - grads), batch
    sharding, executed data/fsdp reduction elements per step, mesh)."""
    built = build(cfg, optimizer=(optax.sgd(1.0), lambda s: 1.0))
    spec, mesh, batch_sharding = built.spec, built.mesh, built.batch_sharding
    compiled = built.lower_train().compile()
    ops = [
        c
        for c in parse_collectives(compiled.as_text(), mesh)
        if c.kind in ("all-reduce", "reduce-scatter") and {"data", "fsdp"} & set(c.axes)
    ]
    assert all(c.trips is not None for c in ops)  # every loop's trip count is known
    return spec, compiled, batch_sharding, sum(c.elements * c.trips for c in ops), mesh


def stage_and_rest_elements(spec, stages):
    """Gradient elements one device reduces once per pass: its stage's share of the layer stack
    (whole, not fsdp-split: the accumulator holds the stage's gradient) plus every other parameter."""
    flat = jax.tree_util.tree_flatten_with_path(trainable(spec.abstract["params"]))[0]
    layers = sum(x.size for path, x in flat if "layers" in jax.tree_util.keystr(path))
    rest = sum(x.size for path, x in flat if "layers" not in jax.tree_util.keystr(path))
    return layers // stages, rest


# gpipe in one pass, circular (V = 2) under grad_accum 2 and 1F1B (interleaved, V = 2) under grad_accum
# 2: the stage weights' gradient is reduced once per optimizer step either way (parallel/pipeline/stack.py
# `accumulate`).
PIPELINE_CASES = {
    "gpipe": {},
    "circular_accum2": {
        "parallel.pipeline_schedule": "circular",
        "parallel.pipeline_repeats": 2,
        "train.grad_accum": 2,
        "train.global_batch": 32,
    },
    "1f1b_v2_accum2": {
        "parallel.pipeline_schedule": "1f1b",
        "parallel.pipeline_repeats": 2,
        "train.grad_accum": 2,
        "train.global_batch": 32,
    },
}


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, marks=pytest.mark.slow) if c.startswith("1f1b") else c for c in PIPELINE_CASES],
)
def pipelined(tmp_path_factory, request):
    from conftest import small_config

    make = lambda **kw: small_config(tmp_path_factory.mktemp("pipe") / "run", **kw)  # noqa: E731
    cfg = par_config(make, "btp", "cola", (2, 2, 1), **{**PIPELINE_KW, **PIPELINE_CASES[request.param]})
    return cfg, pipeline_program(cfg)


def test_pipelined_train_step_matches_single_device(pipelined):
    """Loss and the SGD-updated parameters (params - grads) of the pipelined step (data 2, fsdp 2)
    against the one-device loss and gradient."""
    _check_pipelined_step(*pipelined)


def test_the_gpu_accumulation_loop_of_a_pipeline_matches_single_device(make_config, monkeypatch):
    """The circular grad_accum-2 case with the loop a GPU step runs (grad_reduce.each_micro_batch's
    trip count hidden), on CPU devices: the one-device loss and gradient."""
    monkeypatch.setattr(grad_reduce, "hides_trip_count", lambda: True)
    cfg = par_config(make_config, "btp", "cola", (2, 2, 1), **{**PIPELINE_KW, **PIPELINE_CASES["circular_accum2"]})
    built = build(cfg, optimizer=(optax.sgd(1.0), lambda s: 1.0))
    compiled = built.lower_train().compile()
    assert any(c.trips is None for c in parse_collectives(compiled.as_text(), built.mesh))
    _check_pipelined_step(cfg, (built.spec, compiled, built.batch_sharding, None, built.mesh))


def _check_pipelined_step(cfg, program):
    spec, compiled, batch_sharding, _, mesh = program
    params_host, tokens, (ref_loss, ref_grads) = reference(cfg)
    state = {
        "params": jax.device_put(params_host, spec.shardings["params"]),
        "opt_state": jax.device_put(optax.sgd(1.0).init(trainable(params_host)), spec.shardings["opt_state"]),
        "step": jax.device_put(np.zeros((), np.int32), spec.shardings["step"]),
        "rng": jax.device_put(np.zeros((2,), np.uint32), spec.shardings["rng"]),
    }
    a = cfg.train.grad_accum  # the same rows as [grad_accum, micro-batch, T+1]: the mean is the same
    new_state, metrics = compiled(state, jax.device_put(tokens.reshape(a, -1, tokens.shape[-1]), batch_sharding))
    assert bool(metrics["finite"])
    assert abs(float(metrics["loss"]) - ref_loss) <= 1e-5 * abs(ref_loss)
    new = trainable(jax.device_get(new_state["params"]))
    got = jax.tree.map(lambda p, q: p - q, trainable(params_host), new)
    assert_close_tree(got, trainable(ref_grads), 1e-4)


def test_pipeline_reduces_stage_gradients_once_per_pass(pipelined):
    """Executed data/fsdp reduction elements (in-loop ops x trip counts) are about one stage's
    gradient once per optimizer step plus the rest once per accumulation micro-batch, not one stage's
    gradient per tick, nor per accumulation micro-batch."""
    cfg, (spec, *_, executed, _) = pipelined
    stage, rest = stage_and_rest_elements(spec, cfg.parallel.pipeline)
    a = cfg.train.grad_accum
    assert stage + a * rest <= executed <= 1.01 * (stage + a * rest)


def test_circular_reorders_the_stage_weights_once_each_way(pipelined):
    """Circular and interleaved 1F1B: the stored [L] stacks reach the stages' chunk layout through all-to-alls over
    `pipeline` outside the tick loop (each stage's weights forward, their gradient back, both in their
    stored fsdp split), and nothing else over `pipeline` moves weights (no gather)."""
    cfg, (spec, compiled, _, _, mesh) = pipelined
    if cfg.parallel.pipeline_repeats == 1:
        pytest.skip("gpipe keeps the stored layout")
    stage, _ = stage_and_rest_elements(spec, cfg.parallel.pipeline)
    ops = [c for c in parse_collectives(compiled.as_text(), mesh) if c.axes == ("pipeline",) and not c.in_loop]
    moved, split = sum(c.elements for c in ops if c.kind == "all-to-all"), mesh.shape["fsdp"]
    assert 2 * stage / split <= moved <= 1.02 * 2 * stage / split, (moved, stage)
    assert not [c for c in ops if c.kind == "all-gather"]


def test_pipeline_per_tick_reduction_fails_the_count(make_config, monkeypatch):
    """The count above can fail: with GSPMD's own placement the stage gradient is reduced every tick."""
    for module in (stack, gspmd):  # where the gpipe step reads it
        monkeypatch.setattr(module, "once_per_pass_axes", lambda mesh, strategy: ())
    cfg = par_config(make_config, "btp", "cola", (2, 2, 1), **PIPELINE_KW)
    spec, *_, executed, _ = pipeline_program(cfg)
    stage, rest = stage_and_rest_elements(spec, cfg.parallel.pipeline)
    ticks = get_strategy(cfg.parallel).microbatches + cfg.parallel.pipeline - 1
    assert executed >= ticks * stage > 1.01 * (stage + rest)


# ------------------------------------------------------------------ one program, wherever it is traced


def executed_collectives(compiled, mesh) -> dict:
    """{(kind, axes): (count, executed elements)} of a compiled program."""
    out = {}
    for c in parse_collectives(compiled.as_text(), mesh):
        count, elements = out.get((c.kind, c.axes), (0, 0))
        out[(c.kind, c.axes)] = (count + 1, elements + c.elements * c.trips)
    return out


def test_the_built_step_compiles_alike_in_and_out_of_any_rules(make_config):
    """The step carries its mesh and strategy: lowered with no rules current, under its own, or under
    another strategy's, it is one program (each lowering from a fresh build, so nothing is cached)."""
    from boost_jax.parallel.rules import use_rules

    cfg = par_config(make_config, "btp", "cola", (8, 1, 1), **{"train.grad_accum": 4, "train.global_batch": 32})
    bare_build = build(cfg)
    bare = executed_collectives(bare_build.lower_train().compile(), bare_build.mesh)
    own = build(cfg)
    with use_rules(own.mesh, own.strategy):
        inside = executed_collectives(own.lower_train().compile(), own.mesh)
    other = build(cfg)
    vanilla = get_strategy(par_config(make_config, "vanilla", "cola", (8, 1, 1)).parallel)
    with use_rules(other.mesh, vanilla):
        foreign = executed_collectives(other.lower_train().compile(), other.mesh)
    assert bare == inside == foreign
    assert bare[("all-reduce", ("data",))][1] > 0  # the once-per-step island ran in all three


def test_a_placed_model_traced_outside_its_rules_is_refused(make_config):
    """A model built for a mesh, traced without that mesh's rules, would compile another program
    (its activation layouts unpinned): it raises, naming what to use, instead of falling back."""
    cfg = par_config(make_config, "btp", "cola", (2, 1, 4))
    built = build(cfg)
    tokens = jax.ShapeDtypeStruct((8, 17), np.int32)
    with pytest.raises(RuntimeError, match="traced outside its rules.*boost_jax.runtime.build"):
        jax.jit(lambda p, t: next_token_loss(built.spec.graphdef, p, t)).lower(built.spec.abstract["params"], tokens)
    jax.jit(built.loss_fn()).lower(built.spec.abstract["params"], tokens)  # the bound form lowers


@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("a", [2, 3, 4])
def test_the_plain_loop_starts_from_the_first_micro_batch(monkeypatch, hidden, a):
    """The plain accumulation (first micro-batch before the loop from PEEL_FROM on, in the scan and
    in the GPU loop of hidden count): the mean loss and gradient of float64 formulas on fresh random
    micro-batches, and `loop_trips` counts the loop's trips."""
    monkeypatch.setattr(grad_reduce, "hides_trip_count", lambda: hidden)
    rng = np.random.default_rng(a)
    w, x = rng.standard_normal(5), rng.standard_normal((a, 3, 5))

    def grad_fn(p, t):
        loss = lambda p: jax.numpy.mean((t @ p["w"]) ** 2)  # noqa: E731
        return jax.value_and_grad(loss)(p)

    loss, grads = jax.jit(lambda p, b: grad_reduce.accumulate_grads(grad_fn, p, b))({"w": w.astype(np.float32)}, x)
    want_loss = np.mean([np.mean((t @ w) ** 2) for t in x])
    want_grad = np.mean([2 * t.T @ (t @ w) / t.shape[0] for t in x], axis=0)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["w"]), want_grad, rtol=1e-5, atol=1e-6)
    assert grad_reduce.loop_trips(a) == (a - 1 if a >= grad_reduce.PEEL_FROM else a)
