"""Run configuration: the schema (defaults), named-size presets and the checks of plain values.

Every run is one `ml_collections.ConfigDict`. `base_config()` holds every key the code reads (so a
typo in `--config.key=value` fails at parse time), `configs/*.py` only change values, and
`check_fields()` rejects impossible numbers and shapes, naming the field and the fix. This module is
the ground floor (it imports nothing of ours but the errors): the names that registries own
(linear kinds, attention implementations, strategies, data sources, kernels, remat policies) and
what a mesh must divide are checked by `boost_jax/validate.py`, which asks each registry.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.util
import math
from pathlib import Path

import ml_collections
from ml_collections import config_dict
from boost_jax.errors import ConfigError  # noqa: F401 - config.ConfigError stays importable


@dataclasses.dataclass(frozen=True)
class Field:
    """A `model` field that a registry entry owns (a linear kind's hyperparameter): its default, and
    one line of meaning (what `--help`-style listings show)."""
    default: object
    help: str


# The `model` fields each registered owner declared (owner -> {field: Field}), in registration order:
# the linear kinds declare theirs in their own files and `boost_jax.model.kinds.register` brings them
# here (importing boost_jax imports the built-in kinds), so this module names no kind and no kind's field.
_OWNED: dict[str, dict[str, Field]] = {}


def declare_model_fields(owner: str, fields: dict) -> None:
    """Make `model.NAME` a config key (default and help from its Field) for each of `fields`, owned by
    `owner`. Two owners may share a field only with the same Field; no owner may redefine a core key."""
    core = set(_schema().model.keys())
    for name, field in fields.items():
        if not isinstance(field, Field):
            raise ConfigError(f"{owner}: model.{name} is declared as {field!r}, not a config.Field(default, help)")
        if name in core:
            raise ConfigError(f"{owner}: model.{name} is already a key of the model section; name the field "
                              f"after its owner (e.g. model.{owner}_{name})")
        for other, theirs in _OWNED.items():
            if other != owner and name in theirs and theirs[name] != field:
                raise ConfigError(f"{owner}: model.{name} is already declared by {other} as {theirs[name]}")
    _OWNED[owner] = dict(fields)


def forget_model_fields(owner: str) -> None:
    """Drop the fields `owner` declared (a kind unregistered); fields another owner shares stay."""
    _OWNED.pop(owner, None)


def model_fields() -> dict[str, Field]:
    """Every declared `model` field (its first declaration), in the order the owners declared them."""
    out: dict[str, Field] = {}
    for fields in _OWNED.values():
        for name, field in fields.items():
            out.setdefault(name, field)
    return out


# The projection groups a parallel plan partitions as a unit: the model's (attention's q/k/v and o,
# the MLP's gate/up and down), the names `parallel.linear_partition` takes and the planner prices.
PROJECTION_GROUPS = ("qkv", "o", "mlp_in", "mlp_out")
ST = "st"  # parallel.linear_partition: a group run as PrimePar's spatial-temporal P(n x n)
DTYPES = ("auto", "float32", "bfloat16", "float16")
NONFINITE = ("stop", "skip")
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b")
PLANS = ("explicit", "auto")  # parallel.plan
CONTEXT_ATTENTION = ("ring", "all_gather")  # parallel.context_attention (boost_jax/parallel/context.py)
CONTEXT_KV = ("full", "bottleneck")  # parallel.context_kv
BATCHINGS = ("stream", "packed", "document")  # data.batching (boost_jax/data/loader.py)
SHUFFLES = ("feistel", "numpy")  # data.shuffle (boost_jax/data/shuffle.py)


AUTO_OR_BOOL = ("group_linears", "scan_unroll")  # model fields holding "auto" or a bool


class _ModelSection(ml_collections.ConfigDict):
    """The `model` section: its `auto | bool` fields stay untyped in every copy (ConfigDict's
    copy_and_resolve_references would otherwise type them by their value, so `"auto"` would refuse the
    bool it resolves to, and a resolved bool would refuse `"auto"`)."""

    def copy_and_resolve_references(self, visit_map=None):
        out = super().copy_and_resolve_references(visit_map)
        for name in AUTO_OR_BOOL:
            if name in out:
                with out.unlocked(), out.ignore_type():
                    out[name] = config_dict.FieldReference(out[name], field_type=object)
        return out


def base_config() -> ml_collections.ConfigDict:
    """Every key the code reads, with its default: the schema below plus the `model` fields the
    registered linear kinds declare (`model_fields`), right after `model.linear`."""
    return _schema(model_fields())


def _schema(owned: dict | None = None) -> ml_collections.ConfigDict:
    owned = owned or {}
    c = ml_collections.ConfigDict()
    c.name = "tiny"  # the run's name (the zoo configs: cola_60m, llama_1b, ...)
    c.run_dir = "runs/tiny"  # checkpoints, metrics.jsonl, tensorboard/ and the token cache go here
    c.seed = 0  # parameter init and data order
    c.restore_from = ""  # a run dir or one step dir to start from; empty: resume run_dir if it has one
    # A directory for JAX's persistent compilation cache: a restarted run (or another run of the same
    # shapes) loads its compiled programs instead of compiling them. "" (default): no cache. Programs
    # compiling faster than JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS (JAX's default 1 s) are not stored.
    c.compile_cache = ""
    # "A,B": a jax.profiler trace of train steps A to B (1-based, inclusive) into RUN_DIR/tensorboard,
    # where TensorBoard's profile tab (pip install tensorboard-plugin-profile) shows it. "": none.
    c.profile_steps = ""
    # Add the XLA GPU flags of boost_jax/xla_gpu_flags.py to XLA_FLAGS when a CUDA jax is installed
    # (flags already in XLA_FLAGS keep their values); false leaves XLA_FLAGS alone.
    c.xla_gpu_flags = True

    m = c.model = _ModelSection()
    m.vocab_size = 256  # byte-level tokenizer for the embedded corpus
    m.d_model = 128  # hidden width d
    m.n_layers = 4  # transformer blocks L
    m.n_heads = 4  # attention heads H (head dim d / H)
    m.n_kv_heads = 4  # < n_heads gives grouped-query attention
    m.d_ff = 352  # MLP width I
    m.rank = 32  # bottleneck width r of lowrank / cola / sltrain projections; tt: the middle rank r_mid
    m.linear = "cola"  # dense | lowrank | cola | tt | sltrain, for every projection (model/kinds/)
    for name, field in owned.items():  # each registered kind's own hyperparameters (model/kinds/)
        m[name] = field.default
    m.only_lr_act = False  # MLP form: True -> down(gate*up), False -> down(silu(gate)*up)
    m.max_seq_len = 128  # the longest sequence the model is built for (RoPE tables, generation)
    m.rope_theta = 10000.0  # RoPE base
    m.norm_eps = 1e-6  # RMSNorm epsilon
    m.tie_embeddings = False  # the LM head reuses the embedding matrix
    m.dtype = "auto"  # compute dtype: bfloat16 on GPU/TPU, float32 on CPU
    m.param_dtype = "float32"  # parameter (and optimizer state) dtype
    m.init_std = 0.02  # embedding init
    # q/k/v and gate/up first stages as one GEMM, B's as one batched dot. auto (boost_jax/model/autos.py):
    # grouped where parallel.tensor > 1 (it merges their collectives) or the kind is dense, else not.
    m.group_linears = config_dict.FieldReference("auto", field_type=object)  # auto | true | false
    # unroll the layer scan. auto: unrolled on GPUs where only parallel.data splits the mesh (18% faster
    # on one H100), scanned elsewhere (compile time does not grow with depth).
    m.scan_unroll = config_dict.FieldReference("auto", field_type=object)  # auto | true | false
    # auto | xla | chunked | pallas | cudnn (boost_jax/model/attention.py). auto: cudnn on a GPU in
    # bf16/fp16, else xla up to 1024 keys, else chunked (blockwise, O(T) memory).
    m.attention = "auto"
    m.loss_chunk = 512  # positions per chunk of the head + cross-entropy (no f32 [B,T,V]); 0: one piece
    m.z_loss = 0.0  # weight of PaLM's z-loss, mean(logsumexp(logits)^2), added to the training loss

    d = c.data = ml_collections.ConfigDict()
    d.source = "embedded"  # embedded | text | jsonl | tokens
    d.path = ""  # file, directory or glob for text/jsonl/tokens; a mixture: PATH:WEIGHT,PATH:WEIGHT
    d.eval_path = ""  # optional separate eval set; otherwise eval_fraction of the data is held out
    d.eval_fraction = 0.05  # held out from the end of data.path when data.eval_path is empty
    d.tokenizer = "byte"  # byte | path to a HF tokenizers .json | path to a SentencePiece .model
    d.token_dtype = "uint16"  # for source=tokens: uint16 | uint32
    d.jsonl_field = "text"  # the field of each JSONL record that holds the document
    d.embedded_max_bytes = 4_000_000  # how much of the embedded corpus to read
    # How rows are cut (boost_jax/data/loader.py): stream: windows of seq_len+1 tokens over the
    # concatenated documents; packed: whole documents packed into rows of seq_len, attention and
    # RoPE positions restart at every document; document: one document per row, truncated and
    # padded (CoLA's recipe). packed/document need document boundaries (data.prepare records them).
    d.batching = "stream"
    # The order of samples in an epoch: feistel (a stateless permutation evaluated per index, O(1)
    # memory) or numpy (a materialised permutation: what checkpoints written before data.shuffle used).
    d.shuffle = "feistel"
    # A resumed run whose data differs from what its checkpoint's position refers to (the prepared
    # index, the text/jsonl inputs' contents, data.batching, train.seq_len) stops with an error naming
    # it; true continues on the new data at the same position, saying so in the log and metrics.
    d.allow_changed = False

    t = c.train = ml_collections.ConfigDict()
    t.seq_len = 128  # tokens per row (the model reads seq_len, predicts the next of each)
    t.global_batch = 16  # sequences per optimizer step, all devices and micro-batches together
    t.grad_accum = 1  # micro-batches per optimizer step
    t.steps = 400  # the schedule's length
    t.stop_at_step = 0  # stop this invocation (with a checkpoint) at this step; 0: train.steps
    t.lr = 3e-3  # peak learning rate (AdamW), after the linear warmup
    t.min_lr_ratio = 0.1  # cosine decays to this fraction of the peak
    t.warmup_steps = 40  # linear warmup from 0 to train.lr, then cosine
    t.weight_decay = 0.01  # AdamW decoupled weight decay
    t.decay_norms = False  # decay the RMSNorm scales too (CoLA's official AdamW decays every parameter)
    t.b1 = 0.9  # AdamW beta1
    t.b2 = 0.95  # BOOST's AdamW (0.9, 0.95); the zoo configs (sized_config) use CoLA's (0.9, 0.999)
    t.eps = 1e-8  # AdamW epsilon
    t.grad_clip = 0.5  # clip the gradient to this global norm (0: no clipping)
    # A step whose loss, gradient norm or updated weights are NaN/inf is never applied; then
    # stop: end the run (the checkpoints on disk are the last good ones); skip: go on with the next
    # batch (the skipped step still counts) and report skipped_steps in the metrics.
    t.nonfinite = "stop"
    t.log_every = 20  # write metrics (loss, tokens/s, MFU, ...) every N steps
    t.eval_every = 100  # evaluate on the held-out split every N steps (and at step 0 and the end); 0: never
    t.eval_batches = 8  # global batches per evaluation (unless train.eval_tokens)
    # Evaluate over the first N non-pad tokens of the eval split (whole batches until more than N are
    # read, as CoLA's loop; CoLA uses 10M) instead of train.eval_batches batches; 0: train.eval_batches.
    t.eval_tokens = 0
    # Sequential slices of an eval batch (0: train.grad_accum); CoLA's reported loss (eval_loss_cola)
    # averages each slice's mean, a slice standing for one GPU's eval batch.
    t.eval_microbatches = 0
    t.progress = True  # show a progress bar

    k = c.checkpoint = ml_collections.ConfigDict()
    k.every = 100  # save a checkpoint every N steps (and at the end, and on a stop signal)
    k.keep = 3  # keep the newest N checkpoints
    k.async_save = True  # write checkpoints in the background while training goes on
    k.resume = True  # resume from run_dir's newest checkpoint when it has one
    # resume=false on a run_dir that holds checkpoints is refused (a new run would mix its steps with
    # theirs); supersede=true moves them aside as N.superseded (never deleted) and starts afresh.
    k.supersede = False

    r = c.remat = ml_collections.ConfigDict()
    # auto | none | full | dots | lowrank | offload_lowrank. auto: none on CPUs and for an unrolled
    # stack; a scanned stack on a GPU recomputes (lowrank for factored kinds, full for dense).
    r.policy = "auto"
    # none | stage: with parallel.pipeline > 1, each pipeline stage is recomputed in the backward, so the
    # tick loop keeps one stage input per micro-batch instead of every layer's activations.
    r.pipeline = "none"

    p = c.parallel = ml_collections.ConfigDict()
    # explicit | auto. auto: the trainer asks the planner (boost_jax/planner) for the best plan it can run on
    # the devices it sees and runs it (mesh, strategy, remat, grad_accum, pipeline schedule, context),
    # printing the pick and its predicted step time and memory (leave the mesh sizes parallel.* unset).
    p.plan = "explicit"
    # parallel.plan=auto: the cluster file the planner prices (configs/clusters/*.py or a packaged name
    # such as clusters/h100_8x); "": the one for the detected device kind (H100, A100)
    p.cluster = ""
    p.num_devices = 0  # use the first N devices (0: all)
    p.pipeline = 1  # pipeline stages; the layers are split evenly
    p.microbatches = 0  # pipeline micro-batches per pass (0: 2 per stage)
    # gpipe | circular. gpipe: stage s holds layers [s L/S, (s+1) L/S), bubble (S-1)/(M+S-1).
    # circular (interleaved): stage s holds the V chunks s, S+s, 2S+s, ... of L/(S V) layers and the
    # micro-batches go round the ring V times, bubble (S-1)/(V M + S-1); needs microbatches >= pipeline.
    # 1f1b: each stage alternates one micro-batch's forward and one's backward, so it keeps a number of
    # micro-batches set by the stages, not by microbatches; with pipeline_repeats V > 1 interleaved
    # (circular's chunks), bubble (S-1)/(V M + S-1), microbatches a multiple of pipeline.
    p.pipeline_schedule = "gpipe"
    p.pipeline_repeats = 1  # V, circular and 1f1b: the layer chunks per stage
    p.data = -1  # data-parallel replicas; one mesh axis may be -1 (all remaining devices)
    p.fsdp = 1  # parameters, gradients and optimizer state sharded over this axis (ZeRO-3)
    p.tensor = 1  # tensor parallelism: each projection split over this axis by parallel.strategy
    # Context parallelism: the sequence split over this axis (between fsdp and tensor), each device
    # holding chunks i and 2C-1-i of 2C (causal load balance); train.seq_len must split into 2C chunks.
    p.context = 1
    # ring: K/V passed around the context ring (collective-permutes, online softmax, masked blocks
    # skipped); all_gather: K/V gathered over `context` once per layer (best at small C).
    p.context_attention = "ring"
    # full: the ring passes K and V; bottleneck (low-rank kinds, btp/megatron): it passes the r-wide
    # σ(A_k x), σ(A_v x) and every device rebuilds each block's K/V with its B's (2r vs 2 kv_dim per token).
    p.context_kv = "full"
    p.strategy = "btp"  # btp | vanilla | megatron (how the tensor axis splits the model)
    # The gradient all-reduce over `data`: once per optimizer step (whatever train.grad_accum is), in
    # this dtype (float32 | bfloat16); over `fsdp` gradients are reduce-scattered per micro-batch.
    # Pipelined: the stages' gradients over data x fsdp once per pass (per micro-batch), same dtype.
    p.grad_reduce_dtype = "float32"
    p.online_norm = True  # btp: send RMSNorm statistics with the A partial products
    p.sequence_parallel = False  # megatron: shard norms/residual along sequence
    # Projection groups run as PrimePar spatial-temporal GEMMs on the (fsdp, tensor) grid:
    # "" (none), "st" (all) or e.g. "mlp_in=st,mlp_out=st" (groups: qkv, o, mlp_in, mlp_out).
    p.linear_partition = ""

    kn = c.kernels = ml_collections.ConfigDict()
    # xla | pallas | triton: the fused norm(+Σx²) kernel (boost_jax/kernels/); pallas and triton fall
    # back to xla, loudly and recorded in metrics.jsonl, where they cannot run (triton: NVIDIA GPUs
    # with jax-triton installed, the `gpu` extra)
    # auto: triton on NVIDIA GPUs with jax-triton, pallas on other GPUs, xla elsewhere.
    kn.rmsnorm = "auto"

    # Multi-process runs (boost_jax/runtime/distributed.py). 0 / -1 / "": take it from BOOST_COORDINATOR,
    # BOOST_NUM_PROCESSES, BOOST_PROCESS_ID, else from SLURM, else run as a single process.
    ds = c.distributed = ml_collections.ConfigDict()
    ds.coordinator_address = ""  # host:port of process 0
    ds.num_processes = 0  # processes in the job
    ds.process_id = -1  # this process's index
    ds.cpu_collectives = "gloo"  # cross-process collectives of the CPU backend: gloo | mpi

    c.lock()
    return c


# Shapes of the paper's model zoo (d, I, H, L); r = d/4 except where the CoLA table says otherwise.
SIZES = {
    "60m": dict(d_model=512, d_ff=1376, n_heads=8, n_layers=8, rank=128),
    "130m": dict(d_model=768, d_ff=2048, n_heads=12, n_layers=12, rank=256),
    "350m": dict(d_model=1024, d_ff=2736, n_heads=16, n_layers=24, rank=256),
    "1b": dict(d_model=2048, d_ff=5472, n_heads=32, n_layers=24, rank=512),
    "3b": dict(d_model=3200, d_ff=8640, n_heads=32, n_layers=26, rank=800),
    "7b": dict(d_model=4096, d_ff=11008, n_heads=32, n_layers=32, rank=1024),
    "13b": dict(d_model=5120, d_ff=13824, n_heads=40, n_layers=40, rank=1280),
}
# CoLA's official recipe, copied from its code (main.py defaults and scripts/cola_scripts/colaN.sh):
# per size the peak lr, steps and warmup steps; for all sizes the rest of OFFICIAL. CoLA trains no 3B
# or 13B (BOOST's shapes): their rows are interpolated / taken from the 7B (official=False).
COLA_RECIPE = {
    "60m": dict(lr=6e-3, steps=10_000, warmup_steps=2_000, official=True),
    "130m": dict(lr=3e-3, steps=20_000, warmup_steps=2_000, official=True),
    "350m": dict(lr=3e-3, steps=60_000, warmup_steps=6_000, official=True),
    "1b": dict(lr=2e-3, steps=100_000, warmup_steps=10_000, official=True),
    "3b": dict(lr=1.5e-3, steps=120_000, warmup_steps=12_000, official=False),
    "7b": dict(lr=1e-3, steps=150_000, warmup_steps=15_000, official=True),
    "13b": dict(lr=1e-3, steps=150_000, warmup_steps=15_000, official=False),
}
# torch.optim.AdamW(model.parameters(), lr, weight_decay=0.01): torch's betas and eps, every parameter
# decayed (norm scales and embedding too); clip_grad_norm_ 0.5; cosine to 0.1x; T5 tokenizer, C4 en,
# seq 256, global batch 512, one document per row (truncated, padded, pad labels -100); perplexity
# over the first 10M non-pad tokens of the validation split.
COLA_OFFICIAL = {"train.b1": 0.9, "train.b2": 0.999, "train.eps": 1e-8, "train.weight_decay": 0.01,
                 "train.decay_norms": True, "train.grad_clip": 0.5, "train.min_lr_ratio": 0.1,
                 "train.seq_len": 256, "train.global_batch": 512, "train.eval_tokens": 10_000_000,
                 "data.batching": "document"}


def sized_config(size: str, linear: str) -> ml_collections.ConfigDict:
    """A zoo model: `linear='cola'` for CoLA, `'dense'` for the full-rank LLaMA baseline."""
    c = base_config()
    family = "llama" if linear == "dense" else "cola"
    c.name = f"{family}_{size}"
    c.run_dir = f"runs/{c.name}"
    shape = SIZES[size]
    for key, value in shape.items():
        c.model[key] = value
    c.model.n_kv_heads = shape["n_heads"]
    c.model.linear = linear
    c.model.vocab_size = 32000
    c.model.max_seq_len = 4096
    c.model.only_lr_act = linear == "cola" and size not in ("60m", "130m")
    # CoLA's official recipe (COLA_RECIPE, COLA_OFFICIAL), AdamW betas (0.9, 0.999) and not BOOST's
    # (0.9, 0.95): a run continued here from an official CoLA checkpoint trains as it would there; the
    # llama_* baselines share it, like for like.
    recipe = COLA_RECIPE[size]
    c.train.update(lr=recipe["lr"], steps=recipe["steps"], warmup_steps=recipe["warmup_steps"])
    for key, value in COLA_OFFICIAL.items():
        section, field = key.split(".")
        c[section][field] = value
    c.train.log_every = 50
    c.train.eval_every = 1000
    c.checkpoint.every = 1000
    # The recipe trains on C4 tokenised with the T5/LLaMA tokenizer: point data.path at it.
    c.data.source = "tokens"
    return c


# BOOST's tensor-train models: (d, I, H, L, tt_rank = the middle rank, cores). 60m and 1b are BOOST's
# published TT configs; 130m and 350m (not published) take the zoo's shapes and CoLA ranks.
TT_SIZES = {
    "60m": dict(d_model=512, d_ff=1344, n_heads=8, n_layers=8, rank=128, tt_cores=6),
    "130m": dict(d_model=768, d_ff=2048, n_heads=12, n_layers=12, rank=256, tt_cores=6),
    "350m": dict(d_model=1024, d_ff=2736, n_heads=16, n_layers=24, rank=256, tt_cores=6),
    "1b": dict(d_model=2048, d_ff=5472, n_heads=32, n_layers=24, rank=512, tt_cores=6),
}


def tt_config(size: str) -> ml_collections.ConfigDict:
    """A tensor-train model: BOOST's shapes (TT_SIZES), no bottleneck activation (BOOST's TT is linear
    through r_mid), inner ranks r_mid/4 (our choice: BOOST sets them from a parameter-budget ratio the
    reference does not record), and the zoo's CoLA schedule for its size."""
    c = sized_config(size, "tt")
    c.name, c.run_dir = f"tt_{size}", f"runs/tt_{size}"
    c.model.update(TT_SIZES[size])
    c.model.update(tt_inner_rank=c.model.rank // 4, tt_activation="none", only_lr_act=False)
    return c


# SLTrain's published runs (the authors' scripts): rank, alpha, steps, warmup; density 0.03, lr 3e-3,
# weight decay 0, no gradient clipping, AdamW (0.9, 0.999), cosine to 0.1x, global batch 512 x 256
# tokens, on the zoo's LLaMA shapes.
SLTRAIN_RECIPE = {
    "60m": dict(rank=128, sltrain_alpha=32.0, steps=11_000, warmup_steps=1_100),
    "130m": dict(rank=256, sltrain_alpha=16.0, steps=22_000, warmup_steps=2_200),
    "350m": dict(rank=256, sltrain_alpha=16.0, steps=65_000, warmup_steps=6_500),
    "1b": dict(rank=512, sltrain_alpha=8.0, steps=140_000, warmup_steps=10_000),
}


def sltrain_config(size: str) -> ml_collections.ConfigDict:
    """A sparse + low-rank model with SLTrain's recipe. Its support is 16 x 16 blocks (SLTrain's is
    element-wise, `model.sparse_block=1`, which gathers nnz input values per token: see kinds/sltrain.py)."""
    c = sized_config(size, "sltrain")
    c.name, c.run_dir = f"sltrain_{size}", f"runs/sltrain_{size}"
    recipe = SLTRAIN_RECIPE[size]
    c.model.update(rank=recipe["rank"], sltrain_alpha=recipe["sltrain_alpha"], sparse_density=0.03,
                   sparse_block=16, only_lr_act=False)
    c.train.update(lr=3e-3, steps=recipe["steps"], warmup_steps=recipe["warmup_steps"], weight_decay=0.0,
                   b1=0.9, b2=0.999, grad_clip=0.0)
    return c


def profile_range(text: str) -> tuple[int, int] | None:
    """`profile_steps` ("A,B", or "A" for one step) as (first, last), None when empty; ConfigError if malformed."""
    if not str(text).strip():
        return None
    parts = str(text).split(",")
    try:
        first, last = int(parts[0]), int(parts[-1])
    except ValueError:
        first = last = 0
    check(len(parts) <= 2 and 1 <= first <= last, "profile_steps",
          f"{text!r} is not A,B with 1 <= A <= B (the first and last train step to trace, e.g. 10,12)")
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
    names and the mesh: boost_jax/validate.py)."""
    m, t, p = c.model, c.train, c.parallel
    profile_range(c.profile_steps)
    check(not c.compile_cache or not Path(c.compile_cache).expanduser().is_file(), "compile_cache",
          f"{c.compile_cache!r} is a file; name a directory (created if missing) or \"\" for no cache")
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
    check(not heads or (m.d_model // m.n_heads) % 2 == 0, "model.n_heads",
          "head_dim = d_model/n_heads must be even for RoPE")
    check(m.dtype in DTYPES, "model.dtype", f"{m.dtype!r} is not one of {DTYPES}")
    check(m.param_dtype in DTYPES[1:], "model.param_dtype", f"{m.param_dtype!r} is not one of {DTYPES[1:]}")
    check(t.seq_len > 0, "train.seq_len", "must be positive")
    check(
        t.seq_len <= m.max_seq_len,
        "train.seq_len",
        f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise model.max_seq_len or shorten",
    )
    check(t.steps > 0, "train.steps", "must be positive")
    check(t.global_batch >= 1, "train.global_batch", f"must be a positive number of sequences, got {t.global_batch}")
    check(math.isfinite(m.rope_theta) and m.rope_theta > 0, "model.rope_theta",
          f"must be a positive RoPE base, got {m.rope_theta} (LLaMA: 10000)")
    check(math.isfinite(m.norm_eps) and m.norm_eps > 0, "model.norm_eps",
          f"must be a small positive number, got {m.norm_eps} (e.g. 1e-6)")
    check(math.isfinite(m.init_std) and m.init_std > 0, "model.init_std",
          f"must be a positive standard deviation, got {m.init_std} (e.g. 0.02)")
    check(t.grad_accum >= 1, "train.grad_accum", "must be >= 1")
    check(
        t.grad_accum < 1 or t.global_batch % t.grad_accum == 0,
        "train.global_batch",
        f"{t.global_batch} is not divisible by train.grad_accum={t.grad_accum}",
    )
    check(m.loss_chunk >= 0, "model.loss_chunk", "must be >= 0 (0: the whole sequence in one piece)")
    check(m.z_loss >= 0, "model.z_loss", "must be >= 0 (0 disables the z-loss)")
    check(t.eval_microbatches >= 0, "train.eval_microbatches", "must be >= 0 (0: train.grad_accum)")
    check(
        (t.eval_microbatches or t.grad_accum) < 1 or t.global_batch % (t.eval_microbatches or t.grad_accum) == 0,
        "train.eval_microbatches",
        f"{t.eval_microbatches or t.grad_accum} does not divide train.global_batch={t.global_batch}",
    )
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
    check(t.eval_batches >= 1, "train.eval_batches",
          f"must be >= 1, got {t.eval_batches}; to skip evaluation set train.eval_every=0")
    check(t.log_every > 0, "train.log_every", "must be positive")
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
    check(c.remat.pipeline == "none" or p.pipeline != 1, "remat.pipeline",
          "stage recomputes pipeline stages, but parallel.pipeline=1; set parallel.pipeline > 1 or remat.pipeline=none")
    check(c.data.batching in BATCHINGS, "data.batching", f"{c.data.batching!r} is not one of {BATCHINGS}")
    check(c.data.shuffle in SHUFFLES, "data.shuffle", f"{c.data.shuffle!r} is not one of {SHUFFLES}")
    check(t.seq_len >= 2 or c.data.batching == "stream", "train.seq_len",
          f"{t.seq_len} leaves no target inside a document (data.batching={c.data.batching}); use at least 2")
    check(t.eval_tokens >= 0, "train.eval_tokens", "must be >= 0 (0: train.eval_batches batches)")
    check(p.grad_reduce_dtype in ("float32", "bfloat16"), "parallel.grad_reduce_dtype",
          f"{p.grad_reduce_dtype!r} is not float32 or bfloat16")
    sizes = [p.pipeline, p.data, p.fsdp, p.context, p.tensor]
    check(sum(s == -1 for s in sizes) <= 1, "parallel", "at most one of pipeline/data/fsdp/context/tensor may be -1")
    check(p.context_attention in CONTEXT_ATTENTION, "parallel.context_attention",
          f"{p.context_attention!r} is not one of {CONTEXT_ATTENTION}")
    check(p.context_kv in CONTEXT_KV, "parallel.context_kv", f"{p.context_kv!r} is not one of {CONTEXT_KV}")
    check(p.microbatches >= 0, "parallel.microbatches", "must be >= 0 (0: two per pipeline stage)")
    check(p.pipeline_schedule in PIPELINE_SCHEDULES, "parallel.pipeline_schedule",
          f"{p.pipeline_schedule!r} is not one of {PIPELINE_SCHEDULES}")
    check(p.pipeline_repeats >= 1, "parallel.pipeline_repeats", f"must be >= 1, got {p.pipeline_repeats}")
    check(p.pipeline_repeats == 1 or p.pipeline_schedule in ("circular", "1f1b"), "parallel.pipeline_repeats",
          f"{p.pipeline_repeats} chunks per stage need parallel.pipeline_schedule=circular or 1f1b (gpipe holds one)")
    check(p.pipeline_schedule == "gpipe" or p.pipeline != 1, "parallel.pipeline_schedule",
          f"{p.pipeline_schedule} interleaves layer chunks over pipeline stages, but parallel.pipeline=1; set "
          "parallel.pipeline > 1 or parallel.pipeline_schedule=gpipe")
    for name in ("pipeline", "data", "fsdp", "context", "tensor"):
        check(p[name] == -1 or p[name] >= 1, f"parallel.{name}", "must be >= 1 or -1 (inferred)")
    check(p.plan in PLANS, "parallel.plan", f"{p.plan!r} is not one of {PLANS}")
    if p.plan == "auto":
        unset = {"pipeline": 1, "data": -1, "fsdp": 1, "context": 1, "tensor": 1}
        chosen = [f"parallel.{k}={p[k]}" for k, v in unset.items() if p[k] != v]
        check(not chosen, "parallel.plan",
              f"auto picks the mesh itself, but {', '.join(chosen)} set it too; drop "
              f"{'them' if len(chosen) > 1 else 'it'} or set parallel.plan=explicit")
    else:
        check(not p.cluster, "parallel.cluster",
              f"{p.cluster!r} is the cluster parallel.plan=auto plans for, but parallel.plan={p.plan}; set "
              "parallel.plan=auto or drop parallel.cluster")
    return c


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _divisors_near(n: int, k: int) -> list[int]:
    return sorted(_divisors(n), key=lambda x: abs(x - k))[:3]


# The configs shipped in the package (boost_jax/configs; in a checkout a link to configs/).
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def packaged_configs() -> list[str]:
    """The names `--config NAME` finds among the packaged configs (clusters as clusters/NAME)."""
    return sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.glob("**/*.py")
                  if p.name != "__init__.py")


def config_path(spec) -> str:
    """The file a `--config` value names: the path itself when it is a file, else the packaged config
    of that name (`cola_60m`, `cola_60m.py`, `clusters/a100_4x`, or `configs/cola_60m.py` outside a
    checkout); the value unchanged when neither exists (the caller's error names it)."""
    spec = str(spec)
    if not spec or Path(spec).is_file():
        return spec
    name = spec.removeprefix("./").removeprefix("configs/")
    name = name if name.endswith(".py") else name + ".py"
    packaged = CONFIG_DIR / name
    return str(packaged) if "/.." not in f"/{name}" and packaged.is_file() else spec


def load_config_file(path, flag: str = "--config", *, run_config: bool = False):
    """The `get_config()` of a Python config file (configs/*.py, configs/clusters/*.py) or of a
    packaged config named as `config_path` takes it. Every way the file can fail (missing, a syntax
    error, an exception while it runs, no get_config, a run config that is not a ConfigDict) is a
    ConfigError naming `flag`, the file and its line."""
    path = Path(config_path(path))
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: no such file {str(path)!r}; give a config file or a packaged "
                                f"config's name ({', '.join(packaged_configs())})")
    spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"{flag}: {path} has no get_config(); a config file defines `def get_config():` "
                              "returning a ConfigDict (see configs/tiny.py)")
        cfg = module.get_config()
    except ConfigError:
        raise
    except SyntaxError as e:
        raise ConfigError(f"{flag}: {e.filename or path}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - whatever the file's own code raises, reported as one line
        import traceback
        frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path.resolve()
                  or f.filename == str(path)]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise ConfigError(f"{flag}: {where}: {type(e).__name__}: {e}") from None
    if run_config and not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"{flag}: {path}: get_config() returned a {type(cfg).__name__}, not an "
                          "ml_collections.ConfigDict; start from boost_jax.config.base_config() (see configs/tiny.py)")
    return cfg


