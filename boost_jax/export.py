"""Hugging Face interchange: export a run to safetensors + config.json, import a HF Llama as a run.

    python -m boost_jax.export --checkpoint RUN_DIR --out HF_DIR      # latest step (or give a step dir)
    python -m boost_jax.export --import-hf HF_DIR --out RUN_DIR       # -> RUN_DIR/checkpoints/0

Needs `safetensors` (`pip install -e '.[hf]'`); torch is needed only to load the result in transformers.

Full-rank models (model.linear=dense) export as a plain `LlamaForCausalLM` that
`transformers.LlamaForCausalLM.from_pretrained(HF_DIR)` loads: our RoPE is the same rotate-half over
the head dim (no q/k permutation), our RMSNorm is HF's, and every weight is transposed to HF's
[out, in]. `model.safetensors` (float32) holds:

    model.embed_tokens.weight                          [vocab, d]
    model.layers.{i}.input_layernorm.weight            [d]          layers/attn_norm/scale[i]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   [out, in]    layers/attn/{q,k,v,o}/w[i].T
    model.layers.{i}.post_attention_layernorm.weight   [d]          layers/mlp_norm/scale[i]
    model.layers.{i}.mlp.{gate,up,down}_proj.weight    [out, in]    layers/mlp/{gate,up,down}/w[i].T
    model.norm.weight                                  [d]          final_norm/scale
    lm_head.weight                                     [vocab, d]   lm_head.T (absent when tied)

Low-rank and CoLA models (model.linear=lowrank|cola) use the same names, except that every
`X_proj.weight` becomes two factors, still in the [out, in] convention:

    model.layers.{i}.self_attn.q_proj.A                [r, in]      layers/attn/q/a[i].T  (applied first)
    model.layers.{i}.self_attn.q_proj.B                [out, r]     layers/attn/q/b[i].T
    y = B @ act(A @ x),  act = SiLU ("activation": "silu", cola) or identity ("identity", lowrank)

and config.json adds `linear`, `rank`, `activation` and `only_lr_act` (true: the MLP is
down(gate * up), no SwiGLU SiLU) to the Llama fields, with model_type `cola_llama` so that
transformers refuses it instead of loading random dense weights. `--import-hf` reads both forms
(and sharded `*.safetensors` directories, float32/float16/bfloat16) back into an Orbax checkpoint at
step 0 with fresh optimizer state, which `python -m boost_jax.generate` and training resume use.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

LLAMA_FIELDS = {  # HF Llama config key -> our model.* field
    "vocab_size": "vocab_size", "hidden_size": "d_model", "intermediate_size": "d_ff",
    "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
    "max_position_embeddings": "max_seq_len", "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings",
}
ACTIVATION = {"cola": "silu", "lowrank": "identity"}


class ExportError(ValueError):
    pass


def _safetensors():
    try:
        import safetensors.numpy as st
    except ImportError as e:  # optional dependency
        raise ExportError("export/import needs safetensors: pip install -e '.[hf]'") from e
    return st


# ---------------------------------------------------------------- names

def tensor_names(m):
    """(our param path, layer index or None, HF name, transposed) for every tensor of model config m."""
    yield ("embed",), None, "model.embed_tokens.weight", False
    yield ("final_norm", "scale"), None, "model.norm.weight", False
    if not m.tie_embeddings:
        yield ("lm_head",), None, "lm_head.weight", True
    for i in range(m.n_layers):
        pre = f"model.layers.{i}."
        yield ("layers", "attn_norm", "scale"), i, pre + "input_layernorm.weight", False
        yield ("layers", "mlp_norm", "scale"), i, pre + "post_attention_layernorm.weight", False
        for block, hf_block, projs in (("attn", "self_attn", "qkvo"), ("mlp", "mlp", ("gate", "up", "down"))):
            for p in projs:
                name = f"{pre}{hf_block}.{p}_proj."
                if m.linear == "dense":
                    yield ("layers", block, p, "w"), i, name + "weight", True
                else:
                    yield ("layers", block, p, "a"), i, name + "A", True
                    yield ("layers", block, p, "b"), i, name + "B", True


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def to_hf(params: dict, m) -> dict[str, np.ndarray]:
    """Our pure-dict params -> {HF name: float32 array in [out, in]}."""
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)  # one host copy per array
    out = {}
    for path, layer, name, transposed in tensor_names(m):
        x = _get(params, path)
        x = x if layer is None else x[layer]
        out[name] = np.ascontiguousarray(x.T if transposed else x)  # safetensors writes C order
    return out


def from_hf(tensors: dict[str, np.ndarray], abstract_params: dict, m) -> dict:
    """{HF name: array} -> our pure-dict params (numpy) shaped and typed like `abstract_params`."""
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params)
    used, wrong = set(), []
    for path, layer, name, transposed in tensor_names(m):
        if name not in tensors:
            raise ExportError(f"tensor {name} is missing from the safetensors files")
        dst = _get(params, path)
        x = np.asarray(tensors[name])
        x = x.T if transposed else x
        want = dst.shape if layer is None else dst.shape[1:]
        if x.shape != want:
            wrong.append(f"{name}: file {tuple(tensors[name].shape)} vs expected "
                         f"{want[::-1] if transposed else want}")
            continue
        if layer is None:
            dst[...] = x
        else:
            dst[layer] = x
        used.add(name)
    # Old HF checkpoints store the RoPE table; a tied model may still carry its head.
    extra = [f"unexpected {k}" for k in sorted(set(tensors) - used)
             if not k.endswith("rotary_emb.inv_freq") and k != "lm_head.weight"]
    if wrong or extra:
        raise ExportError("safetensors do not fit the config: " + "; ".join(wrong[:8] + extra[:8]))
    return params


# ---------------------------------------------------------------- configs

def hf_config(m, eos_id=None) -> dict:
    """config.json for model config m: a LlamaForCausalLM, or the documented CoLA/low-rank variant."""
    c = {hf: m[ours] for hf, ours in LLAMA_FIELDS.items()}
    c.update(
        architectures=["LlamaForCausalLM"], model_type="llama", head_dim=m.d_model // m.n_heads,
        hidden_act="silu", attention_bias=False, mlp_bias=False, rope_theta=float(m.rope_theta),
        # transformers >= 5 reads rope_parameters, older versions rope_theta; both say the same.
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        torch_dtype="float32", dtype="float32", bos_token_id=None, eos_token_id=eos_id,
        tie_word_embeddings=bool(m.tie_embeddings),
    )
    if m.linear != "dense":
        c.update(architectures=["ColaLlamaForCausalLM"], model_type="cola_llama", linear=m.linear,
                 rank=int(m.rank), activation=ACTIVATION[m.linear],
                 only_lr_act=bool(m.only_lr_act) and m.linear == "cola")
    return c


def model_fields(hf: dict) -> dict:
    """HF config.json -> our model.* fields; rejects Llama variants this model cannot represent."""
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    problems = [
        (hf.get("head_dim") not in (None, d // h), f"head_dim={hf.get('head_dim')} != hidden_size/heads={d // h}"),
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')!r} (only silu)"),
        (bool(hf.get("attention_bias") or hf.get("mlp_bias")), "attention/mlp biases"),
        (rope.get("rope_type", "default") != "default" or scaling.get("rope_type", scaling.get("type", "default"))
         not in ("default", None), "RoPE scaling"),
    ]
    bad = [why for cond, why in problems if cond]
    if bad:
        raise ExportError("cannot import this model: " + ", ".join(bad))
    fields = {ours: hf[key] for key, ours in LLAMA_FIELDS.items() if key in hf}
    fields["n_kv_heads"] = hf.get("num_key_value_heads") or h
    fields["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    fields["linear"] = hf.get("linear", "dense")
    if fields["linear"] != "dense":
        if hf.get("activation", ACTIVATION[fields["linear"]]) != ACTIVATION[fields["linear"]]:
            raise ExportError(f"linear={fields['linear']} needs activation={ACTIVATION[fields['linear']]!r}, "
                              f"got {hf.get('activation')!r}")
        fields.update(rank=hf["rank"], only_lr_act=bool(hf.get("only_lr_act", False)))
    return fields


# ---------------------------------------------------------------- files

def load_safetensors(path) -> dict[str, np.ndarray]:
    """One .safetensors file as numpy; bfloat16 (which safetensors.numpy cannot read) via ml_dtypes."""
    try:
        return _safetensors().load_file(str(path))
    except TypeError:  # "data type 'bfloat16' not understood"
        import ml_dtypes
        raw = Path(path).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        header.pop("__metadata__", None)
        dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
        return {k: np.frombuffer(raw, dtypes[v["dtype"]], count=int(np.prod(v["shape"])),
                                 offset=8 + n + v["data_offsets"][0]).reshape(v["shape"])
                for k, v in header.items()}


def export(checkpoint: str, out: str) -> Path:
    """Write config.json, model.safetensors (and the tokenizer file, if any) for a run's checkpoint."""
    from flax import nnx

    from boost_jax.generate import load_params

    st = _safetensors()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out: {out} is a file; give a directory to write the model into")
    model, cfg, tok = load_params(checkpoint)  # refuses damaged or non-finite weights
    out.mkdir(parents=True, exist_ok=True)
    # {"format": "pt"}: transformers refuses safetensors files without it.
    st.save_file(to_hf(nnx.to_pure_dict(nnx.state(model)), cfg.model), str(out / "model.safetensors"),
                 metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg.model, tok.eos_id), indent=2) + "\n")
    spec = cfg.data.tokenizer
    if spec not in ("", "byte"):  # the byte tokenizer needs no file: token id = UTF-8 byte
        shutil.copy(spec, out / ("tokenizer.json" if spec.endswith(".json") else "tokenizer.model"))
    return out


