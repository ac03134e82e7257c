"""Checks of plain values: each problem one line naming its field and the fix, all of a config's
problems at once (`every_problem`)."""

from __future__ import annotations

import contextlib
import contextvars
import math
from pathlib import Path

import ml_collections

from boost_jax.config.schema import (
    BATCHINGS,
    CONTEXT_ATTENTION,
    CONTEXT_KV,
    DTYPES,
    NONFINITE,
    PIPELINE_SCHEDULES,
    PLANS,
    SHUFFLES,
    WEIGHT_CASTS,
)
from boost_jax.errors import ConfigError


def profile_range(text: str) -> tuple[int, int] | None:
    """`profile_steps` ("A,B", or "A" for one step) as (first, last), None when empty; ConfigError if malformed."""
    if not str(text).strip():
        return None
    parts = str(text).split(",")
    try:
        first, last = int(parts[0]), int(parts[-1])
    except ValueError:
        first = last = 0
    check(
        len(parts) <= 2 and 1 <= first <= last,
        "profile_steps",
        f"{text!r} is not A,B with 1 <= A <= B (the first and last train step to trace, e.g. 10,12)",
    )
    return first, last


_FOUND: contextvars.ContextVar = contextvars.ContextVar("config_problems", default=None)


def check(cond: bool, field: str, message: str) -> None:
    """Raise ConfigError naming `field` unless `cond`; inside `every_problem`, record it and go on."""
    if cond:
        return
    problem = f"config field `{field}`: {message}"
    found = _FOUND.get()
    if found is None:
        raise ConfigError(problem)
    if problem not in found:
        found.append(problem)


@contextlib.contextmanager
def every_problem():
    """Collect the config's problems instead of stopping at the first: within, a failed `check` is
    recorded and the checks go on, and each `part()` records a ConfigError raised in it; leaving
    raises one ConfigError listing them all, one per line (nested: the outermost raises)."""
    outer = _FOUND.get()
    if outer is not None:
        yield
        return
    found: list[str] = []
    token = _FOUND.set(found)
    try:
        with part():
            yield
    finally:
        _FOUND.reset(token)
    if found:
        raise ConfigError(problems=found)


@contextlib.contextmanager
def part():
    """One group of checks inside `every_problem`: a ConfigError raised in it is recorded and the
    checks after the group run. Another error raised in it after a problem was recorded is taken for
    that problem's consequence (a check computing with an impossible value) and dropped."""
    found = _FOUND.get()
    if found is None:
        yield
        return
    try:
        yield
    except ConfigError as e:
        found.extend(p for p in e.problems if p not in found)
    except Exception:
        if not found:
            raise


