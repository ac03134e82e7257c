"""Hugging Face export/import: dense and CoLA round trips are bit-exact, CoLA writes the official
CoLA layout (checked against a written table, and, with torch installed, by a PyTorch model in that
layout that loads strictly and reproduces our logits), and with transformers installed its Llama
reproduces our logits."""

import json

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors", reason="export needs safetensors: pip install -e '.[test]'")

from conftest import small_config  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from boost_jax import export, train  # noqa: E402
from boost_jax.errors import ConfigError, ExportError  # noqa: E402
from boost_jax.hf_files import load_safetensors  # noqa: E402
from boost_jax.model.kinds.lowrank import GQA_KEY  # noqa: E402 - the CoLA layout lives with its kinds
from boost_jax.model.transformer import build_model  # noqa: E402
from boost_jax.runtime.build import load_model  # noqa: E402
from boost_jax.runtime.checkpoints.store import Checkpointer  # noqa: E402


def trained_run(run_dir, **overrides):
    """A run dir holding a checkpoint of a small model after 2 steps (so weights are not the init)."""
    cfg = small_config(
        run_dir, **{"train.steps": 2, "train.eval_every": 0, "checkpoint.every": 2, "model.n_kv_heads": 2, **overrides}
    )
    train.run(cfg)
    return cfg


def pure(model):
    return nnx.to_pure_dict(nnx.state(model))


def flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def dense_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    cfg = trained_run(root / "run", **{"model.linear": "dense"})
    assert export.main(["--checkpoint", cfg.run_dir, "--out", str(root / "hf")]) == 0
    return cfg, root / "hf"


