"""The schema: every key the code reads with its default and one line of meaning (its comment), the
`model` fields registries declare, and the names plain values are checked against."""

from __future__ import annotations

import dataclasses
import inspect
import re

import ml_collections
from ml_collections import config_dict

from boost_jax.errors import ConfigError


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
            raise ConfigError(
                f"{owner}: model.{name} is already a key of the model section; name the field "
                f"after its owner (e.g. model.{owner}_{name})"
            )
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
WEIGHT_CASTS = ("auto", "step", "micro_batch")  # train.weight_casts (boost_jax/runtime/state.py)


def weights_cast_once(weight_casts: str, factored: bool, grad_accum: int) -> bool:
    """train.weight_casts resolved: whether the train step casts the weights it uses only in the compute
    dtype once per step (`step`), for a kind (factored or dense) at `grad_accum` micro-batches per step;
    `auto`: the factored kinds over several micro-batches (runtime/state.py `once_per_step` says why).
    The step reads it (`once_per_step`), and the planner for the copy's memory (planner/pricing/memory.py)."""
    if weight_casts == "auto":
        return factored and grad_accum > 1
    return weight_casts == "step"


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
    c = ml_collections.ConfigDict()
    _run_keys(c)
    _model_section(c, owned or {})
    _data_section(c)
    _train_section(c)
    _checkpoint_section(c)
    _remat_section(c)
    _parallel_section(c)
    _kernels_section(c)
    _distributed_section(c)
    c.lock()
    return c


def _run_keys(c: ml_collections.ConfigDict) -> None:
    """The run's own keys: its name, directories, seed, caches and profiling."""
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


def _model_section(c: ml_collections.ConfigDict, owned: dict) -> None:
    """`model`: the architecture, then the fields the registered kinds declare (`owned`)."""
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
    # auto | true | false | first (only the first stages, the A's, as one GEMM; each B its own)
    m.group_linears = config_dict.FieldReference("auto", field_type=object)
    # unroll the layer scan. auto: unrolled on GPUs where only parallel.data splits the mesh (faster on
    # one H100, benchmarks/RESULTS.md), scanned elsewhere (compile time does not grow with depth).
    m.scan_unroll = config_dict.FieldReference("auto", field_type=object)  # auto | true | false
    # auto | gemm | pallas | xla: the MLP's gate·up product (pallas: one kernel each way, the backward's
    # two gradients in one pass, boost_jax/kernels/gate.py; gemm: inside the down projection's first GEMM,
    # one kernel each way, kernels/gated_gemm.py). auto: gemm on GPUs where the gate and up outputs are
    # separate GEMMs' (a factored kind, group_linears not true), pallas for kinds with an extra term, else xla.
    m.gate_kernel = "auto"
    # auto | norm | rope | gemm | xla: CoLA's σ read into each second-stage (B) GEMM's kernel, σ' an epilogue of
    # its input gradient (boost_jax/kernels/gated_gemm.py `act_matmuls`), on one device where each B is its own
    # GEMM; rope: q's and k's RoPE inside their kernels too; norm: also the residual add + RMSNorm read into
    # the first stage's GEMM (kernels/norm_gemm.py; with the fused add + norm). auto: norm where
    # model.gate_kernel resolves to gemm, else xla (σ and RoPE kernels of their own).
    m.bottleneck_kernel = "auto"
    # auto | xla | chunked | pallas | cudnn (boost_jax/model/attention/). auto: cudnn on a GPU in
    # bf16/fp16, else xla up to 1024 keys, else chunked (blockwise, O(T) memory).
    m.attention = "auto"
    m.loss_chunk = 512  # positions per chunk of the head + cross-entropy (no f32 [B,T,V]); 0: one piece
    # compute | float32: the dtype the head GEMM writes the training loss's logits in (compute: model.dtype,
    # the cross-entropy reading them into float32; float32: a float32 [B, c, V] block and its gradient)
    m.logits_dtype = "compute"
    m.z_loss = 0.0  # weight of PaLM's z-loss, mean(logsumexp(logits)^2), added to the training loss


def _data_section(c: ml_collections.ConfigDict) -> None:
    """`data`: the inputs, the tokenizer, and how rows are cut and ordered."""
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


def _train_section(c: ml_collections.ConfigDict) -> None:
    """`train`: batch, schedule, AdamW, non-finite steps, logging and evaluation."""
    t = c.train = ml_collections.ConfigDict()
    t.seq_len = 128  # tokens per row (the model reads seq_len, predicts the next of each)
    t.global_batch = 16  # sequences per optimizer step, all devices and micro-batches together
    t.grad_accum = 1  # micro-batches per optimizer step
    # Where the weights the model uses only in its compute dtype (the GEMMs' matrices, the embedding)
    # are cast to it: step (once per step, before the micro-batches: faster, their copy lives through
    # the step), micro_batch (in each), auto (step for the factored kinds at grad_accum > 1; runtime/state.py).
    t.weight_casts = "auto"
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


