"""Sample from a saved run: `python -m boost_jax.generate --checkpoint RUN_DIR --prompt "def "`.

Prefills the prompt once into a KV cache, then decodes one token per jitted step (greedy when
--temperature 0, else temperature and top-k sampling).
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging as absl_logging
from flax import nnx

from boost_jax import xla_gpu_flags
from boost_jax.errors import CheckpointError, ConfigError
from boost_jax.runtime.build import load_model


def sample_next(logits, rng, temperature: float, top_k: int):
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1)


def generate(
    model, prompt: np.ndarray, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0, seed: int = 0
) -> np.ndarray:
    """prompt: [B, P] int tokens -> [B, P + max_new_tokens]."""
    graphdef, params = nnx.split(model)
    b, p = prompt.shape
    cache = model.init_cache(b, p + max_new_tokens)

    @jax.jit
    def prefill(params, cache, tokens):
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
        logits, cache = nnx.merge(graphdef, params)(tokens, pos, cache)
        return logits[:, -1], cache

    @jax.jit
    def decode(params, cache, token, pos, rng):
        logits, cache = nnx.merge(graphdef, params)(token[:, None], jnp.full((b, 1), pos), cache)
        return logits[:, -1], cache

    rng = jax.random.key(seed)
    logits, cache = prefill(params, cache, jnp.asarray(prompt, jnp.int32))
    out = [np.asarray(prompt)]
    for i in range(max_new_tokens):
        rng, sub = jax.random.split(rng)
        token = sample_next(logits, sub, temperature, top_k)
        out.append(np.asarray(token)[:, None])
        if i + 1 < max_new_tokens:
            logits, cache = decode(params, cache, token, p + i, rng)
    return np.concatenate(out, axis=1)


def main(argv=None) -> int:
    xla_gpu_flags.quiet_gpu_plugin()  # before JAX starts its backends
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="run dir, its checkpoints/ dir, or one step dir")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--max_new_tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top_k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.top_k < 0 or not args.temperature >= 0:  # NaN compares false: refused too
        ap.error("--top_k and --temperature must be >= 0 (0: no top-k / greedy)")
    if not math.isfinite(args.temperature):
        ap.error(f"--temperature {args.temperature}: give a finite number (0: greedy, 1: the model's own distribution)")
    if not args.prompt:
        ap.error("--prompt is empty: give at least one character to start from")
    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        model, cfg, tok = load_model(args.checkpoint)
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    ids = np.asarray([tok.encode(args.prompt)], dtype=np.int32)
    args.top_k = min(args.top_k, cfg.model.vocab_size)  # top-k of the whole vocabulary keeps every token
    room = cfg.model.max_seq_len - ids.shape[1]  # the model's context bounds the KV cache (and memory)
    if room < 1:
        print(
            f"error: --prompt: its {ids.shape[1]} tokens fill the model's context (model.max_seq_len="
            f"{cfg.model.max_seq_len}); shorten it",
            file=sys.stderr,
        )
        return 1
    if args.max_new_tokens > room:
        print(
            f"note: --max_new_tokens {args.max_new_tokens} runs past the model's context (model.max_seq_len="
            f"{cfg.model.max_seq_len}, prompt {ids.shape[1]} tokens): generating {room}",
            file=sys.stderr,
        )
        args.max_new_tokens = room
    out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(tok.decode(out[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