def test_dense_export_import_is_bit_identical(dense_export, tmp_path):
    cfg, hf = dense_export
    st = load_safetensors(hf / "model.safetensors")
    assert st["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)  # [kv*head_dim, d]: HF [out, in]
    assert st["lm_head.weight"].shape == (256, 32)
    hf_cfg = json.loads((hf / "config.json").read_text())
    assert hf_cfg["architectures"] == ["LlamaForCausalLM"] and hf_cfg["num_key_value_heads"] == 2

    assert export.main(["--import-hf", str(hf), "--out", str(tmp_path / "imported")]) == 0
    original = flat(pure(load_model(cfg.run_dir)[0]))
    imported = flat(pure(load_model(str(tmp_path / "imported"))[0]))
    assert original.keys() == imported.keys()
    for k in original:
        np.testing.assert_array_equal(original[k], imported[k], err_msg=k)

    # Training resumes from the imported step 0 (fresh optimizer state) with the same model config.
    resumed = small_config(
        tmp_path / "imported",
        **{"model.linear": "dense", "model.n_kv_heads": 2, "train.steps": 2, "train.eval_every": 0},
    )
    assert train.run(resumed)["step"] == 2


# The official CoLA layout for the small test model (d=32, 4 heads of 8, 2 KV heads, I=64, r=8):
# HF name suffix -> (our projection, shape in the file). k/v cola_b are n_heads*head_dim = 32 wide.
COLA_TABLE = {
    "self_attn.q_proj.cola_a": (("attn", "q", "a"), (32, 8)),
    "self_attn.q_proj.cola_b": (("attn", "q", "b"), (8, 32)),
    "self_attn.k_proj.cola_a": (("attn", "k", "a"), (32, 8)),
    "self_attn.k_proj.cola_b": (("attn", "k", "b"), (8, 32)),
    "self_attn.v_proj.cola_a": (("attn", "v", "a"), (32, 8)),
    "self_attn.v_proj.cola_b": (("attn", "v", "b"), (8, 32)),
    "self_attn.o_proj.cola_a": (("attn", "o", "a"), (32, 8)),
    "self_attn.o_proj.cola_b": (("attn", "o", "b"), (8, 32)),
    "mlp.gate_proj.cola_a": (("mlp", "gate", "a"), (32, 8)),
    "mlp.gate_proj.cola_b": (("mlp", "gate", "b"), (8, 64)),
    "mlp.up_proj.cola_a": (("mlp", "up", "a"), (32, 8)),
    "mlp.up_proj.cola_b": (("mlp", "up", "b"), (8, 64)),
    "mlp.down_proj.cola_a": (("mlp", "down", "a"), (64, 8)),
    "mlp.down_proj.cola_b": (("mlp", "down", "b"), (8, 32)),
    "input_layernorm.weight": (("attn_norm", "scale"), (32,)),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), (32,)),
}
# Every field the official config class reads (it defaults the missing ones silently).
COLA_CONFIG = {
    "model_type": "cola",
    "architectures": ["ColaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "hidden_act": "silu",
    "lr_act_type": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rank": 8,
    "only_lr_act": True,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "rope_scaling": None,
    "attention_dropout": 0.0,
    "pretraining_tp": 1,
    "boost_num_key_value_heads": 2,
}


@pytest.fixture(scope="module")
def cola_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("cola")
    cfg = trained_run(root / "run", **{"model.only_lr_act": True})  # linear=cola by default; GQA 4 heads / 2 KV
    assert export.main(["--checkpoint", cfg.run_dir, "--out", str(root / "hf")]) == 0
    return cfg, root / "hf"


def test_cola_export_official_layout(cola_export):
    cfg, hf = cola_export
    st = load_safetensors(hf / "model.safetensors")
    layers = pure(load_model(cfg.run_dir)[0])["layers"]
    want = {"model.embed_tokens.weight": (256, 32), "model.norm.weight": (32,), "lm_head.weight": (256, 32)}
    for i in range(2):
        for suffix, (path, shape) in COLA_TABLE.items():
            name = f"model.layers.{i}.{suffix}"
            want[name] = shape
            ours = np.asarray(export._get(layers, path)[i])
            if suffix in ("self_attn.k_proj.cola_b", "self_attn.v_proj.cola_b"):
                # KV head j's 8 columns serve query heads 2j and 2j+1: written twice, side by side.
                ours = np.concatenate([ours[:, 0:8], ours[:, 0:8], ours[:, 8:16], ours[:, 8:16]], axis=1)
            np.testing.assert_array_equal(st[name], ours, err_msg=name)  # no transposes
    assert {k: v.shape for k, v in st.items()} == want
    assert json.loads((hf / "config.json").read_text()).items() >= COLA_CONFIG.items()


def test_cola_import_is_bit_identical(cola_export, tmp_path):
    cfg, hf = cola_export
    assert export.main(["--import-hf", str(hf), "--out", str(tmp_path / "imported")]) == 0
    assert Checkpointer(tmp_path / "imported" / "checkpoints", keep=1, create=False).latest_step() == 0
    model, back_cfg, _ = load_model(str(tmp_path / "imported"))
    assert (back_cfg.model.n_kv_heads, back_cfg.model.only_lr_act, back_cfg.train.b2) == (2, True, 0.999)
    original, back = flat(pure(load_model(cfg.run_dir)[0])), flat(pure(model))
    assert original.keys() == back.keys()
    for k in original:
        np.testing.assert_array_equal(original[k], back[k], err_msg=k)


def test_cola_config_fields_round_trip():
    """Every model field the CoLA layout carries comes back; lowrank is CoLA with lr_act_type linear."""
    for linear, only_lr_act, kv in (("cola", False, 4), ("cola", True, 1), ("lowrank", False, 2)):
        m = small_config(
            "unused",
            **{
                "model.linear": linear,
                "model.only_lr_act": only_lr_act,
                "model.n_kv_heads": kv,
                "model.rope_theta": 5e5,
                "model.norm_eps": 1e-5,
            },
        ).model
        hf = json.loads(json.dumps(export.hf_config(m)))
        assert hf["lr_act_type"] == {"cola": "silu", "lowrank": "linear"}[linear]
        assert hf["num_key_value_heads"] == 4 and (GQA_KEY in hf) == (kv != 4)
        fields = export.model_fields(hf)
        assert fields == {k: m[k] for k in fields}, fields


def test_gqa_fold_checks_the_repeated_heads(cola_export):
    cfg, hf = cola_export
    tensors = load_safetensors(hf / "model.safetensors")
    assert export.kv_heads_repeated(tensors, cfg.model)
    # Trained on in the official code, the copies of a KV head drift apart: the import keeps all heads.
    name = "model.layers.1.self_attn.v_proj.cola_b"
    drifted = dict(tensors, **{name: tensors[name] + np.arange(32) * 1e-3})
    assert not export.kv_heads_repeated(drifted, cfg.model)


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"num_key_value_heads": 2}, "no GQA"),
        ({"lr_act_type": "gelu"}, "lr_act_type"),
        ({"lr_act_type": "linear", "only_lr_act": True}, "only_lr_act"),
        ({"mlp_bias": True}, "biases"),
        ({"model_type": "cola_llama"}, "llama or cola"),
    ],
)
def test_import_rejects_cola_variants(bad, why):
    hf = {**COLA_CONFIG, **bad}
    with pytest.raises(ExportError, match=why):
        export.model_fields(hf)


