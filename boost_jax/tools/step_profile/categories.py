"""The categories of a step's kernels (tools/step_profile/): by what runs (GEMM, attention,
collectives), by the project source a kernel came from (norm, loss, optimizer), else by whether it
only moves data (copies/layout) or computes (elementwise)."""

from __future__ import annotations

import re

CATEGORIES = ("gemm", "attention", "norm", "elementwise", "copies/layout", "optimizer", "loss", "collectives", "launch")
# Opcodes that only move data (inside a fusion: a fusion of these alone is a copy or a layout change).
MOVES = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "copy",
    "transpose",
    "reshape",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "broadcast",
    "iota",
    "gather",
    "scatter",
    "reverse",
}


def categorize(k) -> str:
    """The category of a kernel (a Kernel, or a dict with its fields): GEMM, attention and collectives
    by what runs; norm, loss and optimizer by the project source the kernel came from; data movement
    alone is copies/layout; any other fusion elementwise; a loop's predicate read-back is launch."""
    get = (
        (lambda key, default="": getattr(k, key, default))
        if not isinstance(k, dict)
        else (lambda key, default="": k.get(key, default))
    )
    kind, backend, source = get("kind"), get("backend") or "", get("source") or ""
    sources = tuple(get("sources", ()) or ())
    opcode, op_name = get("opcode"), get("op_name") or ""
    fused = set(get("fused", ()) or ())
    where = " ".join((source, *sources))
    name = backend.lower()
    if kind == "sync":
        return "launch"
    if kind == "collective":
        return "collectives"
    if kind == "attention" or any(w in name for w in ("attention", "flash", "mha")):
        return "attention"
    if kind == "gemm":
        fn = source.split(":")[1] if source.count(":") >= 2 else ""
        if source.startswith("boost_jax/model/attention/") and fn in (
            "xla_attention",
            "_block_scores",
            "_chunked_fwd",
            "_chunked_bwd",
            "attend",
        ):
            return "attention"
        return "gemm"
    if kind == "custom" and "norm" in name:
        return "norm"
    if any(f"boost_jax/kernels/{m}.py" in source for m in ("rmsnorm", "norm_gemm")) or re.search(
        r":(\w*\.)?(RMSNorm|Norm)\.", source
    ):  # norm_gemm: its add + norm kernels (its GEMMs are GEMMs, above)
        return "norm"
    if source.startswith("boost_jax/model/loss.py"):
        return "loss"
    if _optimizer(source) or (
        not source and op_name and "jvp(" not in op_name and get("computation") and "train_step" in op_name
    ):
        return "optimizer"
    if opcode in (
        "copy",
        "copy-start",
        "transpose",
        "dynamic-slice",
        "dynamic-update-slice",
        "slice",
        "concatenate",
        "pad",
        "reshape",
        "broadcast",
        "gather",
        "scatter",
        "reverse",
    ):
        return "copies/layout"
    if opcode == "fusion" and fused and fused <= MOVES:
        return "copies/layout"
    if backend == "__custom_fusion":  # XLA's dynamic-slice fusions: address arithmetic around a copy
        return "copies/layout"
    if source.startswith("boost_jax/model/attention/") and any(
        f in where for f in (":xla_attention", ":_chunked", ":_block_scores", ":cudnn_attention")
    ):
        return "attention"
    return "elementwise"


def _optimizer(source: str) -> bool:
    """The optimizer's update: runtime/step.py `optimizer_update` (the gradient norm, the optax update,
    the finite check and the kept state) or optax itself."""
    if "optax/" in source:
        return True
    if not source.startswith("boost_jax/runtime/step.py"):
        return False
    return source.split(":")[1].startswith("optimizer_update")
