"""The eval loss of a run's parameters over a loader's batches: the trainer's evaluations and
`python -m boost_jax.evaluate` both measure it here."""
from __future__ import annotations

import jax
import numpy as np

from boost_jax.errors import ConfigError
from boost_jax.runtime.build import to_global


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
        out = built.eval_step(params, to_global(data.batch(i * t.global_batch), built.eval_sharding))
        if documents and tokens:  # the count decides when to stop: read it now
            seen += int(jax.device_get(out[2]))
        elif not documents:
            seen += t.global_batch * t.seq_len
        results.append(out)
        i += 1
    results = jax.device_get(results)
    if documents:
        seen = seen if tokens else int(sum(r[2] for r in results))
        loss = float(sum(r[0] for r in results)) / max(int(sum(r[1] for r in results)), 1)
    else:
        loss = float(np.mean(results))
    return {"loss": float(loss), "batches": i, "tokens": seen}