def test_cola_defaults_are_the_official_ones():
    """A config.json written by the official code without rank/only_lr_act/eps/theta reads as it does there."""
    hf = {
        k: v
        for k, v in COLA_CONFIG.items()
        if k not in ("rank", "only_lr_act", "lr_act_type", "rms_norm_eps", "rope_theta", "boost_num_key_value_heads")
    }
    fields = export.model_fields(hf)
    assert (fields["rank"], fields["only_lr_act"], fields["linear"], fields["n_kv_heads"]) == (8, True, "cola", 4)
    assert fields["rope_theta"] == 10000.0 and fields.get("norm_eps", 1e-6) == 1e-6


def test_intermediate_padding_is_inert(tmp_path):
    """intermediate_size 63 splits over no tensor size 2: zero-padded to 64 it computes the same logits,
    trains with tensor=2 exactly as the unpadded model with tensor=1, and its pads stay exactly zero."""
    m = small_config(tmp_path / "unused", **{"model.d_ff": 63}).model
    model = build_model(m, seed=3)  # a CoLA checkpoint as another implementation would write it
    (tmp_path / "hf").mkdir()
    save_file(export.to_hf(pure(model), m), str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(export.hf_config(m)))
    assert export.main(["--import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "plain")]) == 0
    assert (
        export.main(
            ["--import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "padded"), "--intermediate-multiple", "8"]
        )
        == 0
    )
    tokens = np.random.default_rng(1).integers(0, 256, (2, 16)).astype(np.int32)
    np.testing.assert_allclose(
        np.asarray(load_model(str(tmp_path / "padded"))[0](tokens)[0]),
        np.asarray(model(tokens)[0]),
        rtol=1e-6,
        atol=1e-6,
    )

    common = {"model.d_ff": 63, "train.steps": 2, "train.eval_every": 0, "model.n_kv_heads": 2}
    with pytest.raises(ConfigError, match="model.d_ff=63.*--intermediate-multiple"):
        train.run(small_config(tmp_path / "plain", **common, **{"parallel.tensor": 2}))
    train.run(small_config(tmp_path / "plain", **common))
    train.run(small_config(tmp_path / "padded", **{**common, "model.d_ff": 64, "parallel.tensor": 2}))
    plain = pure(load_model(str(tmp_path / "plain"))[0])["layers"]["mlp"]
    padded = pure(load_model(str(tmp_path / "padded"))[0])["layers"]["mlp"]
    for name, axis in (("gate", 2), ("up", 2), ("down", 1)):  # b [L, r, I] columns, a [L, I, r] rows
        f = "a" if name == "down" else "b"
        p, q = np.asarray(padded[name][f]), np.asarray(plain[name][f])
        assert not np.any(np.take(p, [63], axis=axis)), name  # the pad is still exactly zero
        np.testing.assert_allclose(np.take(p, range(63), axis=axis), q, rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.allclose(q, np.asarray(pure(model)["layers"]["mlp"][name][f])), name  # it did train


def test_import_rejects_unsupported_llama(dense_export, tmp_path):
    _, hf = dense_export
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes())
    cfg = json.loads((hf / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    assert export.main(["--import-hf", str(bad), "--out", str(tmp_path / "x")]) == 1


def _compare_with_transformers(run_dir, hf_dir):
    torch = pytest.importorskip("torch", reason="pip install torch==2.13.0 (CPU) to compare with transformers")
    transformers = pytest.importorskip("transformers", reason="pip install transformers")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()  # float32 per config.json
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    ours = np.asarray(load_model(run_dir)[0](tokens)[0])
    with torch.no_grad():
        theirs = hf_model(torch.from_numpy(tokens).long()).logits.numpy()
    # Matching over 16 positions also checks RoPE: both rotate halves of each head, no permutation.
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)


def test_transformers_llama_matches_our_logits(dense_export):
    cfg, hf = dense_export
    _compare_with_transformers(cfg.run_dir, hf)


def test_transformers_llama_matches_tied_embeddings(tmp_path):
    pytest.importorskip("torch", reason="pip install torch==2.13.0 (CPU) to compare with transformers")
    pytest.importorskip("transformers", reason="pip install transformers")
    cfg = trained_run(tmp_path / "run", **{"model.linear": "dense", "model.tie_embeddings": True})
    export.export(cfg.run_dir, tmp_path / "hf")
    assert "lm_head.weight" not in load_safetensors(tmp_path / "hf" / "model.safetensors")
    _compare_with_transformers(cfg.run_dir, tmp_path / "hf")


def official_cola_lm(torch, hf: dict):
    """A PyTorch causal LM in the official CoLA implementation's layout, built from config.json the way
    its config class reads it (missing fields take its defaults): y = act(x @ cola_a) @ cola_b for every
    projection, k/v as wide as q (no GQA), Llama's RMSNorm, rotate-half RoPE and head."""
    nn, F = torch.nn, torch.nn.functional
    d, h, ff, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["intermediate_size"], hf["vocab_size"]
    hd, r = hf.get("head_dim") or d // h, hf.get("rank") or d // 4
    act = {"silu": F.silu, "linear": lambda x: x}[hf.get("lr_act_type") or hf.get("hidden_act", "silu")]
    only_lr_act, eps = hf.get("only_lr_act", True), hf.get("rms_norm_eps", 1e-6)
    inv_freq = 1.0 / hf.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    class Cola(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.cola_a, self.cola_b = nn.Parameter(torch.empty(d_in, r)), nn.Parameter(torch.empty(r, d_out))

        def forward(self, x):
            return act(x @ self.cola_a) @ self.cola_b

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(d))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):  # [b, heads, t, hd]
        angles = torch.arange(x.shape[2], dtype=torch.float64)[:, None] * inv_freq[None]
        cos, sin = (torch.cat([f(angles)] * 2, -1).float() for f in (torch.cos, torch.sin))
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = Cola(d, h * hd), Cola(d, h * hd), Cola(d, h * hd)
            self.o_proj = Cola(h * hd, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (p(x).view(b, t, h, hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, h * hd))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = Cola(d, ff), Cola(d, ff), Cola(ff, d)

        def forward(self, x):
            gate = self.gate_proj(x)
            return self.down_proj((gate if only_lr_act else F.silu(gate)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attention(), MLP()
            self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(Layer() for _ in range(hf["num_hidden_layers"]))
            self.norm = Norm()

    class ColaForCausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.lm_head = Body(), nn.Linear(d, vocab, bias=False)

        def forward(self, tokens):
            x = self.model.embed_tokens(tokens)
            for layer in self.model.layers:
                x = layer(x)
            return self.lm_head(self.model.norm(x))

    return ColaForCausalLM()


@pytest.mark.parametrize("only_lr_act", [True, False])
def test_official_cola_layout_loads_strictly_and_matches_logits(cola_export, tmp_path, only_lr_act):
    torch = pytest.importorskip("torch", reason="pip install torch==2.13.0 (CPU) to load the CoLA layout in PyTorch")
    if only_lr_act:
        cfg, hf = cola_export  # GQA: k/v cola_b carry repeated KV heads
    else:
        cfg = trained_run(tmp_path / "run", **{"model.n_kv_heads": 4})
        hf = export.export(cfg.run_dir, tmp_path / "hf")
    model = official_cola_lm(torch, json.loads((hf / "config.json").read_text()))
    state = {k: torch.from_numpy(np.array(v)) for k, v in load_safetensors(hf / "model.safetensors").items()}
    model.load_state_dict(state, strict=True)  # raises on any missing or unexpected tensor
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens).long()).numpy()
    ours = np.asarray(load_model(cfg.run_dir)[0](tokens)[0])
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)


def _damaged(hf, tmp_path, damage):
    bad = tmp_path / "damaged"
    bad.mkdir()
    for f in ("model.safetensors", "config.json"):
        (bad / f).write_bytes((hf / f).read_bytes())
    damage(bad)
    return bad


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _drop_field(path, key):
    cfg = json.loads(path.read_text())
    del cfg[key]
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "damage, names",
    [
        (lambda d: _truncate(d / "model.safetensors"), ("model.safetensors", "truncated")),
        (lambda d: _drop_field(d / "config.json", "hidden_size"), ("config.json", "`hidden_size`")),
        (lambda d: _drop_field(d / "config.json", "num_hidden_layers"), ("config.json", "`num_hidden_layers`")),
        (lambda d: (d / "config.json").write_text('{"hidden_size": 3'), ("config.json", "not readable JSON")),
        (lambda d: (d / "config.json").unlink(), ("config.json", "does not exist")),
    ],
    ids=["truncated-safetensors", "no-hidden_size", "no-num_hidden_layers", "config-not-json", "no-config"],
)
def test_import_names_a_damaged_file(dense_export, tmp_path, capsys, damage, names):
    """A truncated download or a config.json lacking a field: one line naming the file, no traceback."""
    _, hf = dense_export
    bad = _damaged(hf, tmp_path, damage)
    assert export.main(["--import-hf", str(bad), "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}") and err.count("\n") == 1, err
    assert all(n in err for n in names), err
