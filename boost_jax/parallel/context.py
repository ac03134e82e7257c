"""Context parallelism: the sequence split over the `context` mesh axis (`parallel.context` = C).

Layout (causal load balance): a row of T positions is cut into 2C chunks; device c of `context`
holds chunks c and 2C-1-c, so under the causal mask every device has the same attention work. The
model sees the sequence in that order (`layout`): tokens, positions, segment ids, targets and mask
are permuted alike on each device's own rows where the batch enters the model, so nothing moves and
the loss, a sum over positions, is unchanged; the loader, the data order and the checkpoints do not
know C. Every activation is then split along the sequence over `context`: norms, projections and the
MLP are per token, and the chunked loss scans each device's own positions.

Attention, the one place tokens meet, runs in a `shard_map` island over the whole mesh (`Context`:
ring or all_gather, K/V or the bottleneck activations passed). `traffic` gives the per-step context
traffic and memory of a config by formula (what the comm report checks against the compiled
program, and what the planner prices).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from boost_jax.parallel import rules
from boost_jax.parallel.mesh import split_by_tensor
from boost_jax.parallel.pipeline.arithmetic import ticks
from boost_jax.parallel.rules import Strategy
from boost_jax.parallel.strategies import get_strategy

AXIS = "context"
NEG = -1e30  # the log-sum-exp of a query row no key of the block is visible to


# ------------------------------------------------------------------------------------------ layout


def chunk_order(c: int) -> np.ndarray:
    """The 2C chunks of a row in device order: device d holds chunks d and 2C-1-d."""
    return np.array([i for d in range(c) for i in (d, 2 * c - 1 - d)])


def _permute_chunks(x, c: int, order, axis: int):
    if c == 1:
        return x
    t = x.shape[axis]
    chunks = x.reshape(x.shape[:axis] + (2 * c, t // (2 * c)) + x.shape[axis + 1 :])
    return jnp.take(chunks, order, axis=axis).reshape(x.shape)


def layout(x, c: int, axis: int = 1):
    """A row's positions (along `axis`) in the load-balanced order of `chunk_order`."""
    return _permute_chunks(x, c, chunk_order(c), axis)


def unlayout(x, c: int, axis: int = 1):
    """The inverse of `layout`: the row back in its natural order."""
    return _permute_chunks(x, c, np.argsort(chunk_order(c)), axis)


# --------------------------------------------------------------------------------------- the ring


def _send(x, n: int, shift: int = 1):
    """x to the device `shift` places on along the context ring (device i -> i + shift): one
    collective-permute per array."""
    return jax.lax.ppermute(x, AXIS, [(i, (i + shift) % n) for i in range(n)])


def _pack(pair, reverse: bool = False):
    """(a, b) of one shape as one array [2, ...] (one collective-permute moves both)."""
    return jnp.stack(pair[::-1] if reverse else pair)


def _unpack(x, reverse: bool = False):
    return (x[1], x[0]) if reverse else (x[0], x[1])


def _segs(seg, j, width: int):
    """Device j's segment ids (its two chunks) out of the full row's, in layout order."""
    return None if seg is None else jax.lax.dynamic_slice_in_dim(seg, j * width, width, axis=1)


def _half(x, i: int, length: int):
    return None if x is None else x[:, i * length : (i + 1) * length]


def _merge(out, lse, o_p, lse_p):
    """The online softmax: two partial attentions (out, log-sum-exp) of the same queries as one."""
    new = jnp.logaddexp(lse, lse_p)
    return out * jnp.exp(lse - new)[..., None] + o_p * jnp.exp(lse_p - new)[..., None], new


def _block_fwd(blocks, q, k, v, q_seg, k_seg, earlier: bool):
    """Our queries (chunks c, 2C-1-c) against another device's block: if it is earlier (j < c), its
    first chunk for both of ours; else all of it for our second chunk. Returns (out, lse) for both
    chunks (rows that saw nothing: 0 and NEG)."""
    w = q.shape[1]
    half = w // 2
    if earlier:
        return blocks.fwd(q, k[:, :half], v[:, :half], w, q_seg, _half(k_seg, 0, half))
    o, lse = blocks.fwd(q[:, half:], k, v, w, _half(q_seg, 1, half), k_seg)
    return (jnp.concatenate([jnp.zeros_like(o), o], 1), jnp.concatenate([jnp.full_like(lse, NEG), lse], 1))