def import_hf(hf_dir: str, run_dir: str, seed: int = 0) -> tuple[Path, object]:
    """HF Llama (or exported CoLA) dir -> RUN_DIR/checkpoints/0 with fresh optimizer state.
    Returns (checkpoint dir, the run config to train or sample with)."""
    from boost_jax.checkpoint import Checkpointer
    from boost_jax.config import base_config, validate
    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.strategies import get_strategy
    from boost_jax.state import state_spec

    hf_dir, run_dir = Path(hf_dir), Path(run_dir).resolve()
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"no *.safetensors in {hf_dir}")
    cfg = base_config()
    cfg.run_dir = str(run_dir)
    cfg.model.update(model_fields(json.loads((hf_dir / "config.json").read_text())))
    cfg.train.seq_len = min(cfg.train.seq_len, cfg.model.max_seq_len)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer.model"):  # else the byte tokenizer (ids 0..255)
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, run_dir / name)
            cfg.data.tokenizer = str(run_dir / name)
            break
    validate(cfg)

    # Build the state on one device; a checkpoint restores onto any mesh later.
    one = cfg.copy_and_resolve_references()
    one.parallel.update(data=1, fsdp=1, tensor=1)
    mesh = make_mesh(one, jax.devices()[:1])
    tx, _ = make_optimizer(cfg.train)
    spec = state_spec(one, tx, mesh, get_strategy(one.parallel))
    tensors = {}
    for f in files:
        tensors.update(load_safetensors(f))
    params = jax.device_put(from_hf(tensors, spec.abstract["params"], cfg.model), spec.shardings["params"])
    state = {"params": params,
             "opt_state": jax.jit(tx.init, out_shardings=spec.shardings["opt_state"])(params),
             "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32)}
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=False)
    ckpt.save(0, state, {"data_position": 0, "step": 0, "config": json.loads(cfg.to_json_best_effort())},
              force=True)
    ckpt.close()
    return run_dir / "checkpoints" / "0", cfg


