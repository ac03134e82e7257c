"""The project's train step beside PyTorch's at the same widths and shapes: one JSON, one table.

    python benchmarks/vs_torch.py [--models cola_1b,llama_1b] [--seq 256] [--batch 32] [--steps 10]
        [--rows project,project_bf16,cola,cola_compile,hf,hf_compile] [--cola-repo PATH] [--json PATH]
    python benchmarks/vs_torch.py --smoke     # tiny widths on any backend: checks the command runs

Rows (each in a fresh process, so each peak memory is its own; a row that cannot run says why):

- project: `runtime.build` on the zoo config (its `auto` defaults), float32 parameters and AdamW state,
  compute in the device's dtype (bf16 on a GPU); project_bf16: `model.param_dtype=bfloat16`
  (parameters and AdamW state in bf16, as the official CoLA recipe trains).
- cola / cola_compile (CoLA models): the official CoLA PyTorch code from a checkout (`--cola-repo`,
  its `cola/` package and `cola_configs/NAME.json`), `ColaForCausalLM` at the zoo config's widths, in
  bf16 as its `main.py` trains (`model.to(bfloat16)`: parameters and AdamW state in bf16), sdpa
  attention; `_compile` adds the one line a user adds, `torch.compile(model)`.
- hf_cola / hf_cola_compile (CoLA models, no checkout needed): Hugging Face `LlamaForCausalLM` at the
  zoo config's widths with every projection (q, k, v, o, gate, up, down) replaced by CoLA's layer
  B·σ(A·x) (σ = SiLU, rank r, no bias) and, where the config says `only_lr_act`, the MLP's own SiLU
  removed (down(gate ⊙ up)): the official model's math, written here as a stand-in where its code is
  not at hand; bf16 and sdpa as the cola rows.
- hf / hf_compile (dense models): Hugging Face `LlamaForCausalLM` at the zoo config's widths, sdpa,
  bf16 as above.

Every row: random tokens, `--warmup` untimed steps, then `--steps` timed steps of a full optimizer
step (AdamW, betas (0.9, 0.999), weight decay 0.01, global-norm clip 0.5), one device, no
accumulation. MFU counts the same model FLOPs for every row (`boost_jax.model.flops_per_token`).
Needs torch and transformers for the torch rows (`pip install torch transformers`; on a CPU host
`pip install torch==2.13.0` takes the CPU build); the project rows need nothing more.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ROWS = ("project", "project_bf16", "cola", "cola_compile", "hf_cola", "hf_cola_compile", "hf", "hf_compile")
FAMILY = {
    "project": None,
    "project_bf16": None,
    "cola": "cola",
    "cola_compile": "cola",
    "hf_cola": "cola",
    "hf_cola_compile": "cola",
    "hf": "llama",
    "hf_compile": "llama",
}
SMOKE = dict(d_model=64, d_ff=128, n_heads=4, n_kv_heads=4, rank=16, vocab_size=256, n_layers=2)
PRECISION = {
    "project": "fp32 params + AdamW state, bf16 compute (on GPU)",
    "project_bf16": "bf16 params + AdamW state",
    "cola": "bf16 params + AdamW state",
    "cola_compile": "bf16 params + AdamW state",
    "hf_cola": "bf16 params + AdamW state",
    "hf_cola_compile": "bf16 params + AdamW state",
    "hf": "bf16 params + AdamW state",
    "hf_compile": "bf16 params + AdamW state",
}


def model_config(name: str, seq: int, batch: int, smoke: bool):
    from boost_jax.config import load_config_file

    cfg = load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
    if smoke:
        cfg.model.update(SMOKE)
    cfg.model.max_seq_len = max(int(cfg.model.max_seq_len), seq)
    cfg.train.update(seq_len=seq, global_batch=batch, grad_accum=1, grad_clip=0.5, b1=0.9, b2=0.999, weight_decay=0.01)
    cfg.parallel.update(data=1, fsdp=1, tensor=1, num_devices=1)
    cfg.data.source, cfg.data.batching = "embedded", "stream"
    return cfg


# ------------------------------------------------------------------------------------------ the rows


def project_row(cfg, steps: int, warmup: int, bf16: bool) -> dict:
    import jax
    import numpy as np

    from boost_jax.model import autos
    from boost_jax.runtime.build import build
    from boost_jax.tools.aot import peak_bytes

    sys.path.insert(0, HERE)
    from step_time import timed_steps

    if bf16:
        cfg.model.param_dtype = "bfloat16"
    built = build(cfg, jax.devices()[:1])
    rng = np.random.default_rng(0)
    t = cfg.train
    tokens = jax.device_put(
        rng.integers(0, cfg.model.vocab_size, (1, t.global_batch, t.seq_len + 1), np.int32), built.batch_sharding
    )
    state = built.init_state()
    t0 = time.perf_counter()
    step = built.train_step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - t0
    state, metrics, secs = timed_steps(step, state, tokens, warmup, steps)
    mem = step.memory_analysis()
    return {
        "step_s": secs,
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "params": int(sum(x.size for x in jax.tree.leaves(state["params"]))),
        "peak_gib": peak_bytes(mem) / 2**30 if mem is not None else None,
        "device": jax.devices()[0].device_kind,
        "auto": {k: str(v) for k, v in autos.chosen(cfg, built.mesh).items()},
    }


def _torch_model(row: str, cfg, cola_repo: str | None):
    """The PyTorch model of a torch row, at cfg's widths (None, why: when it cannot be built)."""
    m = cfg.model
    common = dict(
        hidden_size=int(m.d_model),
        intermediate_size=int(m.d_ff),
        num_hidden_layers=int(m.n_layers),
        num_attention_heads=int(m.n_heads),
        num_key_value_heads=int(m.n_kv_heads),
        vocab_size=int(m.vocab_size),
        max_position_embeddings=int(m.max_seq_len),
        rms_norm_eps=float(m.norm_eps),
        rope_theta=float(m.rope_theta),
        tie_word_embeddings=False,
    )
    if FAMILY[row] == "llama" or row.startswith("hf_cola"):
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="sdpa"))
        if row.startswith("hf_cola"):
            _to_cola(model, int(m.rank), bool(m.only_lr_act))
        return model, None
    if not cola_repo:
        return None, "needs --cola-repo PATH (a checkout of the official CoLA code)"
    sys.path.insert(0, os.path.abspath(cola_repo))
    from cola.configuration_cola import ColaConfig
    from cola.modeling_cola import ColaForCausalLM

    path = os.path.join(cola_repo, "cola_configs", f"{cfg.name}.json")
    hf = ColaConfig.from_json_file(path) if os.path.isfile(path) else ColaConfig()
    for key, value in {**common, "rank": int(m.rank), "only_lr_act": bool(m.only_lr_act)}.items():
        setattr(hf, key, value)
    hf._attn_implementation = "sdpa"
    return ColaForCausalLM(hf), None


