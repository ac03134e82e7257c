"""Pipeline schedules end to end: each schedule x each strategy with pipeline 2 on the 8-device mesh
resumes bit for bit and starts from a checkpoint written without a pipeline (Orbax reads the stored
[L, ...] layer stacks into the pipelined layout; the circular schedule reorders them in the step); a
gpipe checkpoint resumes under 1f1b and back. Loss and gradients against one device:
tests/test_parallel.py::test_pipeline_schedules_match_single_device, and here 1F1B's train step
(interleaved or not, stream or packed rows, grad_accum 1 or 2, stage remat or not) on pipeline 2 x
data 2 x tensor 2 and pipeline 4 x tensor 2."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_parallel import assert_close_tree, par_config, reference
from tests_support import metric_rows

from boost_jax import train
from boost_jax.parallel.pipeline import arithmetic
from boost_jax.runtime.build import build
from boost_jax.runtime.state import trainable

SMALL = {
    "model.d_model": 64,
    "model.n_heads": 8,
    "model.n_kv_heads": 8,
    "model.d_ff": 128,
    "model.rank": 16,
    "model.n_layers": 4,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.steps": 5,
    "checkpoint.every": 1,
    "train.global_batch": 16,
}
SCHEDULES = {
    "gpipe": {},
    "circular": {"parallel.pipeline_schedule": "circular", "parallel.pipeline_repeats": 2},
    "1f1b": {"parallel.pipeline_schedule": "1f1b"},
    "1f1b_v2": {"parallel.pipeline_schedule": "1f1b", "parallel.pipeline_repeats": 2},
}
MESHES = {
    "btp": dict(data=1, fsdp=2, tensor=2),
    "megatron": dict(data=2, fsdp=1, tensor=2),
    "vanilla": dict(data=2, fsdp=1, tensor=2),
}
DEFAULT_RUN = {("btp", "gpipe")}  # the rest of the matrix runs with -m slow (a resume across schedules: below)
CASES = [
    pytest.param(s, k, id=f"{s}-{k}", marks=() if (s, k) in DEFAULT_RUN else pytest.mark.slow)
    for s in MESHES
    for k in SCHEDULES
]


@pytest.fixture(scope="module")
def unpipelined(tmp_path_factory):
    """A run of 2 steps on one device, no pipeline, and its third step's loss (the same run resumed)."""
    from conftest import small_config

    root = tmp_path_factory.mktemp("unpipelined")
    train.run(small_config(root / "run", **{**SMALL, "parallel.num_devices": 1, "train.stop_at_step": 2}))
    cont = small_config(
        root / "cont",
        **{**SMALL, "parallel.num_devices": 1, "train.stop_at_step": 3, "restore_from": str(root / "run")},
    )
    train.run(cont)
    return root / "run", metric_rows(root / "cont")[3]


def params_of(run_dir, step):
    from flax import nnx

    from boost_jax.runtime.build import load_model

    model, _, _ = load_model(str(run_dir / "checkpoints" / str(step)))
    return jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))


