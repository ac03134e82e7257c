"""The eval loss of a run's parameters over a loader's batches: the trainer's evaluations and
`python -m boost_jax.evaluate` both measure it here."""
from __future__ import annotations

import jax
import numpy as np

from boost_jax.errors import ConfigError
from boost_jax.runtime.build import to_global


class EvalInterrupted(Exception):
    """`eval_loss` stopped between batches because its `stop()` said so (a signal during a long eval)."""


def eval_loss(built, data, params, *, batches: int | None = None, tokens: int | None = None,
              field: str = "train.eval_tokens", stop=None) -> dict:
    """The eval loss of `params` over `batches` global batches of `data` (default train.eval_batches)
    or, when `tokens` (default train.eval_tokens) is set, over whole batches read as CoLA's evaluation
    loop reads them: before each batch it stops if more than `tokens` input tokens that are not
    padding were read (`>`: a count that lands exactly on `tokens` reads one batch more); a batch
    never wraps round to the split's start (asking for more is a ConfigError naming how many the
    split's whole batches hold). Returns

    - "loss": the mean over every counted target (batches of documents weighted by their targets; stream
      batches all hold the same number), so exp(loss) is the perplexity per target token;
    - "cola_loss": CoLA's reported form (its `evaluate_model`): the sum of each batch's mean loss divided
      by n+1 after n batches (its batch counter starts at 1), a batch being one eval slice of
      `cola_batch_rows` = train.global_batch / (train.eval_microbatches or train.grad_accum) rows, as
      each GPU's `--batch_size` batch is there (the slices of a global batch are averaged first, as
      DDP averages the GPUs); "cola_denominator" is that n+1;
    - "batches", "tokens": the global batches and the input tokens that are not padding read.

    `stop`: a callable asked before each batch; True raises EvalInterrupted (a stop signal during a
    long evaluation: the trainer then saves and exits instead of finishing it)."""
    t = built.cfg.train
    batches = t.eval_batches if batches is None else batches
    tokens = t.eval_tokens if tokens is None else tokens
    if tokens:
        whole, have = data.whole_batches(t.global_batch)
        if tokens >= have:
            raise ConfigError(f"config field `{field}`: {tokens:,} tokens, but the eval split's {whole} whole batches "
                              f"of {t.global_batch} rows hold {have:,} (data.batching={data.batching}, seq_len "
                              f"{t.seq_len}) and CoLA's rule reads until more than {tokens:,} were read; give at most "
                              f"{have - 1:,}, or a larger data.eval_path / data.eval_fraction")
    documents = data.batching != "stream"
    results, seen, i = [], 0, 0
    while (seen <= tokens) if tokens else (i < batches):
        if stop is not None:  # checked between batches (a collective under several processes)
            if len(results) >= 2:  # at most two batches in flight, so that a stop is not behind a backlog
                jax.block_until_ready(results[-2])
            if stop():
                raise EvalInterrupted(i)
        out = built.eval_step(params, to_global(data.batch(i * t.global_batch), built.eval_sharding))
        if documents and tokens:  # the count decides when to stop: read it now
            seen += int(np.sum(jax.device_get(out[2])))
        elif not documents:
            seen += t.global_batch * t.seq_len
        results.append(out)
        i += 1
    results = jax.device_get(results)
    slices = t.eval_microbatches or t.grad_accum
    if documents:
        sums = np.array([r[0] for r in results], np.float64)  # [batches, slices]
        targets = np.array([r[1] for r in results], np.int64)
        seen = seen if tokens else int(sum(np.sum(r[2]) for r in results))
        loss = float(sums.sum()) / max(int(targets.sum()), 1)
        batch_means = (sums / np.maximum(targets, 1)).mean(axis=1)
        counted = int(targets.sum())
        if not counted:  # no target was read: there is no loss (0 would read as perfect)
            loss, batch_means = float("nan"), batch_means * np.nan
    else:
        batch_means = np.array(results, np.float64)
        loss = float(batch_means.mean())
        counted = i * t.global_batch * t.seq_len
    return {"loss": float(loss), "batches": i, "tokens": seen, "targets": counted,
            "cola_loss": float(batch_means.sum()) / (i + 1), "cola_denominator": i + 1,
            "cola_batch_rows": t.global_batch // slices}
