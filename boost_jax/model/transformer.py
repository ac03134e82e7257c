"""The LLaMA-style decoder: embedding, a scanned stack of pre-norm blocks, final norm, LM head."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from boost_jax.kernels import platform
from boost_jax.kernels.gate import gate_product
from boost_jax.kernels.gated_gemm import gated_matmul
from boost_jax.kernels.norm_choice import NormChoice
from boost_jax.model import autos, remat
from boost_jax.model import batch as batch_lib
from boost_jax.model.attention import Attention, Documents
from boost_jax.model.kinds import kind_class
from boost_jax.model.kinds.base import dense_init
from boost_jax.model.linear import (
    RESIDUAL,
    Projection,
    RMSNorm,
    add_norm_first,
    grouping,
    make_stacks,
    project,
    using_stacks,
)
from boost_jax.model.loss import head_loss, logits_of
from boost_jax.parallel.placement import LOCAL
from boost_jax.parallel.rules import constrain, gathered, logical_spec, take_rows, traced_mesh

GATE_IN_GEMM = "gemm"  # model.gate_kernel: the gate product inside the down projection's first GEMM
LOCAL_NORM = LOCAL.norm_choice()  # XLA's norm with separate adds on one device (kernels/norm_choice.py)


def compute_dtype(name: str):
    """`model.dtype`; auto: float32 when building for CPUs, bfloat16 for accelerators (kernels/platform.py)."""
    if name == "auto":
        return jnp.float32 if platform.name() == "cpu" else jnp.bfloat16
    return jnp.dtype(name)


class MLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype, placement=LOCAL):
        proj = dict(rngs=rngs, param_dtype=param_dtype)
        self.gate = Projection(cfg, cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), group="mlp_in", **proj)
        self.up = Projection(cfg, cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), group="mlp_in", **proj)
        self.down = Projection(cfg, cfg.d_ff, cfg.d_model, axes=("mlp", "embed"), group="mlp_out", **proj)
        # CoLA's larger models drop the SwiGLU σ: the bottleneck σ is the only nonlinearity.
        self.only_lr_act = bool(cfg.only_lr_act) and kind_class(cfg.linear).nonlinear(cfg)
        self.grouped = grouping(cfg.group_linears)
        factored = kind_class(cfg.linear).factored
        self.in_route, self.out_route = (placement.group(g, factored) for g in ("mlp_in", "mlp_out"))
        self.gate_kernel, self.mesh = cfg.get("gate_kernel", "xla"), placement.mesh

    def __call__(self, x, norm, first=None):
        """`first`: gate's and up's first stages computed elsewhere (model/linear.py `add_norm_first`)."""
        g, u = project([self.gate, self.up], x, grouped=self.grouped, norm=norm, route=self.in_route, first=first)
        s = self._gated_first(g, u) if self.gate_kernel == GATE_IN_GEMM else None
        if s is not None:
            return project([self.down], None, grouped=False, route=self.out_route, first=s[:, :, None])[0]
        h = self._gate(g, u)
        return project([self.down], constrain(h, CORE_AXES["act"]), grouped=False, route=self.out_route)[0]

    def projection_groups(self):
        """[(projections, grouped, route, keep)]: the groups `__call__` hands `project`."""
        return [([self.gate, self.up], self.grouped, self.in_route, ()), ([self.down], False, self.out_route, ())]

    def _act(self) -> str:
        return "none" if self.only_lr_act else "silu"

    def _gate(self, g, u):
        """act(g)·u: `model.gate_kernel` (kernels/gate.py), the Pallas call once per shard on a mesh
        (elementwise: any layout of the activation splits it into independent pieces)."""
        impl = "pallas" if self.gate_kernel == GATE_IN_GEMM else self.gate_kernel
        product = functools.partial(gate_product, act=self._act(), impl=impl)
        spec = logical_spec(CORE_AXES["act"], g.shape) if impl != "xla" else None
        if spec is None or self.mesh is None:
            return product(g, u)
        return jax.shard_map(
            product, mesh=traced_mesh(self.mesh), in_specs=(spec, spec), out_specs=spec, check_vma=False
        )(g, u)  # a pallas_call has no vma types

    def _gated_first(self, g, u):
        """`model.gate_kernel=gemm`: the down projection's first stage (act(g)·u) @ W1 as one kernel each
        way (kernels/gated_gemm.py), once per shard on a mesh; None (the gate kernel and XLA's GEMM
        run) where the kind adds a term from its input, its route replaces the projection, or the mesh
        splits d_ff (each shard would hold a partial sum)."""
        down = self.down
        if down.has_extra or self.out_route.replaces_projection:
            return None
        w = down.first_weight(lambda w, names: gathered(w, names, g.dtype))
        fused = functools.partial(gated_matmul, act=self._act(), impl="pallas")
        spec = logical_spec(CORE_AXES["act"], g.shape)
        if spec is None or self.mesh is None:
            return fused(g, u, w)
        parts = (*spec, *(None,) * (g.ndim - len(spec)))
        if parts[-1] is not None:
            return None
        spec, out = P(*parts), P(*parts[:-1], None)
        return jax.shard_map(
            fused, mesh=traced_mesh(self.mesh), in_specs=(spec, spec, P()), out_specs=out, check_vma=False
        )(g, u, w)


class Block(nnx.Module):
    """A pre-norm block; `norm` is the placement's choice (kernels/norm_choice.py). With its `fused_add`
    the block's residual adds run inside the norms that read them
    (RMSNorm.add): the attention output's add in the MLP's norm, and the MLP output's add deferred to
    the next block's first norm (the block returns (stream, MLP output) and takes that pair as its x).
    Groups whose norm rides in the A all-reduce (BTP's online norm) keep the separate adds."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype, norm: NormChoice = LOCAL_NORM, placement=LOCAL):
        kw = dict(eps=cfg.norm_eps, param_dtype=param_dtype, impl=norm.kernel, run=placement.norm(norm))
        self.attn_norm = RMSNorm(cfg.d_model, **kw)
        self.attn = Attention(cfg, rngs=rngs, param_dtype=param_dtype, placement=placement)
        self.mlp_norm = RMSNorm(cfg.d_model, **kw)
        self.mlp = MLP(cfg, rngs=rngs, param_dtype=param_dtype, placement=placement)
        self.fuse_residual = bool(norm.fused_add)
        # Where the stack runs unrolled outside a pipeline, each residual sum is stored as the next group's
        # route stores it (`Grouped.stream`). In a scanned stack (a pipeline's too) XLA:GPU cannot schedule
        # the online norm's barrier once it double-buffers the loop: the sums stay as XLA keeps them.
        self.stores_stream = bool(cfg.scan_unroll) and (
            placement.mesh is None or placement.mesh.shape.get("pipeline", 1) == 1
        )

    def __call__(self, x, positions, cache=None, docs=None):
        attn, mlp = self.attn, self.mlp
        if isinstance(x, tuple):  # (stream, the previous block's MLP output): add it in this norm
            first, y, x = add_norm_first([attn.q, attn.k, attn.v], x, self.attn_norm, attn.grouped, attn.qkv_route)
            h, cache = attn(x if y is None else y, None, positions, cache, docs, first=first)
        else:
            h, cache = attn(x, self.attn_norm, positions, cache, docs)
        if self.fuse_residual:
            first, y, x = add_norm_first([mlp.gate, mlp.up], (x, h), self.mlp_norm, mlp.grouped, mlp.in_route)
            out = mlp(x if y is None else y, None, first=first)
            return (constrain(x, RESIDUAL), constrain(out, RESIDUAL)), cache
        store = (lambda route, v: route.stream(v)) if self.stores_stream else (lambda route, v: v)
        x = store(mlp.in_route, constrain(x + h, RESIDUAL))
        x = store(attn.qkv_route, constrain(x + self.mlp(x, self.mlp_norm), RESIDUAL))
        return x, cache


LAYER_STACK = "layers"  # the parameters' key of the stacked layers (what a pipeline runs)


def _resolved(cfg, remat_policy: str, norm_impl: str) -> None:
    """A model reads its config as the builder resolved it (runtime/build.py; `build_model` for one
    built directly): an `auto` left here is refused, naming the field."""
    given = {"model.group_linears": cfg.group_linears, "model.scan_unroll": cfg.scan_unroll}
    given["model.gate_kernel"] = cfg.get("gate_kernel", "xla")
    given.update({"remat.policy": remat_policy, "kernels.rmsnorm": norm_impl})
    left = [k for k, v in given.items() if v == autos.AUTO]
    if left:
        raise ValueError(f"{', '.join(left)} still `auto`: build the model through runtime/build.py or build_model")


class Transformer(nnx.Module):
    """`placement` (boost_jax/parallel/placement.py) is the strategy bound to a mesh, chosen when the
    model is built: it decides how norms, projection groups and the layer stack run (LOCAL: one
    device, nothing partitioned)."""

    def __init__(
        self,
        cfg,
        *,
        rngs: nnx.Rngs,
        remat_policy: str = "none",
        norm_impl: str = "xla",
        placement=LOCAL,
        remat_pipeline: str = "none",
        residual_norm: str = "auto",
    ):
        _resolved(cfg, remat_policy, norm_impl)
        norm = placement.norm_choice(norm_impl, residual_norm, kind_class(cfg.linear).factored)
        param_dtype = jnp.dtype(cfg.param_dtype)
        self.placement = placement
        self.pipeline = placement.pipeline(LAYER_STACK)  # None: the layers run as one scan
        self.context = placement.context()  # None, or the sequence split over `context` (its layout)
        self.dtype = compute_dtype(cfg.dtype)
        self.remat_policy = remat_policy
        self.remat_stage = remat_pipeline == "stage"  # remat.pipeline: recompute whole pipeline stages
        self.n_layers, self.n_kv_heads, self.head_dim = cfg.n_layers, cfg.n_kv_heads, cfg.d_model // cfg.n_heads
        self.embed = nnx.Param(
            cfg.init_std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), param_dtype),
            axes=("vocab_in", "embed"),
            compute_only=True,
        )

        # One Block's parameters with a leading layer axis, so the stack runs as one lax.scan and
        # compile time does not grow with depth.
        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(r):
            return Block(cfg, rngs=r, param_dtype=param_dtype, norm=norm, placement=placement)

        self.layers = stacked(rngs)
        self.final_norm = RMSNorm(
            cfg.d_model,
            eps=cfg.norm_eps,
            param_dtype=param_dtype,
            axis="head_norm",
            impl=norm.kernel,
            run=placement.norm(norm),
        )
        self.unroll = bool(cfg.scan_unroll)
        self.fuse_residual = norm.fused_add
        self.tie_embeddings = bool(cfg.tie_embeddings)
        self.loss_chunk, self.z_loss = int(cfg.loss_chunk), float(cfg.z_loss)
        self.low_logits = cfg.get("logits_dtype", "compute") == "compute"
        if not self.tie_embeddings:
            self.lm_head = nnx.Param(
                dense_init(rngs.params(), (cfg.d_model, cfg.vocab_size), cfg.d_model, cfg.d_model, param_dtype),
                axes=("head_embed", "vocab"),
                compute_only=True,
            )

    def init_cache(self, batch: int, max_len: int):
        shape = (self.n_layers, batch, max_len, self.n_kv_heads, self.head_dim)
        return {"k": jnp.zeros(shape, self.dtype), "v": jnp.zeros(shape, self.dtype)}

    def hidden(self, tokens, positions=None, cache=None, docs=None, stacks=None):
        """Final-norm hidden states [B, T, d] (and the updated cache, or None). `docs`
        (attention.Documents): attention stays inside each row's documents. Under context parallelism
        the states come in the context layout (`self.context.layout` of the positions). `stacks`: the
        layers' grouped weights made once per step (`weight_stacks`; None: stacked in each layer)."""
        x, positions, given_positions, docs = self._embedded(tokens, positions, cache, docs)
        layer, layer_state = self._layer_stack()
        if self.pipeline is not None and cache is None:
            x = self.pipeline(
                layer, layer_state, x, given_positions, unroll=self.unroll, docs=docs, remat_stage=self.remat_stage
            )
        else:
            if self.fuse_residual:  # the stream and the last block's output, added in the next norm
                x = (x, jnp.zeros_like(x))
            if isinstance(stacks, list):  # made per layer (`weight_stacks` of an unrolled stack)
                for i, made in enumerate(stacks):
                    x, _ = layer(x, jax.tree.map(lambda w, i=i: w[i], layer_state), None, positions, docs, made)
            else:
                x, cache = jax.lax.scan(
                    lambda h, xs: layer(h, xs[0], xs[1], positions, docs, xs[2]),
                    x,
                    (layer_state, cache, stacks),
                    unroll=self.n_layers if self.unroll else 1,
                )
        return _final(self.final_norm, x), cache

    def _embedded(self, tokens, positions, cache, docs):
        """(the stack's input x [B, T, d], positions, the positions as given (None: 0..T-1), docs), in the
        context layout under context parallelism."""
        tokens, positions, given_positions, docs = self._laid_out(tokens, positions, cache, docs)
        return _embed(self._embedding(), tokens), positions, given_positions, docs

    def _embedding(self):
        """The embedding table as the model computes with it (gathered, in the compute dtype)."""
        return gathered(self.embed[...], ("vocab_in", "embed"), self.dtype)

    def _laid_out(self, tokens, positions, cache, docs):
        """(tokens [B, T], positions, the positions as given (None: 0..T-1), docs), in the context layout
        under context parallelism: what `_embedded` embeds."""
        self.placement.require_rules()
        b, t = tokens.shape
        given_positions = positions
        if self.context is not None and cache is None:  # the load-balanced order of the sequence
            positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t)) if positions is None else positions
            tokens, positions = self.context.layout(tokens), self.context.layout(positions)
            given_positions = positions
            docs = None if docs is None else Documents.packed(self.context.layout(docs.segments))
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
        return tokens, positions, given_positions, docs

    def _layer_stack(self):
        """(layer(h, state, cache, positions[, docs]) -> (h, cache), the stacked layers' state [L, ...])."""
        graphdef, layer_state = nnx.split(self.layers)

        def layer(x, state, layer_cache, pos, docs=None, stacks=None):
            block = nnx.merge(graphdef, state)
            with using_stacks(block, stacks):
                return block(x, pos, layer_cache, docs)

        return remat.wrap(layer, self.remat_policy), layer_state

    def weight_stacks(self) -> dict | list:
        """{name: [L, ...]}: the layers' projection weights stacked as `project` runs them (linear.py
        `make_stacks`), for the groups whose weights come in the compute dtype; an unrolled stack gets them
        as a list of each layer's {name: [...]}. What the train step makes once per step from its
        cast copy and hands `next_token_loss` (runtime/step.py)."""
        graphdef, layer_state = nnx.split(self.layers)
        made = jax.vmap(lambda state: make_stacks(nnx.merge(graphdef, state), self.dtype))(layer_state)
        if not self.unroll:
            return made
        return [jax.tree.map(lambda w, i=i: w[i], made) for i in range(self.n_layers)]  # no slice per micro-batch

    def head_weight(self):
        if self.tie_embeddings:
            return gathered(self.embed[...], ("vocab_in", "embed"), self.dtype).T
        return gathered(self.lm_head[...], ("head_embed", "vocab"), self.dtype)

    def __call__(self, tokens, positions=None, cache=None, docs=None):
        """Logits [B, T, vocab] in float32, and the updated cache (None without one)."""
        h, cache = self.hidden(tokens, positions, cache, docs)
        logits = logits_of(h, self.head_weight())
        if self.context is not None and cache is None:
            logits = self.context.unlayout(logits)
        return logits, cache

    def next_token_loss(self, batch, with_z_loss: bool = True, stacks=None):
        """Next-token cross-entropy (float32), chunked over positions by `model.loss_chunk` so no
        float32 [B, T, V] logits exist; plus `model.z_loss` when asked. A stream batch (tokens
        [B, T+1]) gives the mean over its targets; a batch of documents (boost_jax/model/batch.py) the
        *sum* over the targets that count (the step divides by the global count). `stacks`: `hidden`'s."""
        tokens = batch_lib.tokens_of(batch)
        positions, docs = None, None
        if batch_lib.is_documents(batch):
            t = tokens.shape[1] - 1
            if "segments" in batch:
                positions, docs = batch["positions"][:, :-1], Documents.packed(batch["segments"][:, :-1])
            elif "lengths" in batch:  # (stream rows with a row mask attend as a stream batch)
                docs = Documents.one_per_row(batch["lengths"], t)
        labels, mask = tokens[:, 1:], batch_lib.target_mask(batch)
        # Pipelined, the head and loss run one pipeline micro-batch (and chunk of positions) at a time,
        # so their live logits block does not grow with the micro-batch count.
        loss = functools.partial(
            head_loss, chunk=self.loss_chunk, z_loss=self.z_loss if with_z_loss else 0.0, low_logits=self.low_logits
        )
        if self.context is not None:  # h is in the context layout: the targets follow; each device
            # scans its own positions
            labels, mask = self.context.layout(labels), None if mask is None else self.context.layout(mask)
            loss = functools.partial(loss, seq_groups=self.context.size)
        if self.pipeline is not None:  # ... and once per batch replica (the head gradient reduced once)
            inputs, _, given_positions, docs = self._laid_out(tokens[:, :-1], positions, None, docs)
            layer, layer_state = self._layer_stack()
            norm_graph, norm_state = nnx.split(self.final_norm)
            return self.pipeline.train_loss(
                layer,
                layer_state,
                inputs,
                given_positions,
                embed=_embed,
                embed_params=self._embedding,
                docs=docs,
                unroll=self.unroll,
                remat_stage=self.remat_stage,
                final=lambda state, h: _final(nnx.merge(norm_graph, state), h),
                loss=loss,
                head_params=lambda: (norm_state, self.head_weight()),
                labels=labels,
                mask=mask,
            )
        h, _ = self.hidden(tokens[:, :-1], positions, docs=docs, stacks=stacks)
        return loss(h, self.head_weight(), labels, mask=mask)


