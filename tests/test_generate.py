"""KV-cache decoding matches the no-cache forward pass; the CLI samples from a saved run."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax import train
from boost_jax.generate import generate
from boost_jax.model import build_model


@pytest.mark.parametrize("residual_norm", ["separate", "fused"])  # fused: blocks hand (stream, MLP output) on
def test_cached_decoding_matches_full_forward(make_config, residual_norm):
    cfg = make_config(**{"model.n_kv_heads": 2})
    model = build_model(cfg.model, seed=3, residual_norm=residual_norm)
    prompt = np.random.default_rng(0).integers(0, 256, (2, 5)).astype(np.int32)
    out = generate(model, prompt, 7, temperature=0.0)
    full, _ = model(jnp.asarray(out))
    # greedy: each new token is the argmax of the uncached logits at the previous position
    np.testing.assert_array_equal(np.argmax(np.asarray(full[:, 4:-1]), -1), out[:, 5:])
    # and the cached logits equal the uncached ones position by position
    cache = model.init_cache(2, 12)
    logits, cache = model(jnp.asarray(out[:, :5]), jnp.broadcast_to(jnp.arange(5), (2, 5)), cache)
    steps = [logits[:, -1]]
    for i in range(5, 11):
        logits, cache = model(jnp.asarray(out[:, i : i + 1]), jnp.full((2, 1), i), cache)
        steps.append(logits[:, -1])
    np.testing.assert_allclose(np.stack(steps, 1), np.asarray(full[:, 4:11]), rtol=1e-4, atol=1e-4)


def test_generate_cli_from_checkpoint(make_config):
    cfg = make_config()
    train.run(cfg)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "boost_jax.generate",
            "--checkpoint",
            cfg.run_dir,
            "--prompt",
            "import os",
            "--max_new_tokens",
            "12",
            "--temperature",
            "0.7",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("import os") and len(r.stdout.strip()) > len("import os")


def test_generate_from_a_pipelined_tensor_parallel_run(make_config):
    cfg = make_config(
        **{
            "parallel.pipeline": 2,
            "parallel.tensor": 2,
            "parallel.data": 2,
            "model.n_layers": 2,
            "train.steps": 2,
            "train.eval_every": 0,
            "checkpoint.every": 2,
        }
    )
    train.run(cfg)
    from boost_jax.runtime.build import load_model

    model, loaded, _ = load_model(cfg.run_dir)  # onto one device, whatever mesh saved it
    out = generate(model, np.zeros((1, 3), np.int32), 4)
    assert out.shape == (1, 7) and loaded.parallel.pipeline == 1
