"""The interface every linear kind implements.

A projection maps d_in -> d_out in two stages so that strategies and kernels can act on the
bottleneck: the first stage is a [d_in, width] matrix (`first_weight`), then σ (`bottleneck`), then a
[width, d_out] matrix (`second_weight`). A dense kind has only the first stage (width = d_out).
Each stored parameter names its logical axes; `first_weight`/`second_weight` take `use`, the function
that turns a stored parameter into its compute layout (FSDP gathers it, in the dtype of the GEMM
it feeds; the spatial-temporal partition takes it as stored and skews it), and build the matrix from what `use`
returns. A kind may add a term
computed from the normalised input rows (`extra`, e.g. a sparse matrix), which parallel plans handle
generically (the input is gathered to whole rows).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import jax
from flax import nnx

from boost_jax.parallel.rules import gathered

Use = Callable[[jax.Array, tuple], jax.Array]


def factor_init(key, shape, d_in: int, d_out: int, rank: int, dtype):
    # CoLA init: each factor N(0,1)·r^-1/4·(d_in+d_out)^-1/4, so B·A has entry variance 1/(d_in+d_out).
    std = rank**-0.25 * (d_in + d_out) ** -0.25
    return std * jax.random.normal(key, shape, dtype)


def dense_init(key, shape, d_in: int, d_out: int, dtype):
    # Same per-entry variance as the factorised product, so dense and low-rank start alike.
    return (d_in + d_out) ** -0.5 * jax.random.normal(key, shape, dtype)


@dataclasses.dataclass(frozen=True)
class HFLayout:
    """How a model of one kind is stored as a Hugging Face checkpoint: what `boost_jax/export.py`
    asks the kind (it names none). This base is the `LlamaForCausalLM` layout's frame, whose config.json
    fields export writes for every layout; a kind's layout adds what its projections need.

    model_type, architecture: what config.json says (import picks the layout by model_type, then the
      kind among those sharing it by `select`);
    tensors: per projection `X_proj`, (our parameter, HF name after `X_proj.`, stored transposed);
    kv_repeat: the HF name (after `X_proj.`) of the k/v tensor whose columns the file holds for every
      query head (a layout without GQA): export repeats each KV head's columns, import folds them;
      "" when the file keeps our KV heads;
    select: (config.json field, value) that tells this kind from others of its model_type ("", None: none);
    train: (train field, value) pairs an import sets (the layout's own recipe, e.g. AdamW betas)."""

    model_type: str
    architecture: str
    tensors: tuple[tuple[str, str, bool], ...]
    kv_repeat: str = ""
    select: tuple[str, object] = ("", None)
    train: tuple[tuple[str, object], ...] = ()

    def selected(self, hf: dict):
        """The value of `select`'s field in config.json as this layout reads it."""
        return hf.get(self.select[0]) if self.select[0] else None

    def config(self, m) -> dict:
        """config.json fields beyond the Llama frame's (or replacing them), in the order written."""
        return {"architectures": [self.architecture], "model_type": self.model_type}

    def fields(self, hf: dict) -> dict:
        """Our `model` fields (beyond the Llama frame's) that config.json `hf` gives."""
        return {}

    def problems(self, hf: dict, fields: dict) -> list[str]:
        """Why `hf` (read as `fields`) cannot be imported into this kind; [] when it can."""
        return []


class LinearKind(nnx.Module):
    """One linear map d_in -> d_out; `axes` = the logical names of its (in, out) dims; `group` = the
    projection group a parallel plan partitions as a unit (qkv | o | mlp_in | mlp_out). A parameter the
    kind reads only through `use` in the GEMM's dtype is declared with `compute_only=True` (nnx
    metadata): the train step may cast it to the compute dtype once per step (runtime/state.py
    `step_casts`); one it reads in float32 (a scale) must not be."""

    # The kind's own `model` fields {name: config.Field(default, help)}: registering the kind makes
    # them config keys (`--config.model.NAME=...`), read here as m.NAME.
    fields: ClassVar[dict] = {}
    hf: ClassVar[HFLayout | None] = None  # its Hugging Face layout (boost_jax/export.py); None: none
    # The model family a zoo config's name carries (cola_7b, llama_7b): the comm report renames a
    # config measured on another kind's twin by it. "": names are left alone.
    family: ClassVar[str] = ""
    factored: ClassVar[bool] = True  # a bottleneck between two stages (False: one d_in x d_out stage)
    has_extra: ClassVar[bool] = False  # `extra` adds a term from the normalised input rows
    act: ClassVar[str] = ""  # `bottleneck`'s σ by name where a kernel can read it into the second GEMM

    def __init__(self, m, d_in: int, d_out: int, *, axes: tuple[str, str], group: str, rngs: nnx.Rngs, param_dtype):
        self.d_in, self.d_out, self.group = d_in, d_out, group
        self.in_axis, self.out_axis = axes
        self.width = self.bottleneck_width(m, d_in, d_out)
        self.act_in_gemm, self.rope_in_gemm = self.bottleneck_kernels(m)
        self.norm_in_gemm = self.norm_kernel(m)

    @classmethod
    def bottleneck_kernels(cls, m) -> tuple[bool, bool]:
        """(σ inside the second-stage GEMM's kernel (model/linear.py `project`), q's and k's RoPE too):
        model.bottleneck_kernel of the model section m, whose model.gate_kernel is resolved (auto: norm
        where that is gemm, else xla; norm: rope and the residual add + norm read into the first stage's
        GEMM, `norm_in_gemm`). The planner's memory terms read it too."""
        choice = cls._bottleneck_choice(m)
        act = bool(cls.act) and choice in ("gemm", "rope", "norm")
        return act, act and choice in ("rope", "norm")

    @classmethod
    def norm_kernel(cls, m) -> bool:
        """Whether model.bottleneck_kernel (resolved as `bottleneck_kernels` does) reads the residual add +
        norm into the first stage's GEMM (model/linear.py `add_norm_first`). The planner's memory terms
        read it too."""
        return cls.bottleneck_kernels(m)[1] and cls._bottleneck_choice(m) == "norm"

    @staticmethod
    def _bottleneck_choice(m) -> str:
        """model.bottleneck_kernel with auto resolved: norm where model.gate_kernel is gemm, else xla."""
        choice = m.get("bottleneck_kernel", "auto")
        return ("norm" if m.get("gate_kernel") == "gemm" else "xla") if choice == "auto" else choice

    # --- what a kind defines -------------------------------------------------------------------
    @classmethod
    def bottleneck_width(cls, m, d_in: int, d_out: int) -> int:
        """Width of the first stage's output (the rank r of a factored kind)."""
        return int(m.rank)

    @classmethod
    def flops(cls, m, d_in: int, d_out: int) -> int:
        """Forward multiply-add FLOPs per token."""
        return 2 * cls.bottleneck_width(m, d_in, d_out) * (d_in + d_out)

    @classmethod
    def weight_flops(cls, m, d_in: int, d_out: int) -> int:
        """FLOPs to build the two stage matrices from the stored parameters, once per forward pass
        (not per token): zero unless the matrices are reconstructed (tensor-train)."""
        return 0

    @classmethod
    def n_params(cls, m, d_in: int, d_out: int) -> int:
        raise NotImplementedError

    @classmethod
    def axis_units(cls, m) -> dict[str, tuple[str, int]]:
        """{logical axis: (config field, whole units)} of the axes this kind adds to its projections'
        (the rank of a factored kind): what a mesh axis splitting that axis must divide."""
        return {"rank": ("model.rank", int(m.rank))} if cls.factored else {}

    @classmethod
    def split_widths(cls, m, d_in: int, d_out: int) -> tuple[int, ...]:
        """The inner widths of the (outer, inner) dimension pairs its weights are built through
        (reshapes of transposed products): a GEMM may be tiled through them (xla_gpu_flags.py
        `gemm_options`). None for weights stored as they are multiplied."""
        return ()

    @classmethod
    def nonlinear(cls, m) -> bool:
        """True when σ at the bottleneck is a nonlinearity (so the MLP may drop SwiGLU's σ)."""
        return False

    @classmethod
    def validate(cls, m, widths: dict[str, int]) -> str | None:
        """A message naming what is wrong with the `model` section for this kind, or None.
        `widths`: every projection input/output width by config field."""
        smallest = min(widths.values())
        if not 0 < m.rank < smallest:
            field = min(widths, key=widths.get)
            return (
                f"model.rank: {m.rank} must be in (0, {smallest}) (smaller than {field}, the narrowest "
                f"projection), e.g. d_model/4 = {m.d_model // 4}"
            )
        return None

    def first_weight(self, use: Use = gathered) -> jax.Array:
        raise NotImplementedError

    def second_weight(self, use: Use = gathered) -> jax.Array | None:
        raise NotImplementedError

    def bottleneck(self, h: jax.Array) -> jax.Array:
        """σ applied to the fully reduced first-stage output."""
        return h

    def extra(self, x: jax.Array) -> jax.Array:
        """A term added to the output, from the normalised input x [B, T, d_in] (whole rows)."""
        raise NotImplementedError

    # --- shared ----------------------------------------------------------------------------------
    @property
    def first_axes(self) -> tuple:
        return (self.in_axis, "rank") if self.factored else (self.in_axis, self.out_axis)

    @property
    def second_axes(self) -> tuple:
        return ("rank", self.out_axis)

    @property
    def first_shape(self) -> tuple[int, int]:
        return (self.d_in, self.width if self.factored else self.d_out)

    @property
    def second_shape(self) -> tuple[int, int]:
        return (self.width, self.d_out)