def _to_cola(model, rank: int, only_lr_act: bool) -> None:
    """Every projection of `model`'s blocks becomes CoLA's B·σ(A·x) (in place); only_lr_act drops the
    MLP's own activation, as the official code does from 350M up (../shared/reference/cola.md)."""
    import torch

    class Cola(torch.nn.Module):
        def __init__(self, d_in: int, d_out: int):
            super().__init__()
            scale = rank ** (-0.25) * (d_in + d_out) ** (-0.25)  # the official init of each factor
            self.a = torch.nn.Parameter(torch.randn(rank, d_in) * scale)
            self.b = torch.nn.Parameter(torch.randn(d_out, rank) * scale)

        def forward(self, x):
            return torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, self.a)), self.b)

    for layer in model.model.layers:
        for block, names in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
        ):
            for name in names:
                lin = getattr(block, name)
                setattr(block, name, Cola(lin.in_features, lin.out_features))
        if only_lr_act:
            layer.mlp.act_fn = torch.nn.Identity()


def torch_row(row: str, cfg, steps: int, warmup: int, cola_repo: str | None) -> dict:
    import torch

    model, why = _torch_model(row, cfg, cola_repo)
    if model is None:
        return {"error": why}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device=device, dtype=torch.bfloat16)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(t.b1, t.b2), weight_decay=t.weight_decay)
    fwd = torch.compile(model) if row.endswith("_compile") else model
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, int(cfg.model.vocab_size), (t.global_batch, t.seq_len + 1), generator=gen).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        logits = fwd(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(max(warmup, 1)):  # the first includes torch.compile's compile
        loss = step()
    sync()
    compile_s = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    secs = (time.perf_counter() - t0) / steps
    return {
        "step_s": secs,
        "compile_s": compile_s,
        "loss": float(loss),
        "params": sum(p.numel() for p in model.parameters()),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def one_row(row: str, name: str, args) -> dict:
    cfg = model_config(name, args.seq, args.batch, args.smoke)
    if row.startswith("project"):
        return project_row(cfg, args.steps, args.warmup, bf16=row == "project_bf16")
    return torch_row(row, cfg, args.steps, args.warmup, args.cola_repo)


# -------------------------------------------------------------------------------------------- driving


def rows_for(name: str, rows: list[str]) -> list[str]:
    """The rows that apply to a model: the project's, and the torch code of its family."""
    family = "llama" if name.startswith("llama") else "cola"
    return [r for r in rows if FAMILY[r] in (None, family)]


def run_row(row: str, name: str, args) -> dict:
    """One row in a fresh process: its JSON, or the last line it printed on failure."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        f"{row}:{name}",
        "--seq",
        str(args.seq),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--cola-repo", args.cola_repo] if args.cola_repo else []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9"),
    }
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.row_timeout} s"}
    found = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if found:
        return found[-1]
    tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
    return {"error": tail[:300]}


def table(res: dict) -> str:
    from boost_jax.runtime.metrics import peak_flops

    lines = [
        f"seq {res['seq']} x batch {res['batch']} | row | precision | step ms | tokens/s | MFU | peak GiB | vs project",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in res["models"].items():
        base = rows.get("project", {}).get("step_s")
        for row, r in rows.items():
            if "error" in r:
                lines.append(f"| {name} | {row} | {PRECISION[row]} | failed: {r['error']} |||||")
                continue
            tok_s = res["seq"] * res["batch"] / r["step_s"]
            peak = peak_flops(r.get("device", ""))
            mfu = f"{100 * r['flops_per_token'] * tok_s / peak:.1f}%" if peak else "n/a"
            gib = "n/a" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
            ratio = f"{r['step_s'] / base:.2f}x" if base else "n/a"
            lines.append(
                f"| {name} | {row} | {PRECISION[row]} | {1e3 * r['step_s']:.1f} | {tok_s:,.0f} | {mfu} | "
                f"{gib} | {ratio} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cola_1b,llama_1b", help="zoo config names")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    ap.add_argument("--cola-repo", help="a checkout of the official CoLA code (its cola/ package)")
    ap.add_argument("--row-timeout", type=int, default=900, help="seconds one row may take")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny widths, seq 32 x batch 2, 2 steps: checks the command on any backend (not a measurement)",
    )
    ap.add_argument("--json", help="output (default benchmarks/vs_torch.json; --smoke: in the temp directory)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: ROW:MODEL in this process, print its JSON
    args = ap.parse_args(argv)
    if args.smoke:
        args.seq, args.batch, args.steps, args.warmup = 32, 2, 2, 1
    if args.one:
        row, name = args.one.split(":")
        from boost_jax.model import flops_per_token

        out = one_row(row, name, args)
        out["flops_per_token"] = flops_per_token(model_config(name, args.seq, args.batch, args.smoke).model, args.seq)
        print(json.dumps(out), flush=True)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        ap.error(f"--rows: unknown {unknown}; choose from {','.join(ROWS)}")
    path = args.json or (
        os.path.join(tempfile.gettempdir(), "vs_torch_smoke.json")
        if args.smoke
        else os.path.join(HERE, "vs_torch.json")
    )
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "smoke": args.smoke,
        "precision": PRECISION,
        "models": {},
    }
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        res["models"][name] = {}
        for row in rows_for(name, rows):
            res["models"][name][row] = run_row(row, name, args)
            r = res["models"][name][row]
            print(f"  {name} {row}: " + (f"{1e3 * r['step_s']:.1f} ms" if "step_s" in r else r["error"]), flush=True)
            with open(path, "w") as f:  # after every row: a run cut short keeps what it measured
                json.dump(res, f, indent=2)
    print(table(res) + ("\n[--smoke: tiny widths, not a measurement]" if args.smoke else ""))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