def _embed(table, tokens):
    """The stack's input: the embedding rows of `tokens`, in the residual stream's layout."""
    return constrain(take_rows(table, tokens), RESIDUAL)


def _final(norm, x):
    """One gather of the hidden state (BTP keeps it split along d; sequence parallelism along T), then
    the final norm: a vocab-parallel head runs on it without further collectives."""
    whole_rows = ("act_batch", "act_seq", None)
    if isinstance(x, tuple):  # (stream, the last block's output): the add runs in the final norm
        return norm.add(*(constrain(v, whole_rows) for v in x), whole_rows)[0]
    return norm(constrain(x, whole_rows), whole_rows)


def build_model(
    model_cfg,
    seed: int = 0,
    remat_policy: str = "none",
    norm_impl: str = "xla",
    placement=LOCAL,
    remat_pipeline: str = "none",
    residual_norm: str = "auto",
) -> Transformer:
    """A model built directly (tests, tools): what is left `auto` is resolved here for `placement`
    (model/autos.py `for_model`); the builder's models come from `model_from_config`, resolved."""
    model_cfg, remat_policy, norm_impl = autos.for_model(model_cfg, remat_policy, norm_impl, placement.mesh)
    return _model(model_cfg, seed, remat_policy, norm_impl, placement, remat_pipeline, residual_norm)


