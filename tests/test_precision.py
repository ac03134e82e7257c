"""Where precision is spent under bf16 compute: FSDP gathers weights in the compute dtype (half the
bytes of the float32 master copy), weight-gradient reductions run in `parallel.grad_reduce_dtype`
(float32), and the sharded bf16 step still computes what one device computes."""

import jax
import numpy as np
import pytest
from test_parallel import par_config
from tests_support import compiled_step

from boost_jax.data import build_loaders
from boost_jax.runtime.build import build
from boost_jax.tools.hlo_comm import parse_collectives

STEPS = 50
# A real (if short) run: the schedule warms up and decays over the 50 steps.
RUN = {"train.steps": STEPS, "train.warmup_steps": 5}


def initial_state(cfg):
    """A fresh random init on one device (host arrays), shared by every run of one config's shapes."""
    single = cfg.copy_and_resolve_references()
    single.parallel.update(data=1, fsdp=1, tensor=1, num_devices=1)
    return jax.device_get(build(single).init_state())


def run(compiled, cfg, state_host, steps):
    """(losses, final params) of `steps` train steps from state_host on the compiled step's mesh."""
    step, built = compiled[:2]
    batch_sharding, spec = built.batch_sharding, built.spec
    loader = build_loaders(cfg)[0]
    t = cfg.train
    state = jax.device_put(state_host, spec.shardings)
    losses = []
    for i in range(steps):
        tokens = loader.batch(i * t.global_batch).reshape(t.grad_accum, -1, t.seq_len + 1)
        state, metrics = step(state, jax.device_put(tokens, batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state["params"])


def bf16(make_config, mesh, **kw):
    """The btp CoLA test model in bf16 on `mesh` (data, fsdp, tensor)."""
    return par_config(make_config, "btp", "cola", mesh, **{"model.dtype": "bfloat16", **RUN, **kw})


@pytest.fixture(scope="module")
def sharded_bf16(tmp_path_factory):
    """The bf16 btp step on data=2 x fsdp=2 x tensor=2, compiled once for the HLO and the runs."""
    from conftest import small_config

    cfg = bf16(lambda **kw: small_config(tmp_path_factory.mktemp("run"), **kw), (2, 2, 2))
    return cfg, compiled_step(cfg, partitioned=True)


def check_precision_placement(colls):
    """Every float all-gather over fsdp (the weights: this model gathers no activation over fsdp) is
    bf16; every float reduction over data or fsdp (weight gradients; the loss's scalars) is float32."""
    gathers = [c for c in colls if c.kind == "all-gather" and "fsdp" in c.axes and c.dtype[0] in "fb"]
    assert gathers and {c.dtype for c in gathers} == {"bf16"}, {(c.dtype, c.elements, c.op_name) for c in gathers}
    reductions = [
        c
        for c in colls
        if c.kind in ("all-reduce", "reduce-scatter") and {"data", "fsdp"} & set(c.axes) and c.dtype[0] in "fb"
    ]
    wide = [c for c in reductions if c.dtype != "f32"]
    assert not wide, {(c.kind, c.dtype, c.elements, c.axes, c.op_name) for c in wide}
    # The weight gradients are among them: more elements than one device holds of the weights.
    return sum(c.elements for c in gathers), sum(c.elements for c in reductions if c.elements > 1)


def test_fsdp_gathers_bf16_and_reduces_gradients_in_f32(make_config):
    cfg = bf16(make_config, (1, 8, 1))
    _, built, text = compiled_step(cfg, partitioned=True)
    gathered, reduced = check_precision_placement(parse_collectives(text, built.mesh))
    # At least one layer's projections (the layer scan's body is listed once).
    n_weights = 7 * cfg.model.rank * 2 * cfg.model.d_model
    assert gathered >= n_weights and reduced >= n_weights, (gathered, reduced, n_weights)


def test_2x2x2_gathers_bf16_and_reduces_gradients_in_f32(sharded_bf16):
    cfg, (_, built, text) = sharded_bf16
    colls = parse_collectives(text, built.mesh)
    check_precision_placement(colls)
    # The once-per-step reduction over `data` (parallel/grad_reduce.py) is still there, in float32.
    assert (
        sum(
            c.elements
            for c in colls
            if c.axes == ("data",) and c.kind == "all-reduce" and c.dtype == "f32" and not c.in_loop
        )
        > 0
    )


_STATES: dict = {}
_COMPILED: dict = {}


def shared_init(cfg):
    key = cfg.model.to_json()
    if key not in _STATES:
        _STATES[key] = initial_state(cfg)
    return _STATES[key]


def shared_step(cfg):
    """compiled_step(cfg), compiled once per module for the one-device references."""
    key = (cfg.model.to_json(), cfg.parallel.to_json(), cfg.train.to_json())
    if key not in _COMPILED:
        _COMPILED[key] = compiled_step(cfg)
    return _COMPILED[key]


def one_device(make_config, dtype):
    return par_config(make_config, "btp", "cola", (1, 1, 1), **{"model.dtype": dtype, **RUN})


def updates(params, state):
    return [np.asarray(p) - p0 for p, p0 in zip(jax.tree.leaves(params), jax.tree.leaves(state["params"]))]


def test_sharded_bf16_step_matches_one_device(make_config, sharded_bf16):
    """Three steps from one random init (lr is 0 at step 0 of the warmup): the losses, and every
    parameter's total update, which may differ from the one-device bf16 update by no more than
    bf16 itself moves it (one-device bf16 against one-device float32), twice over."""
    cfg, compiled = sharded_bf16
    state = shared_init(cfg)
    one, f32 = one_device(make_config, "bfloat16"), one_device(make_config, "float32")
    losses, params = run(compiled, cfg, state, 3)
    ref_losses, ref_params = run(shared_step(one), one, state, 3)
    _, f32_params = run(shared_step(f32), f32, state, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for path, got, want, wide in zip(
        paths, updates(params, state), updates(ref_params, state), updates(f32_params, state)
    ):
        if not np.issubdtype(want.dtype, np.floating):
            continue
        assert np.linalg.norm(want) > 0, path  # the step did update it
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        noise = np.linalg.norm(want - wide) / np.linalg.norm(wide)
        assert err <= 2 * noise + 5e-3, f"{path}: update off by {err:.2e} (bf16 vs f32 on one device: {noise:.2e})"


def test_bf16_training_tracks_f32(make_config, sharded_bf16):
    """50 steps of bf16 training on 2x2x2 against float32 on one device: within 2% at every step."""
    cfg, compiled = sharded_bf16
    state = shared_init(cfg)
    f32 = one_device(make_config, "float32")
    losses, _ = run(compiled, cfg, state, STEPS)
    ref, _ = run(shared_step(f32), f32, state, STEPS)
    assert ref[-1] < 0.8 * ref[0], ref  # it trains: the comparison is over a moving curve
    rel = np.abs(losses - ref) / ref
    i = int(rel.argmax())
    assert rel[i] <= 2e-2, f"step {i + 1}: bf16 {losses[i]:.4f} vs f32 {ref[i]:.4f}"


def test_bf16_parameters_train_like_f32(make_config):
    """`model.param_dtype=bfloat16` (parameters and AdamW state in bf16, as the official CoLA recipe trains)
    on one device: every trained leaf and moment is bf16, and 20 steps from the same init track the
    float32-parameter run within 3% at every step while both train."""
    steps = 20
    f32 = one_device(make_config, "float32")
    low = par_config(
        make_config, "btp", "cola", (1, 1, 1), **{"model.dtype": "float32", "model.param_dtype": "bfloat16", **RUN}
    )
    state = shared_init(f32)
    compiled = shared_step(low)
    built = compiled[1]
    leaves = jax.tree.leaves(built.spec.abstract["params"]) + jax.tree.leaves(built.spec.abstract["opt_state"])
    floats = [x.dtype for x in leaves if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
    assert floats and set(floats) == {np.dtype(jax.numpy.bfloat16)}, set(floats)
    low_state = jax.tree.map(lambda x, a: np.asarray(x).astype(a.dtype), state, built.spec.abstract)
    losses, _ = run(compiled, low, low_state, steps)
    ref, _ = run(shared_step(f32), f32, state, steps)
    assert ref[-1] < 0.9 * ref[0] and losses[-1] < 0.9 * losses[0], (ref, losses)
    rel = np.abs(losses - ref) / ref
    i = int(rel.argmax())
    assert rel[i] <= 3e-2, f"step {i + 1}: bf16 parameters {losses[i]:.4f} vs float32 {ref[i]:.4f}"