def _block_bwd(blocks, q, k, v, out, lse, dout, q_seg, k_seg, earlier: bool):
    """(dq, dk, dv) float32 of `_block_fwd`'s pairs, for both our chunks and the whole block."""
    w = q.shape[1]
    half = w // 2
    if earlier:
        dq, dk, dv = blocks.bwd(q, k[:, :half], v[:, :half], out, lse, dout, w, q_seg, _half(k_seg, 0, half))
        pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], 1)  # noqa: E731 - the unvisited second chunk
        return dq, pad(dk), pad(dv)
    dq, dk, dv = blocks.bwd(
        q[:, half:], k, v, out[:, half:], lse[:, half:], dout[:, half:], w, _half(q_seg, 1, half), k_seg
    )
    return jnp.concatenate([jnp.zeros_like(dq), dq], 1), dk, dv


def _ring_steps(n: int):
    """(step s, the device whose block arrives at step s, relative: c - s) for s = 1..n-1."""
    return range(1, n)


def _ring_forward(blocks, n, q, kv, seg, rebuild):
    """(out float32, lse) of our queries over every device's block, and the blocks' count. `kv`: what
    travels (K, V, or what `rebuild(kv, j)` turns into the (K, V) of device j's block)."""
    c = jax.lax.axis_index(AXIS)
    w = q.shape[1]
    q_seg = _segs(seg, c, w)
    kv = _pack(kv)
    nxt = _send(kv, n) if n > 1 else None  # step 1's block, in flight during step 0
    k, v = rebuild(_unpack(kv), c)
    out, lse = blocks.fwd(q, k, v, 0, q_seg, None)  # our own chunks: causal in local order
    for s in _ring_steps(n):
        cur = nxt
        if s + 1 < n:
            nxt = _send(cur, n)  # the next block moves while this one is computed
        j = (c - s) % n
        k, v = rebuild(_unpack(cur), j)
        o_p, lse_p = jax.lax.cond(
            j < c,
            functools.partial(_block_fwd, blocks, earlier=True),
            functools.partial(_block_fwd, blocks, earlier=False),
            q,
            k,
            v,
            q_seg,
            _segs(seg, j, w),
        )
        out, lse = _merge(out, lse, o_p, lse_p)
    return out, lse


def _ring_backward(blocks, n, q, kv, seg, out, lse, dout, rebuild, rebuild_vjp):
    """(dq, d(kv)) float32: the ring again; each step's gradient of the block it holds is sent straight
    back to the block's device (device c - s at step s: one permute, independent of the later steps,
    so it overlaps them; a gradient accumulator travelling with its block instead would chain every
    step's send to the last). `rebuild_vjp(kv, j, dk, dv)` turns a block's dK/dV into the gradient of
    what travels (and accumulates any weight gradient itself)."""
    c = jax.lax.axis_index(AXIS)
    w = q.shape[1]
    q_seg = _segs(seg, c, w)
    # Packed the other way round: XLA must not merge these sends with the forward's where both land
    # in one computation (layers unrolled), which would keep every received block alive until the
    # backward.
    packed = _pack(kv, reverse=True)
    nxt = _send(packed, n) if n > 1 else None
    k, v = rebuild(kv, c)
    dq, dk, dv = blocks.bwd(q, k, v, out, lse, dout, 0, q_seg, None)
    acc = rebuild_vjp(kv, c, dk, dv)
    for s in _ring_steps(n):
        cur = nxt
        if s + 1 < n:
            nxt = _send(cur, n)
        j = (c - s) % n
        cur = _unpack(cur, reverse=True)
        k, v = rebuild(cur, j)
        dq_p, dk_p, dv_p = jax.lax.cond(
            j < c,
            functools.partial(_block_bwd, blocks, earlier=True),
            functools.partial(_block_bwd, blocks, earlier=False),
            q,
            k,
            v,
            out,
            lse,
            dout,
            q_seg,
            _segs(seg, j, w),
        )
        dq = dq + dq_p
        # Block j's share, home to device j = c - s; what arrives is ours from device c + s.
        acc = jax.tree.map(jnp.add, acc, _unpack(_send(_pack(rebuild_vjp(cur, j, dk_p, dv_p)), n, -s)))
    return dq, acc