def _model(model_cfg, seed, remat_policy, norm_impl, placement, remat_pipeline, residual_norm) -> Transformer:
    return Transformer(
        model_cfg,
        rngs=nnx.Rngs(params=seed),
        remat_policy=remat_policy,
        norm_impl=norm_impl,
        placement=placement,
        remat_pipeline=remat_pipeline,
        residual_norm=residual_norm,
    )


def model_from_config(cfg, placement=LOCAL) -> Transformer:
    """The model a run config describes (shapes, remat policies, norm kernel), placed by `placement`: the
    config as runtime/build.py resolved it (no field left `auto`)."""
    k = cfg.kernels
    return _model(
        cfg.model, cfg.seed, cfg.remat.policy, k.rmsnorm, placement, cfg.remat.pipeline, k.get("residual_norm", "auto")
    )


# The projection groups (boost_jax/parallel/strategies.py PROJECTION_GROUPS): the logical axes of each
# group's input and of its projections' outputs, as Attention and MLP declare them.
PROJECTION_AXES = {
    "qkv": ("embed", ("heads", "kv_heads", "kv_heads")),
    "o": ("heads", ("embed",)),
    "mlp_in": ("embed", ("mlp", "mlp")),
    "mlp_out": ("mlp", ("embed",)),
}
# The logical axes of what the two cores between the groups run on: the attention's queries (as
# Attention constrains them, their head_dim axis left out) and the MLP's activation. With
# PROJECTION_AXES and RESIDUAL they are what the planner reads a strategy's layouts from.
CORE_AXES = {"attention": ("act_batch", "act_seq", "act_heads"), "act": ("act_batch", "act_seq", "act_mlp")}


