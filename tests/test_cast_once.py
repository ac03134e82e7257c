"""The weights cast to the compute dtype once per step (train.weight_casts=step, runtime/state.py `step_casts`):
the step equals the step that casts them in every micro-batch, bit for bit; its gradient still
accumulates in float32; and the casts of the weights sit outside the accumulation loop of the traced step
(inside it without the switch; the GPU program's kernels: benchmarks/RESULTS.md, 2026-11-29 ninth session).
Tiny bfloat16 models on emulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from jax.extend import core as jax_core

from boost_jax.runtime.build import build

CASES = {
    "one_device": {"parallel.num_devices": 1, "parallel.data": 1},
    "data2_megatron_tensor2": {
        "parallel.num_devices": 4,
        "parallel.data": 2,
        "parallel.tensor": 2,
        "parallel.strategy": "megatron",
    },
}


def _none(x) -> bool:
    return x is None


def _built(tmp_path, case: str, cast_once: bool):
    over = {
        "model.dtype": "bfloat16",
        "train.grad_accum": 2,
        "train.weight_casts": "step" if cast_once else "micro_batch",
        **CASES[case],
    }
    return build(small_config(tmp_path, **over))


def _batch(built, seed: int):
    t = built.cfg.train
    shape = (t.grad_accum, t.global_batch // t.grad_accum, t.seq_len + 1)
    tokens = np.random.default_rng(seed).integers(0, built.cfg.model.vocab_size, shape, dtype=np.int32)
    return jax.device_put(tokens, built.batch_sharding)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_step_equals_the_step_casting_in_every_micro_batch(tmp_path, case):
    seed = int(np.random.default_rng().integers(1 << 30))
    out = {}
    for on in (True, False):
        built = _built(tmp_path / str(on), case, on)
        state = built.init_state()
        for step in range(2):
            state, metrics = built.train_step(state, _batch(built, seed + step))
        out[on] = (built.spec.casts, jax.device_get(state["params"]), jax.device_get(metrics))
    casts, params, metrics = out[True]
    flat = dict(jax.tree_util.tree_flatten_with_path(casts, is_leaf=_none)[0])
    cast = {jax.tree_util.keystr(k) for k, v in flat.items() if v is not None}
    assert cast and all("scale" not in k for k in cast), cast  # the matrices, never a norm's scale
    assert any("embed" in k for k in cast) and out[False][0] is None
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(out[False][1])):
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    for key in ("loss", "grad_norm"):
        assert metrics[key] == out[False][2][key], key


def _subjaxprs(eqn):
    return [getattr(j, "jaxpr", j) for j in jax_core.jaxprs_in_params(eqn.params)]


def _weight_casts(jaxpr, shapes: set, inside: bool = False, counts=None) -> list:
    """[casts float32 -> bfloat16 of a weight (an input of its jaxpr of a weight's shape) outside the
    accumulation loop (the step's first scan), inside it] in a traced step, and the (shape, dtype) of
    that loop's carry."""
    counts = counts if counts is not None else [0, 0, set()]
    given = set(jaxpr.invars) | set(jaxpr.constvars)  # a weight comes in; a gradient is computed here
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.invars[0] in given:
            x = eqn.invars[0].aval
            if x.dtype == jnp.float32 and eqn.params["new_dtype"] == jnp.bfloat16 and x.shape in shapes:
                counts[inside] += 1
        loop = eqn.primitive.name == "scan" and not inside and not counts[2]
        if loop:
            n = eqn.params["num_consts"]
            counts[2] = {(v.aval.shape, v.aval.dtype.name) for v in eqn.invars[n : n + eqn.params["num_carry"]]}
        for sub in _subjaxprs(eqn):
            _weight_casts(sub, shapes, inside or loop, counts)
    return counts


def test_the_weights_are_cast_outside_the_accumulation_loop_and_accumulate_in_float32(tmp_path):
    """The traced step: with cast_once each cast weight is cast once, outside the accumulation loop,
    and not in it; without it, each is cast in the loop. The loop carries a float32
    gradient of each cast weight (per data replica: [data, ...]), no bfloat16 one."""
    case = "data2_megatron_tensor2"
    got, casts = {}, None
    for on in (True, False):
        built = _built(tmp_path / str(on), case, on)
        casts = built.spec.casts if on else casts
        cast = [
            p
            for c, p in zip(jax.tree.leaves(casts, is_leaf=_none), jax.tree.leaves(built.spec.abstract["params"]))
            if c
        ]
        shapes = {p.shape for p in cast} | {p.shape[1:] for p in cast if p.ndim == 3}  # stacked: one layer's
        jaxpr = jax.make_jaxpr(built.train_step)(built.spec.abstract, built.abstract_batch()).jaxpr
        got[on] = _weight_casts(jaxpr, shapes)
    outside, inside, carry = got[True]
    # Each cast weight once, before the loop, where the loop cast each of them (the loss's chunk loop
    # narrows the head weight it widened, in the loop either way: model/loss.py `head_loss`).
    assert outside == len(cast) and got[False][0] == 0, (got, len(cast))
    assert got[False][1] - inside >= len(cast), (got, len(cast))
    for p in cast:
        assert ((2, *p.shape), "float32") in carry and not any(d == "bfloat16" and s[1:] == p.shape for s, d in carry)


def test_which_weights_are_cast_once(tmp_path):
    """`auto` casts once for a factored kind over several micro-batches, not for dense nor over one;
    `step` never casts a norm scale, nor a weight `fsdp` gathers (its gradient is reduced over fsdp
    before it would reach the bf16 copy)."""

    def cast(**over):
        spec = build(small_config(tmp_path, **{"model.dtype": "bfloat16", "train.grad_accum": 2, **over})).spec
        flat = jax.tree_util.tree_flatten_with_path(spec.casts, is_leaf=_none)[0] if spec.casts else []
        return {jax.tree_util.keystr(k) for k, v in flat if v is not None}

    one = {"parallel.num_devices": 1, "parallel.data": 1}
    assert cast(**one) and not cast(**one, **{"model.linear": "dense"}) and not cast(**one, **{"train.grad_accum": 1})
    assert cast(**one, **{"model.linear": "dense", "train.weight_casts": "step"})
    assert not cast(**one, **{"train.weight_casts": "micro_batch"})
    assert not cast(**one, **{"model.dtype": "float32"})  # nothing to cast
    fsdp = cast(**{"parallel.num_devices": 4, "parallel.data": 1, "parallel.fsdp": 2, "parallel.tensor": 2})
    whole = cast(**{"parallel.num_devices": 4, "parallel.data": 2, "parallel.tensor": 2})
    assert fsdp < whole and all("scale" not in k for k in whole), (fsdp, whole)