@pytest.mark.parametrize("strategy,schedule", CASES)
def test_pipeline_resumes_bit_exactly_from_an_unpipelined_checkpoint(
    make_config, tmp_path, unpipelined, strategy, schedule
):
    saved, loss3 = unpipelined
    kw = {
        **SMALL,
        **SCHEDULES[schedule],
        "parallel.pipeline": 2,
        "parallel.strategy": strategy,
        "parallel.num_devices": 8,
        "restore_from": str(saved),
        **{f"parallel.{k}": v for k, v in MESHES[strategy].items()},
    }
    straight = make_config(**{**kw, "run_dir": str(tmp_path / "a")})
    assert train.run(straight)["step"] == 5
    first = make_config(**{**kw, "run_dir": str(tmp_path / "b"), "train.stop_at_step": 4})
    assert train.run(first)["step"] == 4
    again = make_config(**{**kw, "run_dir": str(tmp_path / "b")})  # resumes its own step 4
    assert train.run(again)["step"] == 5
    a, b = metric_rows(tmp_path / "a"), metric_rows(tmp_path / "b")
    assert min(a) == 3  # started from the unpipelined step 2
    # The first pipelined step computes the unpipelined run's third loss from the restored weights.
    assert abs(a[3] - loss3) <= 1e-5 * abs(loss3), (a[3], loss3)
    assert [a[s] for s in (3, 4, 5)] == [b[s] for s in (3, 4, 5)]
    for x, y in zip(params_of(tmp_path / "a", 5), params_of(tmp_path / "b", 5)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("first,then", [("gpipe", "1f1b"), pytest.param("1f1b_v2", "gpipe", marks=pytest.mark.slow)])
def test_a_checkpoint_resumes_across_schedules(make_config, tmp_path, first, then):
    """A run checkpointed under one schedule resumes under another (every schedule stores the [L, ...]
    stacks alike): the next step's loss is the one the first schedule computes from the same weights,
    within float32 rounding (the schedules sum in other orders); each schedule resuming its own
    checkpoint is bit for bit (test_pipeline_resumes_bit_exactly_from_an_unpipelined_checkpoint)."""
    mesh = {f"parallel.{k}": v for k, v in MESHES["megatron"].items()}
    kw = {**SMALL, **mesh, "parallel.pipeline": 2, "parallel.strategy": "megatron", "parallel.num_devices": 8}
    assert (
        train.run(make_config(**{**kw, **SCHEDULES[first], "run_dir": str(tmp_path / "a"), "train.stop_at_step": 3}))[
            "step"
        ]
        == 3
    )
    cont = make_config(
        **{
            **kw,
            **SCHEDULES[then],
            "run_dir": str(tmp_path / "b"),
            "train.stop_at_step": 3,
            "restore_from": str(tmp_path / "a" / "checkpoints" / "2"),
        }
    )
    assert train.run(cont)["step"] == 3
    want, got = metric_rows(tmp_path / "a")[3], metric_rows(tmp_path / "b")[3]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


# 1F1B's train step against one device: (mesh, V, data.batching, grad_accum, remat.pipeline). The
# matrix runs with -m slow; its first case (interleaved, packed rows, grad_accum 2, no stage remat,
# pipeline 2 x data 2 x tensor 2) in the default suite.
F1B_MESHES = {"p2_d2_t2": ((2, 1, 2), 2, 4), "p4_t2": ((1, 1, 2), 4, 8)}  # (data, fsdp, tensor), S, layers
F1B_CASES = [
    ("p2_d2_t2", 2, "packed", 2, "none"),
    ("p2_d2_t2", 1, "stream", 1, "none"),
    ("p2_d2_t2", 1, "packed", 2, "stage"),
    ("p2_d2_t2", 2, "stream", 1, "stage"),
    ("p4_t2", 1, "stream", 2, "stage"),
    ("p4_t2", 2, "packed", 1, "none"),
    ("p4_t2", 1, "packed", 1, "none"),
    ("p4_t2", 2, "stream", 2, "stage"),
]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=() if i == 0 else pytest.mark.slow, id="-".join(map(str, c)))
        for i, c in enumerate(F1B_CASES)
    ],
)
def test_1f1b_train_step_matches_one_device(make_config, case):
    """The compiled train step (SGD at lr 1: new params = params - grads) under 1F1B: its loss and every
    gradient within 1e-5 of the one-device, unpipelined model's on the same batch (float32; the eval
    step's loss, its forward ticks alone, too), and its
    tick loop hands over once each way per lockstep tick, V M + V S + S - 2 of them per accumulation
    micro-batch."""
    mesh_name, v, batching, accum, remat = case
    (data, fsdp, tensor), stages, layers = F1B_MESHES[mesh_name]
    cfg = par_config(
        make_config,
        "btp",
        "cola",
        (data, fsdp, tensor),
        **{
            "parallel.pipeline": stages,
            "model.n_layers": layers,
            "parallel.pipeline_schedule": "1f1b",
            "parallel.pipeline_repeats": v,
            "data.batching": batching,
            "model.attention": "chunked",
            "train.grad_accum": accum,
            "train.global_batch": 8 * accum,
            "remat.pipeline": remat,
        },
    )
    params_host, tokens, (ref_loss, ref_grads) = reference(cfg)
    built = build(cfg, optimizer=(optax.sgd(1.0), lambda s: 1.0))
    spec = built.spec
    # the eval step (1F1B's forward ticks alone, no gradient): the reference's loss (a sum for documents)
    from boost_jax.runtime.step import make_eval_step

    evaluate = jax.jit(make_eval_step(spec.graphdef, 1, built.mesh, built.strategy))
    rows = NamedSharding(built.mesh, P(("data", "fsdp")))
    got = evaluate(jax.device_put(params_host, spec.shardings["params"]), jax.device_put(tokens, rows))
    got = float((got[0] if batching != "stream" else got).sum())
    assert abs(got - ref_loss) <= 1e-5 * abs(ref_loss), (got, ref_loss)
    if batching != "stream":  # the reference is the sum over the counted targets; the step their mean
        from boost_jax.model import batch as batch_lib

        count = float(np.asarray(batch_lib.target_mask(tokens)).sum())
        ref_loss, ref_grads = ref_loss / count, jax.tree.map(lambda g: g / count, ref_grads)
    compiled = built.lower_train().compile()
    state = {
        "params": jax.device_put(params_host, spec.shardings["params"]),
        "opt_state": jax.device_put(optax.sgd(1.0).init(trainable(params_host)), spec.shardings["opt_state"]),
        "step": jax.device_put(np.zeros((), np.int32), spec.shardings["step"]),
        "rng": jax.device_put(np.zeros((2,), np.uint32), spec.shardings["rng"]),
    }
    batch = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), tokens)
    new_state, metrics = compiled(state, jax.device_put(batch, built.batch_sharding))
    assert bool(metrics["finite"])
    assert abs(float(metrics["loss"]) - ref_loss) <= 1e-5 * abs(ref_loss), (float(metrics["loss"]), ref_loss)
    got = jax.tree.map(lambda p, q: p - q, trainable(params_host), trainable(jax.device_get(new_state["params"])))
    assert_close_tree(got, trainable(ref_grads), 1e-5)
    from boost_jax.tools.hlo_comm import parse_collectives

    m = cfg.parallel.microbatches or 2 * stages
    trips = {
        c.trips
        for c in parse_collectives(compiled.as_text(), built.mesh)
        if c.kind == "collective-permute" and c.axes == ("pipeline",) and c.in_loop
    }
    # The hand-overs run once per lockstep tick; anything else over `pipeline` in a loop runs once per
    # accumulation micro-batch (x's gradient taken from stage 0, which XLA may lower to a permute).
    ticks = {t for t in trips if t > accum}
    assert ticks == {accum * arithmetic.ticks_1f1b(stages, m, v)} == {accum * (v * m + v * stages + stages - 2)}, trips
    assert trips - ticks <= {accum}, trips