def _as_is(kv, j):
    return kv


def _as_is_vjp(kv, j, dk, dv):
    return dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring_full(blocks, n, q, k, v, seg):
    return _ring_forward(blocks, n, q, (k, v), seg, _as_is)[0].astype(q.dtype)


def _ring_full_fwd(blocks, n, q, k, v, seg):
    out, lse = _ring_forward(blocks, n, q, (k, v), seg, _as_is)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, out, lse)


def _ring_full_bwd(blocks, n, res, dout):
    q, k, v, seg, out, lse = res
    dq, (dk, dv) = _ring_backward(blocks, n, q, (k, v), seg, out, lse, dout, _as_is, _as_is_vjp)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring_full.defvjp(_ring_full_fwd, _ring_full_bwd)


# ----------------------------------------------------------------------------------- the bottleneck


def _rebuilders(rebuild, weights, positions, width: int):
    """(build(kv, j), build_vjp(kv, j, dk, dv), grads) for the ring: device j's K/V from the bottleneck
    activations it passed, `rebuild(weights, hk, hv, positions) -> (k, v)` (the model's B's and RoPE)
    at its positions, and the vjp of that, which appends the weights' gradient to `grads` (the ring's
    backward runs in one trace, so a list collects them)."""
    grads = []

    def pos(j):
        return jax.lax.dynamic_slice_in_dim(positions, j * width, width, axis=1)

    def build(kv, j):
        return rebuild(weights, kv[0], kv[1], pos(j))

    def build_vjp(kv, j, dk, dv):
        _, vjp = jax.vjp(lambda w, hk, hv: rebuild(w, hk, hv, pos(j)), weights, kv[0], kv[1])
        dw, dhk, dhv = vjp((dk.astype(kv[0].dtype), dv.astype(kv[1].dtype)))
        grads.append(dw)
        return dhk.astype(jnp.float32), dhv.astype(jnp.float32)

    return build, build_vjp, grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring_bottleneck(blocks, n, rebuild, q, hk, hv, weights, positions, seg):
    build, _, _ = _rebuilders(rebuild, weights, positions, q.shape[1])
    return _ring_forward(blocks, n, q, (hk, hv), seg, build)[0].astype(q.dtype)


def _ring_bottleneck_fwd(blocks, n, rebuild, q, hk, hv, weights, positions, seg):
    build, _, _ = _rebuilders(rebuild, weights, positions, q.shape[1])
    out, lse = _ring_forward(blocks, n, q, (hk, hv), seg, build)
    out = out.astype(q.dtype)
    return out, (q, hk, hv, weights, positions, seg, out, lse)


def _ring_bottleneck_bwd(blocks, n, rebuild, res, dout):
    q, hk, hv, weights, positions, seg, out, lse = res
    build, build_vjp, grads = _rebuilders(rebuild, weights, positions, q.shape[1])
    dq, (dhk, dhv) = _ring_backward(blocks, n, q, (hk, hv), seg, out, lse, dout, build, build_vjp)
    # The weights' gradient summed over this device's blocks; the island's transpose sums it over the
    # devices the weights are replicated on (`context`, the batch axes).
    dw = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), grads)
    return dq.astype(q.dtype), dhk.astype(hk.dtype), dhv.astype(hv.dtype), dw, None, None


_ring_bottleneck.defvjp(_ring_bottleneck_fwd, _ring_bottleneck_bwd)


# ------------------------------------------------------------------------------------- all_gather


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _one_block(blocks, q, k, v, offset, q_seg, k_seg):
    return blocks.fwd(q, k, v, offset, q_seg, k_seg)[0].astype(q.dtype)


def _one_block_fwd(blocks, q, k, v, offset, q_seg, k_seg):
    out, lse = blocks.fwd(q, k, v, offset, q_seg, k_seg)
    out = out.astype(q.dtype)
    return out, (q, k, v, offset, q_seg, k_seg, out, lse)