def axis_units(m) -> dict[str, tuple[str, int]]:
    """{logical axis: (config field, whole units)}: what a mesh axis splitting that axis must divide
    (whole heads, not head columns). In the order a misfit is reported."""
    units = {
        "heads": ("model.n_heads", int(m.n_heads)),
        "kv_heads": ("model.n_kv_heads", int(m.n_kv_heads)),
        "mlp": ("model.d_ff", int(m.d_ff)),
        "embed": ("model.d_model", int(m.d_model)),
        "norm": ("model.d_model", int(m.d_model)),
    }
    return {**units, **kind_class(m.linear).axis_units(m)}


def projection_widths(m) -> dict[str, int]:
    """Every projection input/output width, by config field."""
    return {
        "model.d_model": int(m.d_model),
        "model.d_ff": int(m.d_ff),
        "model.n_kv_heads*head_dim": int(m.n_kv_heads) * (int(m.d_model) // int(m.n_heads)),
    }


def split_widths(m) -> dict[str, int]:
    """{what: width} of the inner dimensions of the (outer, inner) pairs the model's GEMM operands are
    reshaped from: heads x head_dim into the output projection, and the kind's own (LinearKind
    `split_widths`). The GPU compile reads them (boost_jax/xla_gpu_flags.py `gemm_options`)."""
    kind = kind_class(m.linear)
    widths = {"model.d_model/model.n_heads (head_dim)": int(m.d_model) // int(m.n_heads)}
    for d_in, d_out in sorted(set(projection_shapes(m))):
        for i, w in enumerate(kind.split_widths(m, d_in, d_out)):
            widths[f"model.linear={m.linear} {d_in}x{d_out} split {i}"] = int(w)
    return widths


def projection_shapes(cfg) -> list[tuple[int, int]]:
    """(d_in, d_out) of every projection of one block: q, k, v, o, gate, up, down."""
    d, h, kv, i = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff
    dh = d // h
    return [(d, h * dh), (d, kv * dh), (d, kv * dh), (h * dh, d), (d, i), (d, i), (i, d)]


def weight_flops(cfg, training: bool = True) -> float:
    """FLOPs per step spent building projection matrices from stored parameters (tensor-train cores),
    independent of the tokens: forward once, backward twice that."""
    kind = kind_class(cfg.linear)
    forward = cfg.n_layers * sum(kind.weight_flops(cfg, a, b) for a, b in projection_shapes(cfg))
    return 3.0 * forward if training else float(forward)


def flops_per_token(cfg, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: every projection, attention scores and values over the full (masked)
    sequence as XLA computes them, and the LM head. Training counts forward + backward = 3x forward;
    recompute from activation checkpointing is not model work and is not counted, nor is building
    weights from stored factors once per step (`weight_flops`)."""
    kind = kind_class(cfg.linear)
    per_layer = (
        sum(kind.flops(cfg, a, b) for a, b in projection_shapes(cfg))  # q, k, v, o, gate, up, down
        + 2 * 2 * seq_len * cfg.d_model
    )  # q·k and p·v over all heads
    forward = cfg.n_layers * per_layer + 2 * cfg.d_model * cfg.vocab_size
    return 3.0 * forward if training else float(forward)