@pytest.mark.parametrize("remat", ["none", "stage"])
def test_1f1b_memory_does_not_grow_with_the_micro_batches(make_config, remat):
    """1F1B embeds each micro-batch at stage 0 in the tick its first chunk runs and takes its loss at
    the last stage in the tick its forward ends: the compiled train step's temp memory at M = 16 is
    within 5% of M = 4 (one row per micro-batch, pipeline 2 x tensor 2). A block of the M embedded
    inputs or of their gradients kept for the pass grows it by one [seq, d] float32 buffer per
    micro-batch: +12% here."""
    temp = {}
    for m in (4, 16):
        cfg = par_config(
            make_config,
            "btp",
            "cola",
            (1, 1, 2),
            **{
                "parallel.pipeline": 2,
                "parallel.microbatches": m,
                "parallel.pipeline_schedule": "1f1b",
                "model.n_layers": 2,
                "model.d_model": 128,
                "model.d_ff": 256,
                "model.rank": 32,
                "model.vocab_size": 256,
                "model.max_seq_len": 256,
                "model.attention": "chunked",
                "train.seq_len": 256,
                "train.global_batch": m,
                "data.batching": "stream",
                "remat.policy": "lowrank",
                "remat.pipeline": remat,
            },
        )
        temp[m] = build(cfg).lower_train().compile().memory_analysis().temp_size_in_bytes
    assert temp[16] <= 1.05 * temp[4], temp
