"""The eval loss of a run's parameters over a loader's batches: the trainer's evaluations and
`python -m boost_jax.evaluate` both measure it here.

An evaluation reads each row of the split at most once, in order from its first sample: never
past the split's end (no batch wraps round to its start). A split smaller than what is asked
(`train.eval_batches` global batches) is read whole, once, its last batch partial: the missing rows
are padding rows that hold no token and no target (the eval step's shapes stay those of a full
batch: one compiled program), and `plan_eval` says so. A token budget (`train.eval_tokens`) that the
split cannot meet is a ConfigError naming the numbers, raised by `plan_eval` (the trainer calls it
at start-up, before anything compiles).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from boost_jax.errors import ConfigError
from boost_jax.runtime.build import to_global


class EvalInterrupted(Exception):
    """`eval_loss` stopped between batches because its `stop()` said so (a signal during a long eval)."""


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """What an evaluation reads: `rows` rows from the split's first (batches mode: exactly these;
    with a token budget `tokens`: at most these, until more than `tokens` were read), of the
    `split_rows` rows (`split_tokens` input tokens that are not padding) the split holds; `note`: a
    line saying that the split is smaller than asked ("" when it is not)."""

    rows: int
    tokens: int
    split_rows: int
    split_tokens: int
    note: str = ""


def plan_eval(
    cfg,
    data,
    *,
    batches: int | None = None,
    tokens: int | None = None,
    split: str = "eval",
    batches_field: str = "train.eval_batches",
    tokens_field: str = "train.eval_tokens",
) -> EvalPlan:
    """What an evaluation of `data` reads under cfg.train (`batches` / `tokens` in place of
    train.eval_batches / train.eval_tokens). A token budget the split does not exceed is a
    ConfigError naming `tokens_field`, the split's size and where a larger split comes from."""
    t = cfg.train
    batches = t.eval_batches if batches is None else batches
    tokens = t.eval_tokens if tokens is None else tokens
    rows, have = data.readable_once()
    g = t.global_batch
    if tokens:
        if tokens >= have:
            d = cfg.data
            larger = (
                "more data"
                if split != "eval"
                else f"a larger data.eval_path (now {d.eval_path})"
                if d.eval_path
                else f"a larger data.eval_fraction (now {d.eval_fraction})"
            )
            most = f"at most {have - 1:,} or " if have > 1 else ""
            raise ConfigError(
                f"config field `{tokens_field}`: {tokens:,} tokens, but the {split} split holds "
                f"{have:,} in {rows:,} rows (data.batching={data.batching}, seq_len {t.seq_len}) and CoLA's "
                f"rule reads until more than {tokens:,} were read; set {most}0 (whole batches, "
                f"{batches_field}), or hold out more: {larger}"
            )
        return EvalPlan(rows, tokens, rows, have)
    if batches * g <= rows:
        return EvalPlan(batches * g, 0, rows, have)
    whole, part = divmod(rows, g)
    shape = " and ".join(
        x
        for x in (
            f"{whole} whole batch{'es' if whole != 1 else ''}" if whole else "",
            f"one partial batch of {part} rows + {g - part} padding rows, masked" if part else "",
        )
        if x
    )
    note = (
        f"note: the {split} split holds {rows:,} rows ({have:,} tokens), fewer than {batches_field}={batches} "
        f"batches of {g}: each evaluation reads every row once ({shape})"
    )
    return EvalPlan(rows, 0, rows, have, note)


def eval_batch(data, position: int, end: int):
    """This process's rows of the eval batch that starts at sample `position`, those at or past
    sample `end` padding rows (no token, no target). Stream rows come with the rows that count
    ({"tokens", "rows"}: model/batch.py), whole batches too, so every batch has one shape."""
    ids = np.arange(position + data.rows.start, position + data.rows.stop)
    real = ids < end
    if real.all():
        rows = data.samples(ids)
    else:  # padding: zeros (no token; a document of length 0; segment 0)
        template = data.samples(ids[real] if real.any() else [0])
        rows = {}
        for key, x in template.items():
            full = np.zeros((len(ids), *x.shape[1:]), x.dtype)
            if real.any():
                full[real] = x
            rows[key] = full
    if data.batching == "stream":
        return {"tokens": rows["tokens"], "rows": real}
    return rows