def check_fields(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Reject plain values that cannot work, naming the field and what would work (the registries'
    names and the mesh: boost_jax/validate.py). The groups run in this order, which is the order of
    the problems `every_problem` lists."""
    _check_run(c)
    _check_model_shape(c)
    _check_lengths_and_init(c)
    _check_batch_splits_and_loss(c)
    _check_optimizer_and_schedule(c)
    _check_checkpoint_data_remat(c)
    _check_parallel(c)
    return c


def _check_run(c: ml_collections.ConfigDict) -> None:
    """profile_steps and compile_cache."""
    profile_range(c.profile_steps)
    check(
        not c.compile_cache or not Path(c.compile_cache).expanduser().is_file(),
        "compile_cache",
        f'{c.compile_cache!r} is a file; name a directory (created if missing) or "" for no cache',
    )


def _check_model_shape(c: ml_collections.ConfigDict) -> None:
    """The model's sizes, heads and dtypes."""
    m = c.model
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
        check(int(m[name]) > 0, f"model.{name}", f"must be a positive integer, got {m[name]}")
    heads = m.n_heads > 0 and m.n_kv_heads > 0  # (else named above; the checks below would divide by 0)
    check(
        not heads or m.d_model % m.n_heads == 0,
        "model.n_heads",
        f"{m.n_heads} heads do not divide d_model={m.d_model}; "
        f"choose a divisor of {m.d_model} (e.g. {_divisors_near(m.d_model, m.n_heads)})",
    )
    check(
        not heads or m.n_heads % m.n_kv_heads == 0,
        "model.n_kv_heads",
        f"{m.n_kv_heads} KV heads do not divide n_heads={m.n_heads} (GQA groups must be whole); "
        f"choose one of {_divisors(m.n_heads)}",
    )
    check(
        not heads or (m.d_model // m.n_heads) % 2 == 0,
        "model.n_heads",
        "head_dim = d_model/n_heads must be even for RoPE",
    )
    check(m.dtype in DTYPES, "model.dtype", f"{m.dtype!r} is not one of {DTYPES}")
    check(m.param_dtype in DTYPES[1:], "model.param_dtype", f"{m.param_dtype!r} is not one of {DTYPES[1:]}")
    gate = m.get("gate_kernel", "auto")
    check(gate in ("auto", "pallas", "gemm", "xla"), "model.gate_kernel", f"{gate!r} is not auto, pallas, gemm or xla")
    sigma = m.get("bottleneck_kernel", "auto")
    check(
        sigma in ("auto", "norm", "rope", "gemm", "xla"),
        "model.bottleneck_kernel",
        f"{sigma!r} is not auto, norm, rope, gemm or xla",
    )


def _check_lengths_and_init(c: ml_collections.ConfigDict) -> None:
    """Sequence length, steps and batch, then the model's RoPE base, norm epsilon and init scale."""
    m, t = c.model, c.train
    check(t.seq_len > 0, "train.seq_len", "must be positive")
    check(
        t.seq_len <= m.max_seq_len,
        "train.seq_len",
        f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise model.max_seq_len or shorten",
    )
    check(t.steps > 0, "train.steps", "must be positive")
    check(t.global_batch >= 1, "train.global_batch", f"must be a positive number of sequences, got {t.global_batch}")
    check(
        math.isfinite(m.rope_theta) and m.rope_theta > 0,
        "model.rope_theta",
        f"must be a positive RoPE base, got {m.rope_theta} (LLaMA: 10000)",
    )
    check(
        math.isfinite(m.norm_eps) and m.norm_eps > 0,
        "model.norm_eps",
        f"must be a small positive number, got {m.norm_eps} (e.g. 1e-6)",
    )
    check(
        math.isfinite(m.init_std) and m.init_std > 0,
        "model.init_std",
        f"must be a positive standard deviation, got {m.init_std} (e.g. 0.02)",
    )


def _check_batch_splits_and_loss(c: ml_collections.ConfigDict) -> None:
    """Gradient accumulation and evaluation micro-batches against the batch, and the loss options."""
    m, t = c.model, c.train
    check(t.grad_accum >= 1, "train.grad_accum", "must be >= 1")
    check(
        t.grad_accum < 1 or t.global_batch % t.grad_accum == 0,
        "train.global_batch",
        f"{t.global_batch} is not divisible by train.grad_accum={t.grad_accum}",
    )
    check(m.loss_chunk >= 0, "model.loss_chunk", "must be >= 0 (0: the whole sequence in one piece)")
    check(m.z_loss >= 0, "model.z_loss", "must be >= 0 (0 disables the z-loss)")
    check(t.eval_microbatches >= 0, "train.eval_microbatches", "must be >= 0 (0: train.grad_accum)")
    check(t.weight_casts in WEIGHT_CASTS, "train.weight_casts", f"{t.weight_casts!r} is not one of {WEIGHT_CASTS}")
    check(
        (t.eval_microbatches or t.grad_accum) < 1 or t.global_batch % (t.eval_microbatches or t.grad_accum) == 0,
        "train.eval_microbatches",
        f"{t.eval_microbatches or t.grad_accum} does not divide train.global_batch={t.global_batch}",
    )


def _check_optimizer_and_schedule(c: ml_collections.ConfigDict) -> None:
    """The learning-rate schedule, AdamW, the non-finite policy and the step intervals."""
    t = c.train
    check(0 <= t.warmup_steps <= t.steps, "train.warmup_steps", f"must be in [0, train.steps={t.steps}]")
    check(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", "must be in [0, 1]")
    check(math.isfinite(t.lr) and t.lr > 0, "train.lr", f"must be a positive number, got {t.lr} (e.g. 3e-3)")
    for name in ("b1", "b2"):
        check(0.0 <= t[name] < 1.0, f"train.{name}", f"must be in [0, 1), got {t[name]} (e.g. 0.9 / 0.95)")
    check(math.isfinite(t.eps) and t.eps > 0, "train.eps", f"must be a positive number, got {t.eps} (e.g. 1e-8)")
    for name in ("weight_decay", "grad_clip"):
        check(math.isfinite(t[name]) and t[name] >= 0, f"train.{name}", f"must be >= 0, got {t[name]}")
    check(t.nonfinite in NONFINITE, "train.nonfinite", f"{t.nonfinite!r} is not one of {NONFINITE}")
    check(t.stop_at_step >= 0, "train.stop_at_step", f"must be >= 0 (0: train to train.steps), got {t.stop_at_step}")
    check(t.eval_every >= 0, "train.eval_every", "must be >= 0 (0: no evaluation)")
    check(
        t.eval_batches >= 1,
        "train.eval_batches",
        f"must be >= 1, got {t.eval_batches}; to skip evaluation set train.eval_every=0",
    )
    check(t.log_every > 0, "train.log_every", "must be positive")


def _check_checkpoint_data_remat(c: ml_collections.ConfigDict) -> None:
    """Checkpointing, the data options, remat.pipeline, and the sequence length the batching needs."""
    t, p = c.train, c.parallel
    check(c.checkpoint.every > 0, "checkpoint.every", "must be positive")
    check(c.checkpoint.keep > 0, "checkpoint.keep", "must be positive (it never deletes all checkpoints)")
    check(
        c.data.source == "embedded" or bool(c.data.path),
        "data.path",
        f"data.source={c.data.source!r} needs a path: pass --config.data.path=/path/to/data "
        "(or --config.data.source=embedded for the built-in corpus)",
    )
    check(0.0 < c.data.eval_fraction < 1.0, "data.eval_fraction", "must be in (0, 1)")
    check(c.data.token_dtype in ("uint16", "uint32"), "data.token_dtype", "must be uint16 or uint32")
    check(c.remat.pipeline in ("none", "stage"), "remat.pipeline", f"{c.remat.pipeline!r} is not none or stage")
    check(
        c.remat.pipeline == "none" or p.pipeline != 1,
        "remat.pipeline",
        "stage recomputes pipeline stages, but parallel.pipeline=1; set parallel.pipeline > 1 or remat.pipeline=none",
    )
    check(c.data.batching in BATCHINGS, "data.batching", f"{c.data.batching!r} is not one of {BATCHINGS}")
    check(c.data.shuffle in SHUFFLES, "data.shuffle", f"{c.data.shuffle!r} is not one of {SHUFFLES}")
    check(
        t.seq_len >= 2 or c.data.batching == "stream",
        "train.seq_len",
        f"{t.seq_len} leaves no target inside a document (data.batching={c.data.batching}); use at least 2",
    )
    check(t.eval_tokens >= 0, "train.eval_tokens", "must be >= 0 (0: train.eval_batches batches)")


def _check_parallel(c: ml_collections.ConfigDict) -> None:
    """The mesh sizes, context parallelism, the pipeline schedule and the plan."""
    p = c.parallel
    check(
        p.grad_reduce_dtype in ("float32", "bfloat16"),
        "parallel.grad_reduce_dtype",
        f"{p.grad_reduce_dtype!r} is not float32 or bfloat16",
    )
    sizes = [p.pipeline, p.data, p.fsdp, p.context, p.tensor]
    check(sum(s == -1 for s in sizes) <= 1, "parallel", "at most one of pipeline/data/fsdp/context/tensor may be -1")
    check(
        p.context_attention in CONTEXT_ATTENTION,
        "parallel.context_attention",
        f"{p.context_attention!r} is not one of {CONTEXT_ATTENTION}",
    )
    check(p.context_kv in CONTEXT_KV, "parallel.context_kv", f"{p.context_kv!r} is not one of {CONTEXT_KV}")
    check(p.microbatches >= 0, "parallel.microbatches", "must be >= 0 (0: two per pipeline stage)")
    check(
        p.pipeline_schedule in PIPELINE_SCHEDULES,
        "parallel.pipeline_schedule",
        f"{p.pipeline_schedule!r} is not one of {PIPELINE_SCHEDULES}",
    )
    check(p.pipeline_repeats >= 1, "parallel.pipeline_repeats", f"must be >= 1, got {p.pipeline_repeats}")
    check(
        p.pipeline_repeats == 1 or p.pipeline_schedule in ("circular", "1f1b"),
        "parallel.pipeline_repeats",
        f"{p.pipeline_repeats} chunks per stage need parallel.pipeline_schedule=circular or 1f1b (gpipe holds one)",
    )
    check(
        p.pipeline_schedule == "gpipe" or p.pipeline != 1,
        "parallel.pipeline_schedule",
        f"{p.pipeline_schedule} interleaves layer chunks over pipeline stages, but parallel.pipeline=1; set "
        "parallel.pipeline > 1 or parallel.pipeline_schedule=gpipe",
    )
    for name in ("pipeline", "data", "fsdp", "context", "tensor"):
        check(p[name] == -1 or p[name] >= 1, f"parallel.{name}", "must be >= 1 or -1 (inferred)")
    check(p.plan in PLANS, "parallel.plan", f"{p.plan!r} is not one of {PLANS}")
    check(p.device_memory_gb >= 0, "parallel.device_memory_gb", "must be >= 0 (0: the device's own memory)")
    check(
        p.plan == "auto" or not p.device_memory_gb,
        "parallel.device_memory_gb",
        f"is what parallel.plan=auto's compiled pick must fit, but parallel.plan={p.plan}; set "
        "parallel.plan=auto or drop parallel.device_memory_gb",
    )
    if p.plan == "auto":
        unset = {"pipeline": 1, "data": -1, "fsdp": 1, "context": 1, "tensor": 1}
        chosen = [f"parallel.{k}={p[k]}" for k, v in unset.items() if p[k] != v]
        check(
            not chosen,
            "parallel.plan",
            f"auto picks the mesh itself, but {', '.join(chosen)} set it too; drop "
            f"{'them' if len(chosen) > 1 else 'it'} or set parallel.plan=explicit",
        )
    else:
        check(
            not p.cluster,
            "parallel.cluster",
            f"{p.cluster!r} is the cluster parallel.plan=auto plans for, but parallel.plan={p.plan}; set "
            "parallel.plan=auto or drop parallel.cluster",
        )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _divisors_near(n: int, k: int) -> list[int]:
    return sorted(_divisors(n), key=lambda x: abs(x - k))[:3]
