"""Hugging Face interchange: export a run to safetensors + config.json, import a HF Llama or CoLA model.

    python -m boost_jax.export --checkpoint RUN_DIR --out HF_DIR      # latest step (or give a step dir)
    python -m boost_jax.export --import-hf HF_DIR --out RUN_DIR       # -> RUN_DIR/checkpoints/0

Needs `safetensors` (the `hf` extra); transformers and torch only to load the result in PyTorch.
Neither direction overwrites what is there: an import's RUN_DIR must be new or empty and an export's
HF_DIR new, empty or an earlier export (`--supersede` renames what is in the way to NAME.superseded);
an export renames its NAME.tmp files only when all are written. Dense models export as a plain
`LlamaForCausalLM`, CoLA and low-rank ones in the official CoLA layout (`ColaForCausalLM`); the
layouts, GQA and `--intermediate-multiple` padding: `LAYOUTS` below.
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

from boost_jax import xla_gpu_flags
from boost_jax.config import base_config
from boost_jax.data.tokenizer import load_tokenizer
from boost_jax.errors import CheckpointError, ConfigError, ExportError, RunDirBusy
from boost_jax.hf_files import (
    load_safetensors,
    move_aside,
    reason,
    safetensors_numpy,
    save_safetensors,
    write_all,
)
from boost_jax.model import kinds
from boost_jax.runtime.build import build, load_model
from boost_jax.runtime.checkpoints.runlock import RunLock
from boost_jax.runtime.checkpoints.store import Checkpointer
from boost_jax.validate import validate

# LAYOUTS: what an export writes and an import reads.
#
# Full-rank models (model.linear=dense) export as a plain `LlamaForCausalLM` that
# `transformers.LlamaForCausalLM.from_pretrained(HF_DIR)` loads: our RoPE is the same rotate-half over
# the head dim (no q/k permutation), our RMSNorm is HF's, and every weight is transposed to HF's
# [out, in]. `model.safetensors` (float32) holds:
#
#     model.embed_tokens.weight                          [vocab, d]
#     model.layers.{i}.input_layernorm.weight            [d]          layers/attn_norm/scale[i]
#     model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   [out, in]    layers/attn/{q,k,v,o}/w[i].T
#     model.layers.{i}.post_attention_layernorm.weight   [d]          layers/mlp_norm/scale[i]
#     model.layers.{i}.mlp.{gate,up,down}_proj.weight    [out, in]    layers/mlp/{gate,up,down}/w[i].T
#     model.norm.weight                                  [d]          final_norm/scale
#     lm_head.weight                                     [vocab, d]   lm_head.T (absent when tied)
#
# CoLA and low-rank models (model.linear=cola|lowrank) export in the layout of the official CoLA
# implementation (`ColaForCausalLM`, config `model_type: "cola"`): the same names, except that every
# `X_proj.weight` becomes the two factors of `y = act(x @ cola_a) @ cola_b`, stored like ours (no transpose):
#
#     model.layers.{i}.self_attn.q_proj.cola_a           [in, r]      layers/attn/q/a[i]
#     model.layers.{i}.self_attn.q_proj.cola_b           [r, out]     layers/attn/q/b[i]
#
# with act = SiLU (cola, `lr_act_type: "silu"`) or identity (lowrank, `lr_act_type: "linear"`), and
# `only_lr_act` true for the MLP form down(gate * up) (false: down(silu(gate) * up)). That config class
# silently defaults every field it does not find (rank d/4, only_lr_act true, eps 1e-6, rope_theta 1e4,
# bos/eos ids 1/2), so config.json sets each of them. The official code has no GQA (k and v are
# num_heads * head_dim wide): a GQA model exports exactly by repeating each KV head's columns of the
# k/v `cola_b` (what grouped attention computes), with `boost_num_key_value_heads` recording our KV
# heads so that the import folds them back. `--import-hf` reads both forms (and sharded
# `*.safetensors` directories, float32/float16/bfloat16) back into an Orbax checkpoint at step 0 with
# fresh optimizer state, which `python -m boost_jax.generate` and training resume use.
# `--intermediate-multiple M` zero-pads intermediate_size up to a multiple of M (the official 1B's 5461
# = 43 x 127 splits over no power-of-two tensor-parallel size): the padded gate/up columns and down rows start
# at zero, get zero gradients (their activations and the weights reading them are zero) and so stay
# zero under AdamW, clipping and weight decay; the model computes and trains exactly as the unpadded one
# (an export of it writes the padded width, which loads and computes the same).

LLAMA_FIELDS = {  # HF Llama config key -> our model.* field
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "intermediate_size": "d_ff",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}


def layout(m):
    """The Hugging Face layout of model config m's kind (its `hf`), or None."""
    return kinds.kind_class(m.linear).hf