def _checkpoint_section(c: ml_collections.ConfigDict) -> None:
    """`checkpoint`: how often, how many, and resuming."""
    k = c.checkpoint = ml_collections.ConfigDict()
    k.every = 100  # save a checkpoint every N steps (and at the end, and on a stop signal)
    k.keep = 3  # keep the newest N checkpoints
    k.async_save = True  # write checkpoints in the background while training goes on
    k.resume = True  # resume from run_dir's newest checkpoint when it has one
    # resume=false on a run_dir that holds checkpoints is refused (a new run would mix its steps with
    # theirs); supersede=true moves them aside as N.superseded (never deleted) and starts afresh.
    k.supersede = False


def _remat_section(c: ml_collections.ConfigDict) -> None:
    """`remat`: what the backward recomputes."""
    r = c.remat = ml_collections.ConfigDict()
    # auto | none | full | dots | lowrank | offload_lowrank. auto: none on CPUs and for an unrolled
    # stack; a scanned stack on a GPU recomputes (lowrank for factored kinds, full for dense).
    r.policy = "auto"
    # none | stage: with parallel.pipeline > 1, each pipeline stage is recomputed in the backward, so the
    # tick loop keeps one stage input per micro-batch instead of every layer's activations.
    r.pipeline = "none"


def _parallel_section(c: ml_collections.ConfigDict) -> None:
    """`parallel`: the plan, the mesh, the strategy and the pipeline and context options."""
    p = c.parallel = ml_collections.ConfigDict()
    # explicit | auto. auto: the trainer asks the planner (boost_jax/planner) for the best plan it can run on
    # the devices it sees and runs it (mesh, strategy, remat, grad_accum, pipeline schedule, context),
    # printing the pick and its predicted step time and memory (leave the mesh sizes parallel.* unset).
    p.plan = "explicit"
    # parallel.plan=auto: the cluster file the planner prices (configs/clusters/*.py or a packaged name
    # such as clusters/h100_8x); "": the one for the detected device kind (H100, A100)
    p.cluster = ""
    # parallel.plan=auto: the memory per device (GB) the compiled pick must fit; 0: the device's own (its
    # allocator's limit), or where the device reports none (CPUs) the cluster's usable HBM
    p.device_memory_gb = 0.0
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


def _kernels_section(c: ml_collections.ConfigDict) -> None:
    """`kernels`: the fused kernels' implementations."""
    kn = c.kernels = ml_collections.ConfigDict()
    # xla | pallas | triton: the fused norm(+Σx²) kernel (boost_jax/kernels/); pallas and triton fall
    # back to xla, loudly and recorded in metrics.jsonl, where they cannot run (triton: NVIDIA GPUs
    # with jax-triton installed, the `gpu` extra)
    # auto: triton on NVIDIA GPUs with jax-triton, pallas on other GPUs, xla elsewhere.
    kn.rmsnorm = "auto"
    # fused | separate: the residual adds run inside the norms that read them (one Triton kernel each
    # way, kernels.rmsnorm=triton only; BTP's online norm and pipelined stacks keep separate adds).
    # auto: fused where kernels.rmsnorm resolves to triton.
    kn.residual_norm = "auto"


def _distributed_section(c: ml_collections.ConfigDict) -> None:
    """`distributed`: the processes of a multi-process run."""
    # Multi-process runs (boost_jax/runtime/distributed.py). 0 / -1 / "": take it from BOOST_COORDINATOR,
    # BOOST_NUM_PROCESSES, BOOST_PROCESS_ID, else from SLURM, else run as a single process.
    ds = c.distributed = ml_collections.ConfigDict()
    ds.coordinator_address = ""  # host:port of process 0
    ds.num_processes = 0  # processes in the job
    ds.process_id = -1  # this process's index
    ds.cpu_collectives = "gloo"  # cross-process collectives of the CPU backend: gloo | mpi


# The schema's sections in order; config_docs reads their comments.
_SECTIONS = (
    _run_keys,
    _model_section,
    _data_section,
    _train_section,
    _checkpoint_section,
    _remat_section,
    _parallel_section,
    _kernels_section,
    _distributed_section,
)


def config_docs() -> dict[str, str]:
    """{"section.key": one line of meaning} for every key of `base_config()`, read from its comments
    (the one source of truth, beside the defaults): a key's own trailing comment, else the comment
    block above it (a block covers the keys that follow it up to a blank line or the first key with
    its own comment); a declared `model` field's meaning is its Field's help."""
    prefix, docs, block, fresh = {"c": ""}, {}, [], True
    for line in "\n".join(inspect.getsource(section) for section in _SECTIONS).splitlines():
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