def train_flags(cfg) -> str:
    """The --config.* flags that rebuild cfg's model, data and train fields from the defaults, so that
    `python -m boost_jax.train` can resume from an imported checkpoint."""
    from boost_jax.config import base_config

    base = base_config()
    return " ".join(f"--config.{section}.{k}={cfg[section][k]}" for section in ("model", "data", "train")
                    for k in sorted(cfg[section].keys()) if cfg[section][k] != base[section][k])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="export: a run dir, its checkpoints/ dir, or one step dir")
    src.add_argument("--import-hf", metavar="HF_DIR", help="import: a HF Llama (or exported CoLA) dir")
    ap.add_argument("--out", required=True, help="export: the HF dir to write; import: the run dir to write")
    ap.add_argument("--format", default="hf", choices=("hf",), help="export format (only hf)")
    args = ap.parse_args(argv)
    from absl import logging as absl_logging

    from boost_jax.checkpoint import CheckpointError
    from boost_jax.config import ConfigError

    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        if args.checkpoint:
            out = export(args.checkpoint, args.out)
            print(f"wrote {out}/config.json and {out}/model.safetensors")
        else:
            step_dir, cfg = import_hf(args.import_hf, args.out)
            print(f"wrote {step_dir} (step 0, fresh optimizer state)\n"
                  f"sample: python -m boost_jax.generate --checkpoint {args.out}\n"
                  f"train:  python -m boost_jax.train --config.run_dir={args.out} {train_flags(cfg)}")
    except (ExportError, ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