def eval_loss(
    built,
    data,
    params,
    *,
    batches: int | None = None,
    tokens: int | None = None,
    field: str = "train.eval_tokens",
    stop=None,
    plan: EvalPlan | None = None,
) -> dict:
    """The eval loss of `params` over `batches` global batches of `data` (default train.eval_batches;
    all of a smaller split, once) or, when `tokens` (default train.eval_tokens) is set, over batches
    read as CoLA's evaluation loop reads them: before each batch it stops if more than `tokens` input
    tokens that are not padding were read (`>`: a count that lands exactly on `tokens` reads one batch
    more); `plan`: what `plan_eval` gave for them (computed here when None). Returns

    - "loss": the mean over every counted target (batches weighted by their targets), so exp(loss) is
      the perplexity per target token;
    - "cola_loss": CoLA's reported form (its `evaluate_model`): the sum of each batch's mean loss divided
      by n+1 after n batches (its batch counter starts at 1), a batch being one eval slice of
      `cola_batch_rows` = train.global_batch / (train.eval_microbatches or train.grad_accum) rows, as
      each GPU's `--batch_size` batch is there (the slices of a global batch are averaged first, as
      DDP averages the GPUs; in a partial batch, the slices holding rows); "cola_denominator" is that n+1;
    - "batches", "rows", "padding_rows", "tokens", "targets": the global batches (the last may be
      partial), the split's rows read (each once), the padding rows of a partial batch, and the input
      tokens that are not padding and the targets counted in them.

    `stop`: a callable asked before each batch; True raises EvalInterrupted (a stop signal during a
    long evaluation: the trainer then saves and exits instead of finishing it)."""
    t = built.cfg.train
    g = t.global_batch
    p = plan or plan_eval(built.cfg, data, batches=batches, tokens=tokens, tokens_field=field)
    results, sizes, seen = [], [], 0
    while len(sizes) * g < p.rows and (not p.tokens or seen <= p.tokens):
        i = len(sizes)
        if stop is not None:  # checked between batches (a collective under several processes)
            if len(results) >= 2:  # at most two batches in flight, so that a stop is not behind a backlog
                jax.block_until_ready(results[-2])
            if stop():
                raise EvalInterrupted(i)
        out = built.eval_step(params, to_global(eval_batch(data, i * g, p.rows), built.eval_sharding))
        if p.tokens:  # the count decides when to stop: read it now
            seen += int(np.sum(jax.device_get(out[2])))
        results.append(out)
        sizes.append(min(g, p.rows - i * g))
    results = jax.device_get(results)
    slices = t.eval_microbatches or t.grad_accum
    n = len(sizes)
    sums = np.array([r[0] for r in results], np.float64).reshape(n, slices)
    targets = np.array([r[1] for r in results], np.int64).reshape(n, slices)
    seen = int(sum(np.sum(r[2]) for r in results))
    counted = int(targets.sum())
    loss = float(sums.sum()) / max(counted, 1) if counted else float("nan")  # no target: no loss (0 reads perfect)
    # Slice j of a batch holds its rows j, slices+j, ... (parallel/pipeline/layout.py to_microbatches).
    held = np.arange(slices)[None, :] < np.array(sizes)[:, None]
    batch_means = (sums / np.maximum(targets, 1) * held).sum(axis=1) / held.sum(axis=1)
    if not counted:
        batch_means = batch_means * np.nan
    return {
        "loss": loss,
        "batches": n,
        "rows": int(sum(sizes)),
        "padding_rows": n * g - int(sum(sizes)),
        "tokens": seen,
        "targets": counted,
        "cola_loss": float(batch_means.sum()) / (n + 1),
        "cola_denominator": n + 1,
        "cola_batch_rows": g // slices,
    }
