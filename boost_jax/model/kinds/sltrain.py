"""Sparse + low-rank (SLTrain): W x = (α/r)·B(A x) + S x, S on a fixed random support.

The low-rank part is an ordinary bottleneck (A row-parallel, B column-parallel under BTP). S has a
fixed support drawn uniformly at random at initialisation (from the params seed, so it differs per
layer and projection) and learned values. The support is stored in the model state as integer
arrays (`Support` variables): saved with every checkpoint, never differentiated or updated.
The block-sparse layout and how parallel plans run S·x: `SparseLowRank`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.config import Field
from boost_jax.model.kinds.lowrank import LowRank
from boost_jax.parallel.rules import constrain, gathered, weight_einsum


class Support(nnx.Variable):
    """A fixed integer index array: part of the state and of checkpoints, not trainable."""


def n_blocks(m, d_in: int, d_out: int) -> int:
    b = int(m.sparse_block)
    return max(1, round(float(m.sparse_density) * (d_in // b) * (d_out // b)))


class SparseLowRank(LowRank):
    """Layout: S is block-sparse. Its support is a uniform random set of b x b blocks (b =
    `model.sparse_block`; b = 1 is SLTrain's element-wise support), holding `model.sparse_density` of
    the d_in x d_out entries. S·x gathers the input blocks each nonzero block reads ([B, T, n_blocks, b]),
    runs one batched GEMM against the block values and scatter-adds the products into their output
    blocks. No dense d_in x d_out matrix is ever formed; the gathered input holds nnz/b values per token
    (b = 1: nnz, which is why larger blocks are the default for big models), and the products are GEMMs
    a GPU runs on tensor cores.

    Parallel plans: S·x needs the whole normalised input row, so a strategy that splits the input
    features (BTP's residual split along d, Megatron's row-parallel o/down inputs) all-gathers the input
    once per projection group; every tensor device computes the whole S·x (replicated over `tensor`, the
    block values FSDP-sharded and gathered at use like any weight) and keeps its own output columns.
    """

    family = "sltrain"
    has_extra = True
    hf = None  # no Hugging Face layout holds S
    fields = {  # W = (alpha/r)·B·A + S, S on a fixed random support of b x b blocks
        "sparse_density": Field(0.03, "sltrain: fraction of S's entries that are nonzero"),
        "sparse_block": Field(
            16, "sltrain: b, S's blocks are b x b; 1 is SLTrain's element-wise support (see kinds/sltrain.py)"
        ),
        "sltrain_alpha": Field(32.0, "sltrain: the alpha of (alpha/r)·B·A"),
    }

    def __init__(self, m, d_in, d_out, *, axes, group, rngs, param_dtype):
        super().__init__(m, d_in, d_out, axes=axes, group=group, rngs=rngs, param_dtype=param_dtype)
        r, b = self.width, int(m.sparse_block)
        self.block = b
        self.alpha_over_r = float(m.sltrain_alpha) / r
        # SLTrain's init: A ~ U(±1/sqrt(d_in)) (Kaiming-uniform), B = 0, S values ~ U(±1/sqrt(d_in)).
        bound = d_in**-0.5
        self.a = nnx.Param(
            jax.random.uniform(rngs.params(), (d_in, r), param_dtype, -bound, bound),
            axes=(axes[0], "rank"),
            compute_only=True,
        )
        self.b = nnx.Param(jnp.zeros((r, d_out), param_dtype), axes=("rank", axes[1]), compute_only=True)
        n_in, n_out, nb = d_in // b, d_out // b, n_blocks(m, d_in, d_out)
        flat = jnp.sort(jax.random.choice(rngs.params(), n_in * n_out, (nb,), replace=False)).astype(jnp.int32)
        self.s_in = Support(flat // n_out, axes=("sparse_blocks",))
        self.s_out = Support(flat % n_out, axes=("sparse_blocks",))
        self.s = nnx.Param(
            jax.random.uniform(rngs.params(), (nb, b, b), param_dtype, -bound, bound),
            axes=("sparse_blocks", None, None),
            compute_only=True,
        )

    @classmethod
    def n_params(cls, m, d_in, d_out):
        return int(m.rank) * (d_in + d_out) + n_blocks(m, d_in, d_out) * int(m.sparse_block) ** 2

    @classmethod
    def flops(cls, m, d_in, d_out):
        return super().flops(m, d_in, d_out) + 2 * n_blocks(m, d_in, d_out) * int(m.sparse_block) ** 2

    @classmethod
    def validate(cls, m, widths):
        if not 0.0 < float(m.sparse_density) < 1.0:
            return f"model.sparse_density: {m.sparse_density} must be in (0, 1), e.g. 0.03 (SLTrain)"
        b = int(m.sparse_block)
        bad = {f: w for f, w in widths.items() if b < 1 or w % b}
        if bad:
            return (
                f"model.sparse_block: {b} must be >= 1 and divide every projection width "
                f"({', '.join(f'{f}={w}' for f, w in bad.items())}); 1 always does"
            )
        return super().validate(m, widths)

    def bottleneck(self, h):
        return h * self.alpha_over_r

    def extra(self, x):
        lead, b = x.shape[:-1], self.block
        values = gathered(self.s[...], ("sparse_blocks", None, None), x.dtype)
        rows = gathered(self.s_in[...], ("sparse_blocks",))
        cols = gathered(self.s_out[...], ("sparse_blocks",))
        whole = ("act_batch", "act_seq", None, None)  # every tensor device computes all of S·x
        blocks = x.reshape(*lead, self.d_in // b, b)
        picked = constrain(jnp.take(blocks, rows, axis=-2), whole)  # [B, T, nb, b]: each block's input
        products = weight_einsum("btnk,nko->btno", picked, values)
        out = jnp.zeros((*lead, self.d_out // b, b), products.dtype).at[..., cols, :].add(products)
        return constrain(out, whole).reshape(*lead, self.d_out)