def _one_block_bwd(blocks, res, dout):
    q, k, v, offset, q_seg, k_seg, out, lse = res
    dq, dk, dv = blocks.bwd(q, k, v, out, lse, dout, offset, q_seg, k_seg)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_one_block.defvjp(_one_block_fwd, _one_block_bwd)


def _whole(x, n: int):
    """The whole row of a sequence-split x, gathered over `context`, in natural order."""
    return unlayout(jax.lax.all_gather(x, AXIS, axis=1, tiled=True), n)


def _gathered(blocks, n, q, k, v, seg):
    """K/V gathered over `context` (in natural order); each local chunk attends to the keys before it."""
    return _attend_whole(blocks, n, q, _whole(k, n), _whole(v, n), seg)


def _gathered_bottleneck(blocks, n, rebuild, q, hk, hv, weights, positions, seg):
    """The bottleneck activations gathered over `context`, the whole row's K/V rebuilt from them."""
    k_all, v_all = rebuild(weights, _whole(hk, n), _whole(hv, n), unlayout(positions, n))
    return _attend_whole(blocks, n, q, k_all, v_all, seg)


def _attend_whole(blocks, n, q, k_all, v_all, seg):
    c = jax.lax.axis_index(AXIS)
    w = q.shape[1]
    half = w // 2
    k_seg = None if seg is None else unlayout(seg, n)
    q_seg = _segs(seg, c, w)
    outs = [
        _one_block(blocks, _half(q, i, half), k_all, v_all, chunk * half, _half(q_seg, i, half), k_seg)
        for i, chunk in enumerate((c, 2 * n - 1 - c))
    ]
    return jnp.concatenate(outs, 1)


# ------------------------------------------------------------------------------------- the island


