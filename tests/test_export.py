"""Hugging Face export/import: dense round trip is bit-exact, CoLA writes the documented layout,
and (when torch + transformers are installed) transformers' Llama reproduces our logits."""
import json

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors", reason="export needs safetensors: pip install -e '.[test]'")

from flax import nnx  # noqa: E402

from boost_jax import export, train  # noqa: E402
from boost_jax.checkpoint import Checkpointer  # noqa: E402
from boost_jax.generate import load_params  # noqa: E402
from conftest import small_config  # noqa: E402


def trained_run(run_dir, **overrides):
    """A run dir holding a checkpoint of a small model after 2 steps (so weights are not the init)."""
    cfg = small_config(run_dir, **{"train.steps": 2, "train.eval_every": 0, "checkpoint.every": 2,
                                   "model.n_kv_heads": 2, **overrides})
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
    st = export.load_safetensors(hf / "model.safetensors")
    assert st["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)  # [kv*head_dim, d]: HF [out, in]
    assert st["lm_head.weight"].shape == (256, 32)
    hf_cfg = json.loads((hf / "config.json").read_text())
    assert hf_cfg["architectures"] == ["LlamaForCausalLM"] and hf_cfg["num_key_value_heads"] == 2

    assert export.main(["--import-hf", str(hf), "--out", str(tmp_path / "imported")]) == 0
    original = flat(pure(load_params(cfg.run_dir)[0]))
    imported = flat(pure(load_params(str(tmp_path / "imported"))[0]))
    assert original.keys() == imported.keys()
    for k in original:
        np.testing.assert_array_equal(original[k], imported[k], err_msg=k)

    # Training resumes from the imported step 0 (fresh optimizer state) with the same model config.
    resumed = small_config(tmp_path / "imported", **{"model.linear": "dense", "model.n_kv_heads": 2,
                                                      "train.steps": 2, "train.eval_every": 0})
    assert train.run(resumed)["step"] == 2


def test_cola_export_layout_and_config(tmp_path):
    cfg = trained_run(tmp_path / "run", **{"model.only_lr_act": True})  # linear=cola by default
    export.export(cfg.run_dir, tmp_path / "hf")
    st = export.load_safetensors(tmp_path / "hf" / "model.safetensors")
    d, r, ff, kv = 32, 8, 64, 16
    want = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv),
            "self_attn.o_proj": (d, d), "mlp.gate_proj": (d, ff), "mlp.up_proj": (d, ff), "mlp.down_proj": (ff, d)}
    for i in range(2):
        for name, (d_in, d_out) in want.items():
            assert st[f"model.layers.{i}.{name}.A"].shape == (r, d_in)
            assert st[f"model.layers.{i}.{name}.B"].shape == (d_out, r)
            assert f"model.layers.{i}.{name}.weight" not in st
    # A is a.T and B is b.T, layer by layer.
    params = pure(load_params(cfg.run_dir)[0])
    layers = params["layers"]
    np.testing.assert_array_equal(st["model.layers.1.mlp.down_proj.A"], np.asarray(layers["mlp"]["down"]["a"][1]).T)
    np.testing.assert_array_equal(st["model.layers.0.self_attn.v_proj.B"], np.asarray(layers["attn"]["v"]["b"][0]).T)
    assert len(st) == 3 + 2 * (2 + 2 * 7)  # embed, norm, head; per layer 2 norms + 7 projections x (A, B)
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: hf_cfg[k] for k in ("linear", "rank", "activation", "only_lr_act")} == {
        "linear": "cola", "rank": 8, "activation": "silu", "only_lr_act": True}
    assert hf_cfg["hidden_size"] == 32 and hf_cfg["num_hidden_layers"] == 2 and hf_cfg["model_type"] == "cola_llama"

    # The CoLA layout imports back too.
    step_dir, _ = export.import_hf(tmp_path / "hf", tmp_path / "imported")
    assert Checkpointer(step_dir.parent, keep=1, create=False).latest_step() == 0
    back = flat(pure(load_params(str(tmp_path / "imported"))[0]))
    for k, v in flat(params).items():
        np.testing.assert_array_equal(v, back[k], err_msg=k)


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
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()  # float32 per config.json
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    ours = np.asarray(load_params(run_dir)[0](tokens)[0])
    with torch.no_grad():
        theirs = hf_model(torch.from_numpy(tokens).long()).logits.numpy()
    # Matching over 16 positions also checks RoPE: both rotate halves of each head, no permutation.
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)


def test_transformers_llama_matches_our_logits(dense_export):
    cfg, hf = dense_export
    _compare_with_transformers(cfg.run_dir, hf)


def test_transformers_llama_matches_tied_embeddings(tmp_path):
    pytest.importorskip("torch", reason="pip install torch==2.13.0 (CPU) to compare with transformers")
    pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
    cfg = trained_run(tmp_path / "run", **{"model.linear": "dense", "model.tie_embeddings": True})
    export.export(cfg.run_dir, tmp_path / "hf")
    assert "lm_head.weight" not in export.load_safetensors(tmp_path / "hf" / "model.safetensors")
    _compare_with_transformers(cfg.run_dir, tmp_path / "hf")
