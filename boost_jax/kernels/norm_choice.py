"""Which RMSNorm runs for a placement, and why: the one place the choice is made.

    choice = choose_norm("auto", "auto", gpu=True, triton=True, mesh=True, tensor=2, online_norm=True,
                         factored=True)
    choice.kernel, choice.per_shard, choice.online, choice.fused_add, choice.reason

The choice depends on the config fields `kernels.rmsnorm` and `kernels.residual_norm`, the platform
(a GPU, jax-triton installed) and the placement (a mesh, its tensor and pipeline axes, the strategy's
online norm and spatial-temporal groups, whether the linear kind is factored). model/autos.py reads
its `kernel` to resolve `kernels.rmsnorm=auto`, parallel/placement.py its `per_shard` and `online`,
model/transformer.py its `fused_add`. Two fallbacks stay where they happen, at trace time, and are
loud: a kernel that does not compile runs XLA's norm (kernels/rmsnorm.py `kernels_used`), and a
per-shard norm whose rows are split along d runs XLA's (parallel/placement.py `PerShardNorm`).
"""

from __future__ import annotations

import dataclasses

NORM_GROUPS = ("qkv", "mlp_in")  # the projection groups a norm feeds (their first stages read it)


@dataclasses.dataclass(frozen=True)
class NormChoice:
    kernel: str  # "triton" | "pallas" | "xla": what the norms call (kernels/rmsnorm.py)
    per_shard: bool  # a Pallas/Triton call on a mesh: once per shard inside shard_map (GSPMD cannot split it)
    online: bool  # BTP's online RMSNorm: the norm's statistics ride in its group's A all-reduce
    fused_add: bool  # the residual adds run inside the norms that read them (the fused Triton add+norm)
    reason: str  # one line: the facts that decided each part

    @property
    def name(self) -> str:
        """'fused triton add+norm', 'online rmsnorm, final norm pallas', 'per-shard pallas', 'pallas', 'xla', ..."""
        if self.fused_add:
            return f"fused {self.kernel} add+norm" + (" per shard" if self.per_shard else "")
        if self.online:
            return f"online rmsnorm, final norm {self.kernel}"  # the online groups call no norm kernel
        return f"per-shard {self.kernel}" if self.per_shard else self.kernel


def _kernel(given: str, gpu: bool, triton: bool) -> tuple[str, str]:
    if given != "auto":
        return given, f"kernels.rmsnorm={given}"
    if not gpu:
        return "xla", "kernels.rmsnorm=auto off a GPU: xla"
    if triton:
        return "triton", "kernels.rmsnorm=auto on a GPU with jax-triton: triton"
    return "pallas", "kernels.rmsnorm=auto on a GPU without jax-triton: pallas"


def choose_norm(
    kernel: str = "auto",
    residual: str = "auto",
    *,
    gpu: bool = False,
    triton: bool = False,
    mesh: bool = False,
    tensor: int = 1,
    pipeline: bool = False,
    online_norm: bool = False,
    factored: bool = False,
    st_groups=(),
) -> NormChoice:
    """The norm that runs: `kernel` (kernels.rmsnorm) and `residual` (kernels.residual_norm) as given
    or `auto`; `gpu`/`triton`: the target platform; `mesh`: the model is placed on a mesh with
    `tensor` devices on its tensor axis, a pipeline running its layer stack (`pipeline`), under a
    strategy with `online_norm` and spatial-temporal groups `st_groups`; `factored`: the linear kind
    factors its projections."""
    kernel, why = _kernel(kernel, gpu, triton)
    reasons = [why]
    per_shard = mesh and kernel != "xla"
    if per_shard:
        reasons.append(f"a {kernel} call on a mesh runs per shard")
    online = mesh and online_norm and tensor > 1 and factored
    if online:
        reasons.append(f"online norm with tensor {tensor} and a factored kind")
    online_groups = [g for g in NORM_GROUPS if g not in set(st_groups)] if online else []
    if residual == "separate" or (residual == "auto" and kernel != "triton"):
        fused, why = False, f"kernels.residual_norm={residual}" + ("" if residual == "separate" else f" with {kernel}")
    elif mesh and pipeline:
        fused, why = False, "a pipeline runs the stack (its stages pass one array): separate adds"
    elif online_groups:
        fused, why = False, f"the {'/'.join(online_groups)} norm rides in the A all-reduce: separate adds"
    else:
        fused, why = True, f"kernels.residual_norm={residual}" + (" with triton" if residual == "auto" else "")
    reasons.append(("fused add: " if fused else "") + why)
    return NormChoice(kernel, per_shard, online, fused, "; ".join(reasons))
