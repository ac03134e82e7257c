"""`pallas`: the Pallas flash-attention kernel of `jax.experimental.pallas.ops.gpu.attention`
(Triton-lowered; the interpreter on CPU), its backward run through the module's private
`_mha_backward` so that remat can keep the log-sum-exp, or its public `mha` where that changed."""

from __future__ import annotations

import functools
import inspect
import math
import warnings

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.errors import ConfigError
from boost_jax.kernels import platform
from boost_jax.model.attention.chunked import pad_to
from boost_jax.model.attention.documents import Documents
from boost_jax.model.attention.registry import implementation


def _pallas_mha_module():
    # Triton-lowered flash attention. JAX deprecates these ops after 0.11 (for tokamax) and the
    # Pallas Triton backend in 0.11 itself: when the module is gone, say so and name the others.
    try:
        from jax.experimental.pallas.ops.gpu import attention as mod
    except ImportError as e:
        raise ConfigError(
            f"config field `model.attention`: pallas needs jax.experimental.pallas.ops.gpu.attention, "
            f"which jax {jax.__version__} does not have ({e}); use cudnn, chunked or xla"
        ) from e
    return mod


# The module's private backward, called with the residuals our forward tags for remat. Used only
# when its signature is this one (jax 0.6 to 0.10 at least); otherwise the module's public `mha`
# (its own custom_vjp) runs, with a warning: the same kernels, only `attn_lse` is not kept for remat.
_MHA_BACKWARD_PARAMS = (
    "sm_scale",
    "causal",
    "block_sizes",
    "backward_pass_impl",
    "num_warps",
    "num_stages",
    "grid",
    "interpret",
    "debug",
    "return_residuals",
    "res",
    "do",
)


def _private_backward_ok(mod) -> bool:
    try:
        return tuple(inspect.signature(mod._mha_backward).parameters) == _MHA_BACKWARD_PARAMS
    except (AttributeError, TypeError, ValueError):
        return False


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _pallas(q, k, v, segment_ids, block, interpret):
    return _pallas_fwd(q, k, v, segment_ids, block, interpret)[0]


def _pallas_blocks(block):
    mod = _pallas_mha_module()
    return mod.BlockSizes(
        block_q=block, block_k=block, block_q_dkv=block, block_kv_dkv=block, block_q_dq=block, block_kv_dq=block
    )


def _pallas_fwd(q, k, v, segment_ids, block, interpret):
    mod = _pallas_mha_module()
    out, lse = mod.mha(
        q,
        k,
        v,
        segment_ids,
        sm_scale=q.shape[-1] ** -0.5,
        causal=True,
        block_sizes=_pallas_blocks(block),
        interpret=interpret,
        return_residuals=True,
    )
    out, lse = checkpoint_name(out, "attn_out"), checkpoint_name(lse, "attn_lse")
    return out, (q, k, v, segment_ids, out, lse)


def _pallas_bwd(block, interpret, res, dout):
    mod = _pallas_mha_module()
    # The module's own backward kernels (dq and dk/dv), fed the residuals saved above.
    dq, dk, dv, _ = mod._mha_backward(
        res[0].shape[-1] ** -0.5,
        True,
        _pallas_blocks(block),
        "triton",
        None,
        2,
        None,
        interpret,
        False,
        False,
        res,
        dout,
    )
    return dq, dk, dv, None  # segment ids are integers


_pallas.defvjp(_pallas_fwd, _pallas_bwd)


@implementation("pallas", cost="flash", fused=True, documents=("segments", "lengths"))
def pallas_attention(
    q, k, v, offset, block: int | None = None, interpret: bool | None = None, *, docs: Documents | None = None
):
    """Training shapes only (offset 0, S == T); lengths are zero-padded to a power-of-two block
    (padded keys lie after every real query, so causality hides them), and so are the documents'
    segment ids, the kernel's `segment_ids`."""
    b, t, h, dh = q.shape
    if k.shape[1] != t:
        raise ValueError(f"pallas attention needs as many keys as queries, got {t} and {k.shape[1]}")
    block = block or min(64, 1 << max(4, math.ceil(math.log2(t))))
    if interpret is None:
        interpret = platform.name() == "cpu"
    g = h // k.shape[2]
    tp = -(-t // block) * block
    qp, kp, vp = (pad_to(x, 1, tp) for x in (q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)))
    segment_ids = None if docs is None else pad_to(docs.segments, 1, tp)
    mod = _pallas_mha_module()
    if not _private_backward_ok(mod):
        warnings.warn(
            f"pallas attention: jax {jax.__version__} changed the private _mha_backward of "
            "jax.experimental.pallas.ops.gpu.attention; running its public mha (same kernels; "
            "remat cannot keep attn_lse)",
            stacklevel=2,
        )
        out = mod.mha(
            qp,
            kp,
            vp,
            segment_ids,
            sm_scale=dh**-0.5,
            causal=True,
            block_sizes=_pallas_blocks(block),
            interpret=bool(interpret),
        )
        return checkpoint_name(out, "attn_out")[:, :t]
    return _pallas(qp, kp, vp, segment_ids, block, bool(interpret))[:, :t]