@dataclasses.dataclass(frozen=True)
class Context:
    """The sequence split over `context` on `mesh` under `strategy` (its context_attention and
    context_kv): what the placement hands the model when the mesh has context > 1.

    Attention is the one place tokens meet, run here in a `shard_map` island over the whole mesh
    (`Context.attend`), on the model's block form of its attention implementation
    (boost_jax/model/attention/registry.py `Blockwise`: a query block against a key block with its log-sum-exp):

    - ring (`parallel.context_attention=ring`): each device keeps its queries and passes its K/V block
      around the ring of C devices (K and V in one collective-permute per step, C-1 steps); the partial
      results are merged with an online softmax (out, log-sum-exp). Step 0 is the device's own block, causal in local
      order (chunk c precedes chunk 2C-1-c). At step s the block of device j = c - s arrives: if j < c its
      first chunk lies before both of ours and its second after both (only the first is visited, by both
      our chunks), else only our second chunk sees it, and all of it: the fully masked half of every block
      pair is never computed, and every step costs L x 2L scores on every device. The permute of the next
      block is issued before the current block's attention, so the two can overlap (XLA's async
      collective-permute start/done around the block's fusions on GPU). The backward runs the ring again
      with the merged out / log-sum-exp (FlashAttention-2's backward: the blocks' gradients add up); each
      step's dK/dV of the block it holds goes straight back to the block's device (one permute by -s).
    - all_gather (`parallel.context_attention=all_gather`): K/V gathered over `context` once per layer
      (MaxText's default), each of the two local chunks attending to the keys before it (the
      implementation skips the key blocks above the diagonal); the backward reduce-scatters dK/dV.

    Documents (packed rows, and document rows as segment ids): the full row's segment ids, in layout
    order, are on every device (int32 [B, T], not split over `context`), so a block's key segments are
    read where they are and never sent.

    `parallel.context_kv=bottleneck` (factored kinds under btp/megatron): the ring passes the r-wide
    bottleneck activations σ(A_k x), σ(A_v x) instead of K and V; every device rebuilds each block's K
    and V with its own B_k, B_v (column-parallel: its heads) and RoPE at the block's positions, whose
    gradients (and the r-wide activations') the backward returns: 2r instead of 2 kv_dim elements per
    token per hop, for 2 extra [2L, r] x [r, kv_dim/tensor] GEMMs per step (4 more in the backward)."""

    mesh: Mesh
    strategy: Strategy

    @property
    def size(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def passes_bottleneck(self) -> bool:
        return self.strategy.context_kv == "bottleneck"

    def layout(self, x, axis: int = 1):
        return layout(x, self.size, axis)

    def unlayout(self, x, axis: int = 1):
        return unlayout(x, self.size, axis)

    def _specs(self, q, k):
        q_spec = rules.logical_spec(("act_batch", "act_seq", "act_heads", None), q.shape)
        kv_spec = rules.logical_spec(("act_batch", "act_seq", "act_kv_heads", None), k.shape)
        if q_spec is None or len(q_spec) < 2 or AXIS not in rules.as_tuple(q_spec[1]):
            raise ValueError(
                f"context attention: the queries' sequence is not split over `{AXIS}` by the current "
                f"rules ({q_spec}); trace the model under its strategy's rules"
            )
        return q_spec, kv_spec, P(q_spec[0], None)

    def attend(self, q, k, v, segments, blocks):
        """Causal attention of the laid-out sequence: q [B, T, H, D], k/v [B, T, KV, D], split over
        `context` along T; `segments` (int32 [B, T] in layout order, or None); `blocks` the model's
        Blockwise. -> [B, T, H, D]."""
        q_spec, kv_spec, seg_spec = self._specs(q, k)
        run = _ring_full if self.strategy.context_attention == "ring" else _gathered
        local = functools.partial(run, blocks, self.size)
        if segments is None:
            return jax.shard_map(
                lambda q, k, v: local(q, k, v, None),
                mesh=self.mesh,
                in_specs=(q_spec, kv_spec, kv_spec),
                out_specs=q_spec,
                check_vma=False,
            )(q, k, v)
        return jax.shard_map(
            local, mesh=self.mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec, check_vma=False
        )(q, k, v, segments)

    def attend_bottleneck(self, q, hk, hv, weights, positions, segments, blocks, rebuild):
        """`attend` with K/V given as their bottleneck activations hk, hv [B, T, r] (split over
        `context` along T, whole along r), `weights` (B_k, B_v) in their compute layout [r, kv_dim]
        and `rebuild(weights, hk, hv, positions) -> (k, v)` (per block, on each device's own heads);
        `positions`: int32 [B, T] in layout order (RoPE of every block)."""
        q_spec, _, row_spec = self._specs(q, q)
        h_spec = rules.logical_spec(("act_batch", "act_seq", "act_rank"), hk.shape)
        mesh, strategy = rules.current()
        w_specs = tuple(rules.spec_for(("rank", "kv_heads"), w.shape, mesh, strategy.compute_rules) for w in weights)
        run = _ring_bottleneck if self.strategy.context_attention == "ring" else _gathered_bottleneck
        local = functools.partial(run, blocks, self.size, rebuild)
        specs = (q_spec, h_spec, h_spec, w_specs, row_spec)
        if segments is None:
            return jax.shard_map(
                lambda *a: local(*a, None), mesh=self.mesh, in_specs=specs, out_specs=q_spec, check_vma=False
            )(q, hk, hv, tuple(weights), positions)
        return jax.shard_map(local, mesh=self.mesh, in_specs=specs + (row_spec,), out_specs=q_spec, check_vma=False)(
            q, hk, hv, tuple(weights), positions, segments
        )


# ------------------------------------------------------------------------------------------ traffic


def layer_exchange(c: int, attention: str, rows: float, seq: int, width: float) -> dict:
    """One layer's context exchange per device for one micro-batch of `rows` rows of `seq` positions
    whose K/V (or bottleneck activations) are `width` elements per token per array on this device:
    {"forward" | "backward": {kind: {"count", "elements", "float32"}}}, "float32": how many of the
    `count` equal collectives are sent in float32 (the ring's dK/dV going home; the rest in the compute
    dtype). The one
    formula of the exchange: `traffic` sums it over a step, the planner prices it
    (boost_jax/planner/ops/). Empty when C = 1.

    ring: the forward sends the (K, V) block C-1 times, the backward C-1 times again and their
    gradients (float32) C-1 times, K and V in one collective-permute: C-1 and 2(C-1) collective-permutes
    of 2 x rows x T/C x width elements. all_gather: 2 all-gathers forward, 2 reduce-scatters backward,
    of rows x T x width elements (the gathered size)."""
    if c <= 1:
        return {}
    if attention == "ring":
        block = rows * seq / c * width
        return {
            "forward": {"collective-permute": {"count": c - 1, "elements": 2 * (c - 1) * block, "float32": 0}},
            "backward": {
                "collective-permute": {"count": 2 * (c - 1), "elements": 4 * (c - 1) * block, "float32": c - 1}
            },
        }
    whole = rows * seq * width
    return {
        "forward": {"all-gather": {"count": 2, "elements": 2 * whole, "float32": 0}},
        "backward": {"reduce-scatter": {"count": 2, "elements": 2 * whole, "float32": 0}},
    }


def traffic(cfg) -> dict:
    """The context exchange of one optimizer step per device, by formula, from a run config (remat
    policy none: a policy that recomputes attention runs its forward exchange again):

    {"context": C, "attention": ring | all_gather, "kv": full | bottleneck,
     "width": elements per token per array that moves (kv_heads/tensor x head_dim, or the rank r),
     "per_layer": {"forward" | "backward": {kind: {"count", "elements", "float32"}}} per micro-batch
     (`layer_exchange`'s),
     "step": {kind: {"count", "elements"}}: every layer (of this device's pipeline stage) and
     micro-batch (pipelined: every tick, bubbles included),
     "memory": {"kv_block_bytes": one (K, V) block pair at the compute dtype (the ring holds two),
                "gathered_kv_bytes_per_layer": all_gather's whole-row K/V kept for the backward,
                "activation_fraction": 1/C, the share of the sequence each device holds}}

    Per layer: `layer_exchange`. The weights' gradients are also reduced over
    `context` (like over `data`), not counted here. Empty when C = 1."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    c = int(p.context)
    if c <= 1:
        return {}
    tensor = max(int(p.tensor), 1)
    head_dim = int(m.d_model) // int(m.n_heads)
    kv_heads = int(m.n_kv_heads)
    if "act_kv_heads" in split_by_tensor(get_strategy(p).rules) and kv_heads % tensor == 0:
        kv_heads //= tensor
    bottleneck = p.context_kv == "bottleneck"
    width = int(m.rank) if bottleneck else kv_heads * head_dim
    stages = max(int(p.pipeline), 1)
    micro = int(t.global_batch) // int(t.grad_accum)
    rows = micro // (max(int(p.data), 1) * max(int(p.fsdp), 1))  # this device's rows of a micro-batch
    passes = int(t.grad_accum)
    if stages > 1:  # every tick of the schedule runs the stage on 1/M of the rows, bubbles included
        chunks = int(p.microbatches) or 2 * stages
        repeats = int(p.pipeline_repeats) if p.pipeline_schedule == "circular" else 1
        passes *= ticks(stages, chunks, repeats) / (chunks * repeats)  # x L/(S V) layers per tick
        layers = int(m.n_layers) // stages
    else:
        layers = int(m.n_layers)
    seq = int(t.seq_len)
    per_layer = {
        d: {k: {f: int(round(x)) for f, x in v.items()} for k, v in kinds.items()}
        for d, kinds in layer_exchange(c, str(p.context_attention), rows, seq, width).items()
    }
    step: dict = {}
    for direction in per_layer.values():
        for kind, v in direction.items():
            slot = step.setdefault(kind, {"count": 0, "elements": 0})
            for f in slot:
                slot[f] += v[f] * layers * passes
    step = {k: {f: int(round(x)) for f, x in v.items()} for k, v in step.items()}
    act = 2 if m.dtype in ("bfloat16", "float16", "auto") else 4  # auto: bf16 on accelerators
    pair = 2 * rows * seq // c * width * act
    return {
        "context": c,
        "attention": str(p.context_attention),
        "kv": str(p.context_kv),
        "width": width,
        "per_layer": per_layer,
        "step": step,
        "memory": {
            "kv_block_bytes": pair if p.context_attention == "ring" else 0,
            "gathered_kv_bytes_per_layer": 0 if p.context_attention == "ring" else pair * c,
            "activation_fraction": 1 / c,
        },
    }
