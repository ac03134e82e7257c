"""Low-rank B·A and CoLA B·σ(A·x) (σ = SiLU): two factors through an r-wide bottleneck.

Both export in the layout of the official CoLA implementation (`ColaLayout`): `ColaForCausalLM`,
every `X_proj` the two factors of `y = act(x @ cola_a) @ cola_b` stored like ours, act = SiLU
(`lr_act_type: "silu"`, cola) or identity (`"linear"`, lowrank).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from boost_jax.model.kinds.base import HFLayout, LinearKind, factor_init
from boost_jax.parallel.rules import gathered

GQA_KEY = "boost_num_key_value_heads"  # our KV heads, when the CoLA file repeats them to num_heads


@dataclasses.dataclass(frozen=True)
class ColaLayout(HFLayout):
    """The official CoLA layout. Its config class silently defaults every field it does not find (rank
    d/4, only_lr_act true, ...), so export writes each; it has no GQA (k and v are num_heads * head_dim
    wide): export repeats each KV head's columns of the k/v cola_b and records our KV heads in GQA_KEY."""

    model_type: str = "cola"
    architecture: str = "ColaForCausalLM"
    tensors: tuple = (("a", "cola_a", False), ("b", "cola_b", False))
    kv_repeat: str = "cola_b"
    train: tuple = (("b2", 0.999),)  # the official CoLA training's AdamW betas, as in configs/cola_*.py

    def selected(self, hf):
        return hf.get("lr_act_type") or hf.get("hidden_act", "silu")

    def config(self, m):
        act = self.select[1]
        c = {
            **super().config(m),
            "num_key_value_heads": m.n_heads,
            "rank": int(m.rank),
            "lr_act_type": act,
            "only_lr_act": bool(m.only_lr_act) and act != "linear",
        }
        if m.n_kv_heads != m.n_heads:
            c[GQA_KEY] = int(m.n_kv_heads)
        return c

    def fields(self, hf):
        h = hf["num_attention_heads"]
        return {
            "n_kv_heads": hf.get(GQA_KEY) or h,
            "rank": hf.get("rank") or hf["hidden_size"] // 4,
            "only_lr_act": bool(hf.get("only_lr_act", True)),
        }

    def problems(self, hf, fields):
        h = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or h
        return [
            why
            for cond, why in (
                (kv != h, f"num_key_value_heads={kv} != num_attention_heads={h} (the CoLA layout has no GQA)"),
                (
                    self.select[1] == "linear" and fields["only_lr_act"],
                    "only_lr_act=true with lr_act_type='linear' (no MLP activation)",
                ),
            )
            if cond
        ]


class LowRank(LinearKind):
    family = "cola"
    hf = ColaLayout(select=("lr_act_type", "linear"))

    def __init__(self, m, d_in, d_out, *, axes, group, rngs, param_dtype):
        super().__init__(m, d_in, d_out, axes=axes, group=group, rngs=rngs, param_dtype=param_dtype)
        r = self.width
        self.a = nnx.Param(
            factor_init(rngs.params(), (d_in, r), d_in, d_out, r, param_dtype),
            axes=(axes[0], "rank"),
            compute_only=True,
        )
        self.b = nnx.Param(
            factor_init(rngs.params(), (r, d_out), d_in, d_out, r, param_dtype),
            axes=("rank", axes[1]),
            compute_only=True,
        )

    @classmethod
    def n_params(cls, m, d_in, d_out):
        return int(m.rank) * (d_in + d_out)

    def first_weight(self, use=gathered):
        return use(self.a[...], self.first_axes)

    def second_weight(self, use=gathered):
        return use(self.b[...], self.second_axes)


class CoLA(LowRank):
    hf = ColaLayout(select=("lr_act_type", "silu"))
    act = "silu"

    @classmethod
    def nonlinear(cls, m):
        return True

    def bottleneck(self, h):
        return jax.nn.silu(h)
