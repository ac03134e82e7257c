"""Pipeline schedules end to end: each schedule x each strategy with pipeline 2 on the 8-device mesh
resumes bit for bit and starts from a checkpoint written without a pipeline (Orbax reads the stored
[L, ...] layer stacks into the pipelined layout; the circular schedule reorders them in the step).
Loss and gradients against one device: tests/test_parallel.py::test_pipeline_schedules_match_single_device."""
import jax
import numpy as np
import pytest

from boost_jax import train
from tests_support import metric_rows

SMALL = {"model.d_model": 64, "model.n_heads": 8, "model.n_kv_heads": 8, "model.d_ff": 128, "model.rank": 16,
         "model.n_layers": 4, "train.log_every": 1, "train.eval_every": 0, "train.steps": 5,
         "checkpoint.every": 1, "train.global_batch": 16}
SCHEDULES = {"gpipe": {}, "circular": {"parallel.pipeline_schedule": "circular", "parallel.pipeline_repeats": 2}}
MESHES = {"btp": dict(data=1, fsdp=2, tensor=2), "megatron": dict(data=2, fsdp=1, tensor=2),
          "vanilla": dict(data=2, fsdp=1, tensor=2)}
DEFAULT_RUN = {("btp", "gpipe"), ("megatron", "circular")}  # the rest of the matrix runs with -m slow
CASES = [pytest.param(s, k, id=f"{s}-{k}", marks=() if (s, k) in DEFAULT_RUN else pytest.mark.slow)
         for s in MESHES for k in SCHEDULES]


@pytest.fixture(scope="module")
def unpipelined(tmp_path_factory):
    """A run of 2 steps on one device, no pipeline, and its third step's loss (the same run resumed)."""
    from conftest import small_config
    root = tmp_path_factory.mktemp("unpipelined")
    train.run(small_config(root / "run", **{**SMALL, "parallel.num_devices": 1, "train.stop_at_step": 2}))
    cont = small_config(root / "cont", **{**SMALL, "parallel.num_devices": 1, "train.stop_at_step": 3,
                                          "restore_from": str(root / "run")})
    train.run(cont)
    return root / "run", metric_rows(root / "cont")[3]


def params_of(run_dir, step):
    from flax import nnx
    from boost_jax.runtime.build import load_model
    model, _, _ = load_model(str(run_dir / "checkpoints" / str(step)))
    return jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))


@pytest.mark.parametrize("strategy,schedule", CASES)
def test_pipeline_resumes_bit_exactly_from_an_unpipelined_checkpoint(make_config, tmp_path, unpipelined, strategy,
                                                                    schedule):
    saved, loss3 = unpipelined
    kw = {**SMALL, **SCHEDULES[schedule], "parallel.pipeline": 2, "parallel.strategy": strategy,
          "parallel.num_devices": 8, "restore_from": str(saved),
          **{f"parallel.{k}": v for k, v in MESHES[strategy].items()}}
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