def config_docs() -> dict[str, str]:
    """{"section.key": one line of meaning} for every key of `base_config()`, read from its comments
    (the one source of truth, beside the defaults): a key's own trailing comment, else the comment
    block above it (a block covers the keys that follow it up to a blank line or the first key with
    its own comment); a declared `model` field's meaning is its Field's help."""
    import inspect
    import re

    prefix, docs, block, fresh = {"c": ""}, {}, [], True
    for line in inspect.getsource(_schema).splitlines():
        s = line.strip()
        if not s:
            block, fresh = [], True
            continue
        if s.startswith("#"):  # a comment after keys starts a new block
            block, fresh = (block if fresh else []) + [s[1:].strip()], True
            continue
        section = re.match(r"(\w+) = c\.(\w+) = [\w.]+\(\)", s)
        if section:  # a block above a section covers its keys
            prefix[section.group(1)] = section.group(2) + "."
            continue
        fresh = False
        key = re.match(r"(\w+)\.(\w+) = (.*?)(?:\s+#\s*(.*))?$", s)
        if key and key.group(1) in prefix:
            own = key.group(4)
            docs[prefix[key.group(1)] + key.group(2)] = own or " ".join(b for b in block if b)
            if own:
                block = []
    docs.update({f"model.{name}": field.help for name, field in model_fields().items()})
    return docs


def describe_config(cfg=None) -> str:
    """Every key of the config (default: base_config()) with its value and meaning, one per line."""
    cfg = base_config() if cfg is None else cfg
    docs = config_docs()
    lines = []

    def walk(node, path):
        for k in node.keys():
            v = node[k]
            name = f"{path}{k}"
            if isinstance(v, ml_collections.ConfigDict):
                walk(v, name + ".")
            else:
                lines.append(f"  --config.{name}={v!r}  {docs.get(name, '')}".rstrip())

    walk(cfg, "")
    return "\n".join(lines)
