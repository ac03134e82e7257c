"""The eval loss of a run's parameters over a loader's batches: the trainer's evaluations and
`python -m boost_jax.evaluate` both measure it here."""
from __future__ import annotations

import jax
import numpy as np

from boost_jax.errors import ConfigError


def _to_global(batch, sharding):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def eval_loss(built, data, params, *, batches: int | None = None, tokens: int | None = None,
              field: str = "train.eval_tokens") -> dict:
    """{"loss", "batches", "tokens"}: the mean next-token loss over `batches` global batches of
    `data` (default train.eval_batches) or, when `tokens` (default train.eval_tokens) is set, over
    whole batches until that many input tokens that are not padding were read (as CoLA counts its
    10M). Batches of documents are weighted by their counted targets, so exp(loss) is the perplexity
    per target token; stream batches all hold the same number and are averaged as they come."""
    t = built.cfg.train
    batches = t.eval_batches if batches is None else batches
    tokens = t.eval_tokens if tokens is None else tokens
    if tokens:
        have = data.input_tokens()
        if tokens > have:
            raise ConfigError(f"config field `{field}`: {tokens:,} tokens, but the eval split holds {have:,} "
                              f"(data.batching={data.batching}, seq_len {t.seq_len}); lower it or give a larger "
                              "data.eval_path / data.eval_fraction")
    documents = data.batching != "stream"
    results, seen, i = [], 0, 0
    while (seen < tokens) if tokens else (i < batches):
        out = built.eval_step(params, _to_global(data.batch(i * t.global_batch), built.eval_sharding))
        if documents:
            out = tuple(float(x) for x in jax.device_get(out))
            seen += int(out[2])
        else:
            seen += t.global_batch * t.seq_len
        results.append(out)
        i += 1
    if documents:
        loss = sum(r[0] for r in results) / max(sum(r[1] for r in results), 1)
    else:
        loss = float(np.mean(jax.device_get(results)))
    return {"loss": float(loss), "batches": i, "tokens": seen}
