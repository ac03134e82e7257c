"""Applying projections: every projection is a linear kind (`model/kinds/`: dense W, low-rank B·A,
CoLA B·σ(A·x), tensor-train, sparse + low-rank), seen here only through the kind interface.

Every projection has two stages so that parallel strategies and kernels can act on the bottleneck:
the first ([d_in, width]) and the second ([width, d_out], nothing for dense). Projections that read
the same input run their first stages as ONE GEMM over stacked weights, and their second stages as
one batched dot_general (BOOST's linear layer grouping); parameters keep their own names. The r-wide
first-stage output is tagged `lowrank` for activation checkpointing (before σ).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from boost_jax.kernels.gated_gemm import act_matmuls
from boost_jax.kernels.norm_gemm import add_norm_matmul
from boost_jax.kernels.rmsnorm import add_rmsnorm
from boost_jax.kernels.rmsnorm import rmsnorm as rmsnorm_rows
from boost_jax.model.kinds import kind_class
from boost_jax.model.kinds.base import LinearKind
from boost_jax.parallel.placement import GROUPED, Norm
from boost_jax.parallel.rules import constrain, current, gathered, regathered, weight_einsum

RANK_ACT = ("act_batch", "act_seq", None, "act_rank")  # [B, T, group, r]
WHOLE_ROWS = ("act_batch", "act_seq", None)
RESIDUAL = ("act_batch", "act_res_seq", "act_embed")
GEMM_ROWS = ("act_batch", "act_seq", "act_embed")  # a GEMM's input rows: the residual as its GEMMs read it


def Projection(
    m, d_in: int, d_out: int, *, axes: tuple[str, str], group: str, rngs: nnx.Rngs, param_dtype=jnp.float32
) -> LinearKind:
    """A projection of the kind `m.linear` names (`m`: the model config section)."""
    return kind_class(m.linear)(m, d_in, d_out, axes=axes, group=group, rngs=rngs, param_dtype=param_dtype)


class RMSNorm(nnx.Module):
    """RMSNorm (statistics in float32). `impl="pallas"`/`"triton"` run the fused kernel, which also
    yields the per-row sum of squares that online RMSNorm sends with the A partial products; `run`
    (from the placement) says how the kernel runs on the mesh."""

    def __init__(
        self, dim: int, *, eps: float, param_dtype=jnp.float32, axis: str = "norm", impl: str = "xla", run=Norm()
    ):
        self.eps = eps
        self.impl = impl
        self.run = run
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=(axis,))

    def rows(self, x: jax.Array, scale: jax.Array, impl: str | None = None) -> jax.Array:
        """The normalised rows of an unsharded (or local) x."""
        return rmsnorm_rows(x, scale, self.eps, impl=impl or self.impl)[0]

    def __call__(self, x: jax.Array, names=RESIDUAL) -> jax.Array:
        return self.run(self.rows, x, self.scale[...], names)

    def added_rows(self, x, residual, scale, impl: str | None = None):
        """(the normalised rows of x + residual, x + residual) of an unsharded (or local) x."""
        return add_rmsnorm(x, residual, scale, self.eps, impl=impl or self.impl)

    def add(self, x: jax.Array, residual: jax.Array, names=RESIDUAL) -> tuple[jax.Array, jax.Array]:
        """(RMSNorm(x + residual), x + residual): the residual add fused with this norm (one Triton
        kernel each way under `impl="triton"`, kernels/rmsnorm.py `add_rmsnorm`)."""
        return self.run.add(self.added_rows, x, residual, self.scale[...], names)


FIRST = "first"  # model.group_linears: only the first stages grouped


def grouping(value) -> bool | str:
    """`model.group_linears` as `project` takes it: True, False or FIRST."""
    return FIRST if value == FIRST else bool(value)


def _runs(projs, shape):
    """Consecutive projections whose `shape(p)` agree: each run is one grouped GEMM."""
    i = 0
    for _, run in itertools.groupby(projs, key=shape):
        run = list(run)
        yield i, run
        i += len(run)


def _bottleneck(projs, h, tag: bool = True, act: bool = True):
    """σ on the fully reduced [B, T, g, r] first-stage output (`act` False: left to the second stage's
    kernel). The reduced tensor (before σ) is what low-rank checkpointing saves: recomputing from it
    needs no collective."""
    h = constrain(h, RANK_ACT)
    if tag:
        h = checkpoint_name(h, "lowrank")
    return projs[0].bottleneck(h) if act else h


def rope_in_gemm(projs, grouped, route=GROUPED) -> bool:
    """Whether `project` would run these projections' second stages as σ kernels that can rotate
    their outputs by RoPE too (`project`'s `rope`; model.bottleneck_kernel=rope)."""
    return projs[0].factored and projs[0].rope_in_gemm and _act_in_gemm(projs, route, grouped, ())


def act_kernels_run(act_in_gemm: bool, grouped, fuses_norm: bool, devices: int) -> bool:
    """Whether a group's σ is read into its second-stage GEMMs (kernels/gated_gemm.py `act_matmuls`):
    the kind asks for it (`act_in_gemm`), each B is its own GEMM, the norm does not ride in the first
    stage's all-reduce, and the program runs on one device (the kernels are not partitioned; a mesh
    runs σ and the GEMMs on XLA). The planner's memory terms read it too."""
    return act_in_gemm and grouped is not True and not fuses_norm and devices == 1


def _act_in_gemm(run, route, grouped, keep) -> bool:
    """`act_kernels_run` for this run on the current mesh, where none of it is kept for the caller."""
    ctx = current()
    return act_kernels_run(
        run[0].act_in_gemm, grouped, route.fuses_norm, 1 if ctx is None else ctx[0].size
    ) and not any(p is k for p in run for k in keep)


def add_norm_first(projs, pair, norm, grouped, route=GROUPED):
    """(first, y, stream) of the stream's residual add and `norm` (`pair` = (x, residual)) before these
    projections: where their first stages are one GEMM whose outputs the σ kernels read
    (`_act_in_gemm`) and the kinds ask for it (model.bottleneck_kernel=norm), the add and the norm run
    inside that GEMM (kernels/norm_gemm.py, in place of the fused Triton add + norm) and `first` is its
    output [B, T, g, width] for `project`'s `first` (y None); else `norm.add` runs and y is the
    normalised rows (first None)."""
    p = projs[0]
    folds = (
        p.factored
        and getattr(p, "norm_in_gemm", False)
        and norm.impl == "triton"  # it replaces the fused Triton add + norm
        and grouped
        and not route.fuses_norm
        and not route.replaces_projection
        and not any(q.has_extra for q in projs)
        and len({q.first_shape for q in projs}) == 1
        and _act_in_gemm(projs, route, grouped, ())
    )
    if not folds:
        y, stream = norm.add(*pair)
        return None, y, stream
    x, residual = pair
    w = _stacked(projs, "first", x.dtype)  # [g, d_in, width]: the stack made once per step, if one was
    w = jnp.moveaxis(w, 0, 1).reshape(w.shape[1], -1)  # [d_in, g·width]: the members' columns side by side
    z, stream = add_norm_matmul(x, residual, norm.scale[...], w, norm.eps, norm_impl=norm.impl)
    return z.reshape(*z.shape[:-1], len(projs), -1), None, constrain(stream, RESIDUAL)


def _use(dtype):
    """The `use` hook for stage weights feeding a GEMM in `dtype`: gathered (FSDP) in that dtype."""
    return lambda w, names: gathered(w, names, dtype)


_MADE: contextvars.ContextVar = contextvars.ContextVar("made_stacks", default=None)  # {(member ids, stage): stack}


def _weight(p, stage: str, dtype):
    return p.first_weight(_use(dtype)) if stage == "first" else p.second_weight(_use(dtype))


def _stacked(run, stage: str, dtype):
    """The run's `stage` ("first" or "second") weights stacked [g, ...] in `dtype`: the stack made once
    per step where one was handed in (`using_stacks`), else stacked here."""
    made = _MADE.get()
    got = None if made is None else made.get((tuple(id(p) for p in run), stage))
    if got is not None and got.dtype == dtype:
        return jnp.moveaxis(got, 1, 0) if stage == "first" else got  # made [d_in, g, width]: `make_stacks`
    return jnp.stack([_weight(p, stage, dtype) for p in run])


def stacked_runs(projs, grouped, route, keep=()):
    """[(run, stage)]: the stacked weights [g, ...] that `project` runs this group on (g may be 1)."""
    if route.replaces_projection:
        return []
    kept = lambda p: any(p is k for k in keep)  # noqa: E731
    out = []
    firsts = (
        _runs(projs, lambda p: p.first_shape)
        if grouped or route.fuses_norm
        else ((i, [p]) for i, p in enumerate(projs))
    )
    for _, run in firsts:
        out.append((run, "first"))
        if not run[0].factored or _act_in_gemm(run, route, grouped, keep):
            continue
        subs = (
            _runs(run, lambda p: (p.second_shape, kept(p)))
            if grouped is True
            else ((i, [p]) for i, p in enumerate(run))
        )
        out.extend((sub, "second") for _, sub in subs if not kept(sub[0]))
    return out


def _group_runs(module):
    """[(name, run, stage)] for every stack `project` makes in `module`'s groups (modules that name
    their groups: `projection_groups`), each named by its members' paths in `module`."""
    paths = {id(node): "/".join(map(str, path)) for path, node in nnx.iter_graph(module)}
    out = []
    for _, node in nnx.iter_graph(module):
        for group in node.projection_groups() if hasattr(node, "projection_groups") else ():
            for run, stage in stacked_runs(*group):
                out.append((stage + ":" + ",".join(paths[id(p)] for p in run), run, stage))
    return out


def make_stacks(module, dtype) -> dict:
    """{name: stack}: the stacked weights `module`'s projections run on (`project`'s grouped GEMMs), in
    `dtype`, for the runs whose weights already come in `dtype` (cast once per step): made once, outside
    the micro-batches, and handed back to `using_stacks`."""
    out = {}
    for name, run, stage in _group_runs(module):
        weights = [_weight(p, stage, None) for p in run]
        if all(w.dtype == dtype for w in weights):  # the first stages [d_in, g, width]: the layout of
            # the GEMM reading them (d_in contracted, g x width its columns), so none is transposed per use
            out[name] = jnp.stack(weights, axis=1 if stage == "first" else 0)
    return out


@contextlib.contextmanager
def using_stacks(module, made):
    """`project` takes the stacks `made` (`make_stacks` of this module's weights) in place of stacking."""
    if not made:
        yield
        return
    runs = {name: (tuple(id(p) for p in run), stage) for name, run, stage in _group_runs(module)}
    token = _MADE.set({runs[name]: stack for name, stack in made.items()})
    try:
        yield
    finally:
        _MADE.reset(token)


def _first_stage(projs, x, grouped: bool, norm, route, first=None, keep=()):
    """[(run, [B, T, g, width])] for the first stages of `projs` reading x (after `norm`, if given), or
    from `first`, their output computed elsewhere (a kernel with the first stage inside); before σ
    where the second stages' kernels apply it (`_act_in_gemm`)."""
    if first is not None:
        act = not _act_in_gemm(projs, route, grouped, keep)
        return [(projs, _bottleneck(projs, first, act=act) if projs[0].factored else first)]
    if norm is not None and route.fuses_norm:
        # The norm's statistics travel in the same all-reduce as the A partial products (BTP).
        a = _stacked(projs, "first", x.dtype)
        h = route.norm_first_stage(x, norm.scale[...], a, eps=norm.eps, impl=norm.impl)
        return [(projs, _bottleneck(projs, h, tag=False))]  # tagged inside, before the division
    if norm is not None:
        x = norm(x)
    out = []
    runs = _runs(projs, lambda p: p.first_shape) if grouped else ((i, [p]) for i, p in enumerate(projs))
    if projs[0].in_axis == "embed":  # the residual, read whole along the sequence (Megatron-SP's gather)
        x = regathered(x, GEMM_ROWS, RESIDUAL)
    for _, run in runs:
        w = _stacked(run, "first", x.dtype)  # [g, d_in, width]
        h = weight_einsum("btd,gdr->btgr", x, w)
        out.append(
            (run, _bottleneck(run, h, act=not _act_in_gemm(run, route, grouped, keep)) if run[0].factored else h)
        )
    return out


def project(projs, x, *, grouped: bool | str = True, norm=None, route=GROUPED, keep=(), first=None, rope=None) -> list:
    """Apply projections that share input x (optionally normalised by `norm` first): one GEMM per
    run of equal first-stage shapes, one batched dot_general per run of equal B shapes. `grouped=FIRST`
    groups the first stages only: each B is its own GEMM, so no output is sliced out of a batched one,
    while the backward's input gradient is still one GEMM over the stacked first stages, not a sum of
    one per projection; False runs every projection alone. `route`
    (the placement's choice for the group, boost_jax/parallel/placement.py) may fuse the norm with
    the first stage or run each projection its own way. `keep`: factored projections (of kinds
    without an extra term) whose second stage is left to the caller: for them the pair (σ(A x)
    [B, T, width], the second-stage weight [width, d_out] in its compute layout) comes back instead
    of the output. `first`: the group's first-stage output [B, T, g, width], computed elsewhere (x is
    then not read; kinds with an extra term need x). `rope` = (table [B, T, head_dim], projections):
    those outputs rotated by RoPE inside their σ kernels (only where `rope_in_gemm` says so)."""
    if route.replaces_projection:
        x = norm(x) if norm is not None else x
        return _with_extra(projs, [route.project(p, x) for p in projs], x, None)
    outs = []
    for run, h in _first_stage(projs, x, grouped, norm, route, first, keep):
        if not run[0].factored:
            outs.extend(h[:, :, i] for i in range(len(run)))
            continue
        if _act_in_gemm(run, route, grouped, keep):  # h before σ: σ read into each B's GEMM
            flags = tuple(rope is not None and any(p is q for q in rope[1]) for p in run)
            spin = (rope[0], flags) if any(flags) else None
            outs.extend(act_matmuls(h, [p.second_weight(_use(h.dtype)) for p in run], run[0].act, rope=spin))
            continue
        kept = lambda p: any(p is k for k in keep)  # noqa: E731
        by_shape = grouped is True
        sub = _runs(run, lambda p: (p.second_shape, kept(p))) if by_shape else ((i, [p]) for i, p in enumerate(run))
        for i, group in sub:
            if kept(group[0]):
                outs.extend((h[:, :, i + j], p.second_weight(_use(h.dtype))) for j, p in enumerate(group))
                continue
            b = _stacked(group, "second", h.dtype)  # [g, r, d_out]
            y = weight_einsum("btgr,gro->gbto", h[:, :, i : i + len(group)], b)  # g leading: each output
            outs.extend(y[j] for j in range(len(group)))  # a contiguous block, as the batched GEMM writes it
    return _with_extra(projs, outs, x, norm)


def _with_extra(projs, outs, x, norm):
    """Add the kinds' extra terms (e.g. a sparse S·x), computed from the normalised input in whole
    rows: a strategy that splits the input features gathers it once for the group."""
    if not any(p.has_extra for p in projs):
        return outs
    rows = constrain(x, WHOLE_ROWS)
    if norm is not None:  # normalised locally on the gathered rows, with the (small) scale gathered
        scale = gathered(norm.scale[...], (None,))
        rows = constrain(rmsnorm_rows(rows, scale, norm.eps, impl="xla")[0], WHOLE_ROWS)
    return [y + p.extra(rows).astype(y.dtype) if p.has_extra else y for p, y in zip(projs, outs)]