def layouts() -> dict:
    """{kind: its HF layout} for every registered kind that has one, in registration order."""
    return {name: kinds.kind_class(name).hf for name in kinds.names() if kinds.kind_class(name).hf is not None}


# ---------------------------------------------------------------- names


def tensor_names(m):
    """(our param path, layer index or None, HF name, transposed) for every tensor of model config m."""
    yield ("embed",), None, "model.embed_tokens.weight", False
    yield ("final_norm", "scale"), None, "model.norm.weight", False
    if not m.tie_embeddings:
        yield ("lm_head",), None, "lm_head.weight", True
    stored = layout(m).tensors
    for i in range(m.n_layers):
        pre = f"model.layers.{i}."
        yield ("layers", "attn_norm", "scale"), i, pre + "input_layernorm.weight", False
        yield ("layers", "mlp_norm", "scale"), i, pre + "post_attention_layernorm.weight", False
        for block, hf_block, projs in (("attn", "self_attn", "qkvo"), ("mlp", "mlp", ("gate", "up", "down"))):
            for p in projs:
                name = f"{pre}{hf_block}.{p}_proj."
                for param, suffix, transposed in stored:  # the kind's own mapping
                    yield ("layers", block, p, param), i, name + suffix, transposed


def _kv_group(m, name: str) -> int:
    """Query heads per KV head that the file repeats in this tensor (a layout without GQA, e.g. CoLA's)."""
    repeat = layout(m).kv_repeat
    if repeat and name.endswith((f"k_proj.{repeat}", f"v_proj.{repeat}")):
        return m.n_heads // m.n_kv_heads
    return 1


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def to_hf(params: dict, m) -> dict[str, np.ndarray]:
    """Our pure-dict params -> {HF name: float32 array} in the Llama or CoLA layout."""
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)  # one host copy per array
    out = {}
    for path, layer, name, transposed in tensor_names(m):
        x = _get(params, path)
        x = x if layer is None else x[layer]
        g = _kv_group(m, name)
        if g > 1:  # [r, kv*hd] -> [r, heads*hd]: query head j reads KV head j // g, as grouped attention does
            r, width = x.shape
            x = np.repeat(x.reshape(r, m.n_kv_heads, width // m.n_kv_heads), g, axis=1).reshape(r, -1)
        out[name] = np.ascontiguousarray(x.T if transposed else x)  # safetensors writes C order
    return out


def kv_heads_repeated(tensors: dict[str, np.ndarray], m) -> bool:
    """Whether every k/v tensor that a layout without GQA repeats (CoLA's cola_b) holds each KV head's
    columns repeated n_heads/n_kv_heads times."""
    for _, _, name, _ in tensor_names(m):
        g = _kv_group(m, name)
        x = tensors.get(name)
        if g > 1 and x is not None and x.ndim == 2 and x.shape[1] == m.d_model // m.n_heads * m.n_heads:
            x = x.reshape(x.shape[0], m.n_kv_heads, g, -1)
            if not (x == x[:, :, :1]).all():
                return False
    return True


def _ff_padded(name: str, have, want, file_ff: int | None, d_ff: int) -> bool:
    """An MLP tensor whose intermediate axis the import zero-pads from file_ff to d_ff."""
    return (
        file_ff is not None
        and ".mlp." in name
        and len(have) == len(want)
        and all(h == w or (h == file_ff and w == d_ff) for h, w in zip(have, want))
    )


def from_hf(tensors: dict[str, np.ndarray], abstract_params: dict, m, file_d_ff: int | None = None) -> dict:
    """{HF name: array} -> our pure-dict params (numpy) shaped and typed like `abstract_params`.
    With file_d_ff < m.d_ff the MLP's intermediate axis is zero-padded (see the module docstring)."""
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params)
    used, wrong = set(), []
    for path, layer, name, transposed in tensor_names(m):
        if name not in tensors:
            raise ExportError(f"tensor {name} is missing from the safetensors files")
        dst = _get(params, path)
        x = np.asarray(tensors[name])
        x = x.T if transposed else x
        g = _kv_group(m, name)
        if g > 1 and x.ndim == 2 and x.shape[1] == m.n_heads * (m.d_model // m.n_heads):
            x = x.reshape(x.shape[0], m.n_kv_heads, g, -1)[:, :, 0].reshape(x.shape[0], -1)
        want = dst.shape if layer is None else dst.shape[1:]
        if x.shape != want and not _ff_padded(name, x.shape, want, file_d_ff, m.d_ff):
            shown = tuple(tensors[name].shape)
            wrong.append(f"{name}: file {shown} vs expected {want[::-1] if transposed else want}")
            continue
        (dst if layer is None else dst[layer])[tuple(slice(0, n) for n in x.shape)] = x
        used.add(name)
    # Old HF checkpoints store the RoPE table; a tied model may still carry its head.
    extra = [
        f"unexpected {k}"
        for k in sorted(set(tensors) - used)
        if not k.endswith("rotary_emb.inv_freq") and k != "lm_head.weight"
    ]
    if wrong or extra:
        raise ExportError("safetensors do not fit the config: " + "; ".join(wrong[:8] + extra[:8]))
    return params


# ---------------------------------------------------------------- configs


def hf_config(m, eos_id=None) -> dict:
    """config.json for model config m: the LlamaForCausalLM frame, completed by its kind's layout
    (e.g. an official-layout ColaForCausalLM)."""
    c = {hf: m[ours] for hf, ours in LLAMA_FIELDS.items()}
    c.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        head_dim=m.d_model // m.n_heads,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        rope_theta=float(m.rope_theta),
        # transformers >= 5 reads rope_parameters, older versions rope_theta; both say the same.
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        rope_scaling=None,
        torch_dtype="float32",
        dtype="float32",
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
        tie_word_embeddings=bool(m.tie_embeddings),
        rms_norm_eps=float(m.norm_eps),
        attention_dropout=0.0,
        pretraining_tp=1,
        initializer_range=float(m.init_std),
        use_cache=True,
    )
    c.update(layout(m).config(m))
    return c


REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def model_fields(hf: dict, source: str = "config.json") -> dict:
    """HF config.json -> our model.* fields; rejects variants this model cannot represent. The kind is
    the registered one whose layout (its `hf`) has this model_type and `select` value, and the layout
    reads its own fields (CoLA's as the official code reads them, missing fields taking its defaults);
    the sizes in REQUIRED_FIELDS have no default (`source` names the file in the error)."""
    if not isinstance(hf, dict):
        raise ExportError(f"{source}: holds {type(hf).__name__}, not a JSON object of config fields")
    for key in REQUIRED_FIELDS:
        if key not in hf:
            raise ExportError(
                f"{source}: required field `{key}` is missing; add it (the model's "
                "config.json from where it was trained has it)"
            )
        if isinstance(hf[key], bool) or not isinstance(hf[key], int) or hf[key] < 1:
            raise ExportError(f"{source}: field `{key}` must be a positive integer, got {hf[key]!r}")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kv = hf.get("num_key_value_heads") or h
    known = layouts()
    types = list(dict.fromkeys(lay.model_type for lay in known.values()))
    family = {name: lay for name, lay in known.items() if lay.model_type == hf.get("model_type")}
    linear = next((name for name, lay in family.items() if lay.selected(hf) == lay.select[1]), None)
    chosen = known.get(linear)
    fields = {ours: hf[key] for key, ours in LLAMA_FIELDS.items() if key in hf}
    fields["n_kv_heads"] = kv
    fields["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    fields["linear"] = linear
    fields.update(chosen.fields(hf) if chosen else {})
    problems = [
        (hf.get("model_type") not in types, f"model_type={hf.get('model_type')!r} ({' or '.join(map(str, types))})"),
        (hf.get("head_dim") not in (None, d // h), f"head_dim={hf.get('head_dim')} != hidden_size/heads={d // h}"),
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')!r} (only silu)"),
        (bool(hf.get("attention_bias") or hf.get("mlp_bias")), "attention/mlp biases"),
        (
            rope.get("rope_type", "default") != "default"
            or scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None),
            "RoPE scaling",
        ),
    ]
    if family and chosen is None:  # a model_type several kinds share, told apart by a field none matches
        first = next(iter(family.values()))
        problems.append(
            (
                True,
                f"{first.select[0]}={first.selected(hf)!r} "
                f"({' or '.join(str(lay.select[1]) for lay in family.values())})",
            )
        )
    problems += [(True, why) for why in (chosen.problems(hf, fields) if chosen else [])]
    bad = [why for cond, why in problems if cond]
    if bad:
        raise ExportError("cannot import this model: " + ", ".join(bad))
    return fields


def export(checkpoint: str, out: str, supersede: bool = False) -> Path:
    """Write config.json, model.safetensors (and the tokenizer file, if any) for a run's checkpoint.
    `out` may be new, empty or an earlier export (its files are replaced); files a loader would read
    beside the new model that this export does not write (another model's tokenizer or weights) are
    refused, or with `supersede` renamed to NAME.superseded."""
    from flax import nnx

    st = safetensors_numpy()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out: {out} is a file; give a directory to write the model into")
    model, cfg, tok = load_model(checkpoint)  # refuses damaged or non-finite weights
    if layout(cfg.model) is None:
        raise ExportError(
            f"model.linear={cfg.model.linear} has no Hugging Face layout; export supports {', '.join(layouts())}"
        )
    spec = cfg.data.tokenizer
    tok_name = None if spec in ("", "byte") else ("tokenizer.json" if spec.endswith(".json") else "tokenizer.model")
    ours = {"config.json", "model.safetensors", *([tok_name] if tok_name else [])}
    stale = (
        sorted(
            p.name
            for p in out.iterdir()
            if p.name not in ours and ".superseded" not in p.name and not p.name.endswith(".tmp")
        )
        if out.is_dir()
        else []
    )
    if stale and not supersede:
        raise ExportError(
            f"--out: {out} holds files this export does not write ({', '.join(stale[:6])}"
            f"{' ...' if len(stale) > 6 else ''}), which a loader would read beside the new model; "
            "choose a new or empty --out, or pass --supersede to rename them to NAME.superseded"
        )
    tensors = to_hf(nnx.to_pure_dict(nnx.state(model)), cfg.model)
    hf = json.dumps(hf_config(cfg.model, tok.eos_id), indent=2) + "\n"
    files = {
        "model.safetensors": lambda p: save_safetensors(st, tensors, p),
        "config.json": lambda p: p.write_text(hf),
    }
    if tok_name:  # the byte tokenizer needs no file: token id = UTF-8 byte
        files[tok_name] = lambda p: shutil.copyfile(spec, p)
    write_all(out, files)
    for name in stale:
        print(f"moved {out / name} (not part of this export) aside to {move_aside(out / name)}")
    return out


def _check_import_out(run_dir: Path, supersede: bool) -> None:
    """An import writes a new run: into a new or empty --out, or with `supersede` over an old run
    (whose checkpoints are then renamed aside, never deleted)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ExportError(f"--out: {run_dir} is a file; give a directory for the imported run")
    ckpts = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []
    # The lock and a checkpoints/ dir without steps (one left by a failed import) are no run.
    names = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    held = [n for n in names if n not in (".lock", "checkpoints")] + (["checkpoints"] if steps else [])
    if not held or supersede:
        return
    what = (
        f"a run with checkpoints (steps {steps}) that the imported step 0 would mix with"
        if steps
        else f"files ({', '.join(held[:6])}{' ...' if len(held) > 6 else ''})"
    )
    raise ExportError(
        f"--out: {run_dir} already holds {what}; choose a new or empty --out, or pass --supersede "
        "to move its checkpoints aside as N.superseded"
    )


def _tokenizer_file(path: Path) -> None:
    """Load a tokenizer file once (a truncated download or a corrupt model fails here, naming it)."""
    try:
        load_tokenizer(str(path), field="--import-hf")
    except (ValueError, ImportError) as e:
        raise ExportError(str(e)) from None


def import_hf(
    hf_dir: str, run_dir: str, seed: int = 0, intermediate_multiple: int = 1, supersede: bool = False
) -> tuple[Path, object]:
    """HF Llama or CoLA dir -> RUN_DIR/checkpoints/0 with fresh optimizer state; intermediate_size is
    zero-padded up to a multiple of `intermediate_multiple`. RUN_DIR must be new or empty, unless
    `supersede`: then its checkpoints (and a tokenizer file the import replaces) are renamed aside.
    Returns (checkpoint dir, the run config to train or sample with)."""
    hf_dir, run_dir = Path(hf_dir), Path(run_dir).resolve()
    _check_import_out(run_dir, supersede)
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"no *.safetensors in {hf_dir}")
    if intermediate_multiple < 1:
        raise ExportError(f"--intermediate-multiple must be >= 1, got {intermediate_multiple}")
    # The small config.json first: a bad one fails before gigabytes of tensors are read.
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ExportError(
            f"{config_path} does not exist: --import-hf needs the model's config.json beside its *.safetensors"
        )
    try:
        hf = json.loads(config_path.read_text())
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ExportError(f"{config_path}: not readable JSON ({e}); fetch or export it again") from e
    fields = model_fields(hf, str(config_path))
    tensors = {}
    for f in files:
        tensors.update(load_safetensors(f))
    cfg = base_config()
    cfg.run_dir = str(run_dir)
    cfg.model.update(fields)
    cfg.train.update(dict(layout(cfg.model).train))  # the layout's recipe (CoLA's: its AdamW betas)
    if not kv_heads_repeated(tensors, cfg.model):  # trained on without GQA: keep every head's k/v
        cfg.model.n_kv_heads = cfg.model.n_heads
    file_d_ff = cfg.model.d_ff
    cfg.model.d_ff = -(-file_d_ff // intermediate_multiple) * intermediate_multiple
    cfg.train.seq_len = min(cfg.train.seq_len, cfg.model.max_seq_len)
    tok_name = next((n for n in ("tokenizer.json", "tokenizer.model") if (hf_dir / n).is_file()), None)
    if tok_name:  # else the byte tokenizer (ids 0..255)
        _tokenizer_file(hf_dir / tok_name)
        cfg.data.tokenizer = str(run_dir / tok_name)
    validate(cfg)

    # Build the state on one device; a checkpoint restores onto any mesh later.
    one = cfg.copy_and_resolve_references()
    one.parallel.update(data=1, fsdp=1, tensor=1)
    built = build(one, jax.devices()[:1], validated=True)  # cfg validated above; one device fits any
    spec, tx = built.spec, built.tx
    params = jax.device_put(from_hf(tensors, spec.abstract["params"], cfg.model, file_d_ff), spec.shardings["params"])
    state = {
        "params": params,
        "opt_state": jax.jit(tx.init, out_shardings=spec.shardings["opt_state"])(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32),
    }
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir).acquire()  # a trainer running in --out refuses the import
    except OSError as e:
        raise ExportError(f"--out: cannot write {run_dir} ({reason(e)}); choose a writable --out") from None
    try:
        _check_import_out(run_dir, supersede)  # again, under the lock
        # owner: a failed save's partial files are removed, and Orbax's own tracebacks are not printed.
        ckpt = Checkpointer(
            run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=False, owner=True, hint="--import-hf again"
        )
        try:
            ckpt.move_newer_aside(None, why="superseded by --import-hf")
            if tok_name and (run_dir / tok_name).exists():
                print(f"moved {run_dir / tok_name} aside to {move_aside(run_dir / tok_name)}")
            if tok_name:
                try:
                    shutil.copyfile(hf_dir / tok_name, run_dir / tok_name)
                except OSError as e:
                    raise ExportError(
                        f"--out: cannot write {run_dir / tok_name} ({reason(e)}); free some space "
                        "or choose a writable --out"
                    ) from None
            ckpt.save(
                0, state, {"data_position": 0, "step": 0, "config": json.loads(cfg.to_json_best_effort())}, force=True
            )
        finally:
            ckpt.close()
    finally:
        lock.release()
    return run_dir / "checkpoints" / "0", cfg


def train_flags(cfg) -> str:
    """The --config.* flags that rebuild cfg's model, data and train fields from the defaults, so that
    `python -m boost_jax.train` can resume from an imported checkpoint."""
    base = base_config()
    return " ".join(
        f"--config.{section}.{k}={cfg[section][k]}"
        for section in ("model", "data", "train")
        for k in sorted(cfg[section].keys())
        if cfg[section][k] != base[section][k]
    )


def main(argv=None) -> int:
    xla_gpu_flags.quiet_gpu_plugin()  # before JAX starts its backends
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="export: a run dir, its checkpoints/ dir, or one step dir")
    src.add_argument("--import-hf", metavar="HF_DIR", help="import: a HF Llama or CoLA (model_type cola) dir")
    ap.add_argument("--out", required=True, help="export: the HF dir to write; import: the run dir to write")
    ap.add_argument("--format", default="hf", choices=("hf",), help="export format (only hf)")
    ap.add_argument(
        "--supersede",
        action="store_true",
        help="import: --out may hold a run, whose checkpoints move aside as N.superseded; export: "
        "files in --out this export does not write move aside as NAME.superseded",
    )
    ap.add_argument(
        "--intermediate-multiple",
        type=int,
        default=1,
        metavar="M",
        help="import: zero-pad intermediate_size up to a multiple of M (inert) so that "
        "parallel.tensor sizes dividing M can split the MLP",
    )
    args = ap.parse_args(argv)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        if args.checkpoint:
            out = export(args.checkpoint, args.out, supersede=args.supersede)
            print(f"wrote {out}/config.json and {out}/model.safetensors")
        else:
            step_dir, cfg = import_hf(
                args.import_hf, args.out, intermediate_multiple=args.intermediate_multiple, supersede=args.supersede
            )
            if cfg.model.d_ff % 2:
                print(
                    f"note: model.d_ff={cfg.model.d_ff} is odd, so parallel.tensor > 1 cannot split the MLP; "
                    "--intermediate-multiple M zero-pads it (inert) to a multiple of M"
                )
            print(
                f"wrote {step_dir} (step 0, fresh optimizer state)\n"
                f"sample: python -m boost_jax.generate --checkpoint {args.out}\n"
                f"train:  python -m boost_jax.train --config.run_dir={args.out} {train_flags(cfg)}"
            )
    except (ExportError, ConfigError, CheckpointError, RunDirBusy, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
