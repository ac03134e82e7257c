"""Will it fit? The zoo's recipe runs compiled for H100s this host does not have (deviceless), next to
the planner's prediction.

    python benchmarks/aot_fit.py [--json benchmarks/aot_fit.json] [--markdown benchmarks/aot_fit.md]
    python benchmarks/aot_fit.py --models cola_1b --devices 8 --smallest   # one model; smallest fitting mesh
    python benchmarks/aot_fit.py --smoke       # the tiny config on 2 H100s: checks the command
    python benchmarks/aot_fit.py --recompile benchmarks/aot_fit.json --only cola_7b:8 --json /tmp/fit.json
    python benchmarks/aot_fit.py --smallest --reuse /tmp/fit.json --json benchmarks/aot_fit.json
    python benchmarks/aot_fit.py --target a100_40gb --cluster configs/clusters/a100_4x.py \
        --json benchmarks/aot_fit_a100.json --markdown benchmarks/aot_fit_a100.md   # 40 GB A100s

For each model and GPU count the planner (`boost_jax.plan`, cluster configs/clusters/h100_8x.py, the
config's recipe batch and sequence) picks the best plan the trainer runs; that plan's overrides are
applied to the config and its train step is compiled for that many H100s without them
(`boost_jax.tools.aot`): the compiled peak per GPU, whether it fits 90% of the 80 GB
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.9, the cluster's usable share), the planner's own peak for the same
plan with their ratio, and the planner's step ms beside the step-time table's for the compiled program
(`table_ms`: tools/step_profile on the program compiled under the GPU's memory budget, the one it runs).
`--target` and `--cluster` pick another GPU and the
cluster the planner plans for (keep the two the same part: a100_40gb with a100_4x.py, whose GPUs have
40 GB). `--smallest` also finds, per model, the fewest GPUs (powers of two) on which the planner's best
plan compiles within the usable memory. `--recompile` compiles a json's plans again with this checkout
(`--only` some of its rows), `--reprice` prices them again without a compile, and `--reuse` takes the
compiles of jsons this checkout wrote, so that a table re-run compiles only the picks that changed.
Needs the aot extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("cola_1b", "llama_1b", "cola_7b", "llama_7b", "cola_13b", "llama_13b")
DEVICES = (8, 64)
CLUSTER = ROOT / "configs" / "clusters" / "h100_8x.py"
TARGET = "h100"
LABELS = {"h100": "H100", "h200": "H200", "a100": "A100 80GB", "a100_40gb": "A100 40GB"}  # table headers
GB = 1e9


def plan(config: Path, devices: int, batch: int | None = None, seq: int | None = None, cluster: Path = CLUSTER):
    """The planner's best runnable plan for `config` on `devices` GPUs of `cluster` (None when nothing fits)."""
    from boost_jax.planner import Options, load_cluster, search
    from boost_jax.planner.search import model_flops_per_token
    from boost_jax.tools.devices import load_config

    cfg = load_config(str(config))
    batch, seq = batch or int(cfg.train.global_batch), seq or int(cfg.train.seq_len)
    res = search(
        cfg,
        load_cluster(str(cluster)),
        devices,
        Options(batch=batch, seq=seq),
        flops_per_token=model_flops_per_token(cfg, seq),
    )
    return res.best_runnable


def overrides_of(plan) -> list[str]:
    return [a for a in plan.overrides.split() if a.startswith("--config.")]


def row(
    config: Path,
    devices: int,
    batch: int | None = None,
    seq: int | None = None,
    target: str = TARGET,
    cluster: Path = CLUSTER,
) -> dict:
    from boost_jax.tools import aot

    best = plan(config, devices, batch, seq, cluster)
    out = {"model": config.stem, "devices": devices}
    if best is None:
        return {**out, "plan": None}
    flags = overrides_of(best)  # the plan's mesh, strategy, batch, accumulation, sequence and remat
    cfg = aot.load(str(config), flags)
    t0 = time.perf_counter()
    rep = REUSE.get((config.stem, devices, target, " ".join(f.removeprefix("--config.") for f in flags)))
    rep = rep or compile_pick(cfg, target, devices)
    train = rep["train"]
    return {
        **out,
        "device_kind": rep["device_kind"],
        "planner_parts": best.memory,
        "plan": " ".join(f.removeprefix("--config.") for f in flags),
        "mesh": rep["mesh"],
        "planner_bytes": best.memory["total"],
        "peak_bytes": train["peak_bytes"],
        "argument_bytes": train["argument_bytes"],
        "temp_bytes": train["temp_bytes"],
        "usable_bytes": train["usable_bytes"],
        "fits": train["fits"],
        "ratio": best.memory["total"] / train["peak_bytes"],
        "compile_s": time.perf_counter() - t0,
        "kernels": train["kernels"],
        **step_ms(best, rep),
    }


def compile_pick(cfg, target: str, devices: int) -> dict:
    """A plan's train step compiled twice: the plain deviceless compile (its memory, which the memory model
    is checked against) and the compile under the GPU's memory budget, whose step-time table prices the
    program the GPU runs (`aot.compile_config(profile=True)`: near the memory limit the deviceless
    budget makes XLA rematerialize kernels the GPU does not run)."""
    from boost_jax.tools import aot  # lazy: the aot extra loads JAX

    rep = aot.compile_config(cfg, target, devices, programs=("train",))
    rep["profile"] = aot.compile_config(cfg, target, devices, programs=("train",), profile=True)["profile"]
    return rep


def step_ms(priced, rep: dict) -> dict:
    """The planner's step ms of a plan beside the step-time table's of its compile under the GPU's budget
    (`table_ms`, where the compile was priced: `compile_pick`)."""
    out = {"planner_ms": priced.step_s * 1e3}
    if rep.get("profile"):
        out["table_ms"] = rep["profile"]["predicted_step_s"] * 1e3
    return out


# (model, GPUs, target, plan flags) -> a compile recorded by an earlier run (--reuse): taken, not compiled again
REUSE: dict = {}


def reuse(paths: str) -> None:
    """--reuse: the compiled numbers of the rows these jsons hold, for a plan compiled with this checkout."""
    for path in paths.split(","):
        d = json.loads(Path(path).read_text())
        for r in d["rows"] + d["smallest"]:
            if r.get("plan") and "device_kind" in r:
                train = {k: r[k] for k in ("peak_bytes", "argument_bytes", "temp_bytes", "usable_bytes", "fits")}
                train["kernels"] = r.get("kernels", [])
                REUSE[(r["model"], r["devices"], d["target"], r["plan"])] = {
                    "device_kind": r["device_kind"],
                    "mesh": r["mesh"],
                    "train": train,
                    **({"profile": {"predicted_step_s": r["table_ms"] / 1e3}} if "table_ms" in r else {}),
                }


# Fixed plans at long sequences (seq 2048, global batch 8, bf16, cuDNN attention, the Pallas norm, one
# document per row, no remat): (config, pipeline x data x fsdp x tensor, strategy).
FIXED = (
    ("cola_1b", (1, 1, 1, 1), "btp"),
    ("cola_7b", (1, 1, 1, 8), "btp"),
    ("cola_7b", (1, 1, 2, 4), "btp"),
    ("llama_7b", (1, 1, 1, 8), "megatron"),
    ("cola_1b", (1, 1, 8, 1), "btp"),
    ("llama_1b", (1, 1, 1, 1), "btp"),
)
FIXED_BATCH, FIXED_SEQ = 8, 2048


def fixed_row(
    name: str,
    mesh: tuple,
    strategy: str,
    batch: int = FIXED_BATCH,
    seq: int = FIXED_SEQ,
    target: str = TARGET,
    cluster: Path = CLUSTER,
) -> dict:
    """One FIXED plan: the planner's price of exactly this trainer plan next to its H100 compile."""
    from boost_jax.config import PROJECTION_GROUPS
    from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for
    from boost_jax.planner.ops.strategy_tables import uniform_plan
    from boost_jax.tools import aot

    config = ROOT / "configs" / f"{name}.py"
    p, d, f, t = mesh
    flags = [
        f"--config.parallel.pipeline={p}",
        f"--config.parallel.data={d}",
        f"--config.parallel.fsdp={f}",
        f"--config.parallel.tensor={t}",
        f"--config.parallel.strategy={strategy}",
        f"--config.train.global_batch={batch}",
        "--config.train.grad_accum=1",
        f"--config.train.seq_len={seq}",
        f"--config.model.max_seq_len={max(seq, 4096)}",
        "--config.model.attention=cudnn",
        "--config.kernels.rmsnorm=pallas",
        "--config.model.dtype=bfloat16",
        "--config.remat.policy=none",
        # the program the planner prices (the scanned layers; grouped linears, as when these rows were fitted)
        "--config.model.scan_unroll=false",
        "--config.model.group_linears=true",
    ]
    cfg = aot.load(str(config), flags)
    layer = (
        Layer(*uniform_plan(strategy, False))
        if t > 1
        # one tensor shard: nothing is split
        else Layer("R", ("none",) * len(PROJECTION_GROUPS), "R", "R")
    )
    priced = plan_for(
        cfg,
        load_cluster(str(cluster)),
        Mesh(d, f, t, pipeline=p),
        1,
        "none",
        layer,
        Options(batch=batch, seq=seq, attention="cudnn", check_memory=False),
    )
    t0 = time.perf_counter()
    rep = compile_pick(cfg, target, p * d * f * t)
    return {
        "model": name,
        "devices": p * d * f * t,
        "plan": " ".join(a.removeprefix("--config.") for a in flags),
        "mesh": dict(zip(("pipeline", "data", "fsdp", "tensor"), mesh)),
        **compared(priced, rep["train"], t0),
        **step_ms(priced, rep),
    }


def compared(priced, train: dict, t0: float) -> dict:
    """A row's planner memory beside its compiled program's (started at perf_counter() t0)."""
    return {
        "planner_bytes": priced.memory["total"],
        "planner_parts": priced.memory,
        "peak_bytes": train["peak_bytes"],
        "argument_bytes": train["argument_bytes"],
        "temp_bytes": train["temp_bytes"],
        "usable_bytes": train["usable_bytes"],
        "fits": train["fits"],
        "ratio": priced.memory["total"] / train["peak_bytes"],
        "compile_s": time.perf_counter() - t0,
    }


def reprice(r: dict, cluster: Path = CLUSTER, pipelined: list | None = None):
    """The planner's price now of a recorded row's plan (its `plan` flags on its model's config, on its
    mesh; no search, no compile): the Plan, whose memory["total"] compares with the row's compiled
    `peak_bytes`. `pipelined`: the collective pipeliner's options the row was compiled with (the
    json's `pipelined_collectives`; None: this process's)."""
    from boost_jax.config import PROJECTION_GROUPS, ST
    from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for
    from boost_jax.planner.pricing.cost import PIPELINER_NEEDS
    from boost_jax.planner.verify import uniform_layer
    from boost_jax.tools.devices import load_config

    flags = r["plan"].split()
    cfg = load_config(str(ROOT / "configs" / f"{r['model']}.py"))
    for flag in flags:
        key, _, value = flag.partition("=")
        section, name = key.split(".")
        old = cfg[section][name]
        cfg[section][name] = (value == "true") if isinstance(old, bool) else type(old)(value)
    p, t = cfg.parallel, cfg.train
    m = r["mesh"]
    mesh = Mesh(m["data"], m["fsdp"], m["tensor"], pipeline=m["pipeline"], context=m.get("context", 1))
    layer = (
        uniform_layer(cfg, p.strategy, bool(p.sequence_parallel))
        if mesh.tensor > 1
        else Layer("R", ("none",) * len(PROJECTION_GROUPS), "R", "R")  # one tensor shard: nothing is split
    )
    st = str(p.linear_partition)  # the plan's spatial-temporal groups ("st": all of them; "mlp_in=st,...")
    if st:
        groups = PROJECTION_GROUPS if st == ST else [g.split("=")[0] for g in st.split(",")]
        choices = tuple(ST if g in groups else c for g, c in zip(PROJECTION_GROUPS, layer.choices))
        layer = dataclasses.replace(layer, choices=choices)
    opts = Options(
        batch=int(t.global_batch),
        seq=int(t.seq_len),
        attention=str(cfg.model.attention),
        check_memory=False,
        pipelined=None if pipelined is None else set(PIPELINER_NEEDS) <= set(pipelined),
    )
    return plan_for(
        cfg,
        load_cluster(str(cluster)),
        mesh,
        int(t.grad_accum),
        str(cfg.remat.policy),
        layer,
        opts,
        1.0,
        microbatches=int(p.microbatches),
        schedule=str(p.pipeline_schedule),
        repeats=int(p.pipeline_repeats),
        stage_remat=str(cfg.remat.pipeline),
        unrolled=str(cfg.model.scan_unroll).lower() == "true",  # the flag reads back as a string over `auto`
    )


def recompile(r: dict, target: str, cluster: Path, pipelined: list | None) -> dict:
    """A recorded row's plan compiled again with this checkout's program and priced again (`reprice`)."""
    from boost_jax.tools import aot

    flags = [f"--config.{f}" for f in r["plan"].split()]
    t0 = time.perf_counter()
    rep = compile_pick(aot.load(str(ROOT / "configs" / f"{r['model']}.py"), flags), target, r["devices"])
    priced = reprice(r, cluster, pipelined)
    return {
        **{k: v for k, v in r.items() if k not in ("kernels",)},
        **compared(priced, rep["train"], t0),
        "kernels": rep["train"]["kernels"],
        **step_ms(priced, rep),
    }


def smallest(
    config: Path,
    most: int = 64,
    batch: int | None = None,
    seq: int | None = None,
    target: str = TARGET,
    cluster: Path = CLUSTER,
) -> dict | None:
    """The fewest GPUs (1, 2, 4, ...) whose best plan compiles within the usable memory."""
    n = 1
    while n <= most:
        if plan(config, n, batch, seq, cluster) is not None:
            r = row(config, n, batch, seq, target, cluster)
            if r.get("fits"):
                return r
        n *= 2
    return None


def markdown(rows: list[dict], small: list[dict], plans: str = "plan (planner's pick)", gpu: str = "H100") -> str:
    usable = next((r["usable_bytes"] for r in rows if r.get("plan")), 0) / GB
    ms = any("table_ms" in r for r in rows + small)  # the step ms columns, where the compiles were priced
    lines = [
        f"| model | {gpu}s | {plans} | compiled peak GB/GPU | fits {usable:.1f} GB | planner GB | planner / compiled |"
        + (" planner ms | table ms | planner / table |" if ms else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|---|" if ms else ""),
    ]
    for r in rows:
        if r.get("plan") is None:
            lines.append(
                f"| {r['model']} | {r['devices']} | no plan fits (planner) | - | no | - | - |"
                + (" - | - | - |" if ms else "")
            )
            continue
        mesh = "x".join(str(r["mesh"][a]) for a in ("pipeline", "data", "fsdp", "tensor"))
        lines.append(
            f"| {r['model']} | {r['devices']} | mesh {mesh}, {_short(r['plan'])} | {r['peak_bytes'] / GB:.1f} "
            f"| {'yes' if r['fits'] else 'NO'} | {r['planner_bytes'] / GB:.1f} | {r['ratio']:.2f} |" + _ms(r, ms)
        )
    if small:
        lines += [
            "",
            f"| model | fewest {gpu}s that fit | mesh p x d x f x t | compiled peak GB/GPU | planner / compiled "
            "| plan |",
            "|---|---|---|---|---|---|",
        ]
        for r in small:
            mesh = "x".join(str(r["mesh"][a]) for a in ("pipeline", "data", "fsdp", "tensor"))
            lines.append(
                f"| {r['model']} | {r['devices']} | {mesh} | {r['peak_bytes'] / GB:.1f} | {r['ratio']:.2f} "
                f"| {_short(r['plan'])} |"
            )
    return "\n".join(lines)


def _ms(r: dict, ms: bool) -> str:
    """A row's step ms cells: the planner's, the step-time table's of its compile, their ratio."""
    if not ms:
        return ""
    if "table_ms" not in r:
        return " - | - | - |"
    return f" {r['planner_ms']:.1f} | {r['table_ms']:.1f} | {r['planner_ms'] / r['table_ms']:.2f} |"


def _pipelined() -> list[str]:
    """The collective pipeliner's options these compiles (and the planner) take (xla_gpu_flags.pipelined)."""
    from boost_jax.xla_gpu_flags import pipelined

    return sorted(pipelined())


def _short(flags: str) -> str:
    keep = (
        "parallel.strategy",
        "parallel.sequence_parallel=true",
        "train.grad_accum",
        "remat.policy",
        "model.scan_unroll=true",
        "parallel.pipeline=",
        "parallel.pipeline_schedule",
        "parallel.pipeline_repeats",
        "parallel.microbatches",
    )
    return ", ".join(f for f in flags.split() if f.startswith(keep))


def _chosen(r: dict, only: str | None) -> bool:
    """Whether --only names recorded row `r` (MODEL:GPUS or MODEL:GPUS:PxDxFxT; None: every row)."""
    if not only:
        return True
    mesh = "x".join(str(r["mesh"][a]) for a in ("pipeline", "data", "fsdp", "tensor"))
    return any(w in (f"{r['model']}:{r['devices']}", f"{r['model']}:{r['devices']}:{mesh}") for w in only.split(","))


def _reprice_table(args) -> dict:
    """--reprice: the recorded rows priced again (`reprice`); the table and json as they were otherwise."""
    out = json.loads(Path(args.reprice).read_text())
    cluster = ROOT / "configs" / "clusters" / f"{out['cluster']}.py"
    fixed = "aot_fit_fixed" in Path(args.reprice).stem
    for r in out["rows"] + out["smallest"]:
        if not r.get("plan"):
            continue
        priced = reprice(r, cluster, out["pipelined_collectives"])
        r.update(
            planner_bytes=priced.memory["total"],
            planner_parts=priced.memory,
            ratio=priced.memory["total"] / r["peak_bytes"],
            planner_ms=priced.step_s * 1e3,
        )
        if not fixed and r in out["rows"]:
            now = plan(ROOT / "configs" / f"{r['model']}.py", r["devices"], cluster=cluster)
            r["pick_now"] = None if now is None else " ".join(f.removeprefix("--config.") for f in overrides_of(now))
            if r["pick_now"] != r["plan"]:
                print(f"{r['model']} on {r['devices']}: the planner now picks {r['pick_now']}", flush=True)
    plans = (
        f"plan (fixed: batch {FIXED_BATCH} x seq {FIXED_SEQ}, cudnn, pallas norm)" if fixed else "plan (planner's pick)"
    )
    text = markdown(out["rows"], out["smallest"], plans, LABELS.get(out["target"], out["target"]))
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of configs/NAME.py")
    ap.add_argument("--devices", default=",".join(map(str, DEVICES)), help="comma list of GPU counts")
    ap.add_argument("--smallest", action="store_true", help="also the fewest GPUs each model fits on")
    ap.add_argument("--smoke", action="store_true", help="the tiny config on 2 GPUs")
    ap.add_argument(
        "--fixed", action="store_true", help="the FIXED plans at seq 2048 instead (the memory model's check)"
    )
    ap.add_argument(
        "--target", default=TARGET, help=f"the GPU compiled for (default {TARGET}; boost_jax/tools/targets)"
    )
    ap.add_argument(
        "--cluster",
        default=str(CLUSTER.relative_to(ROOT)),
        help="the cluster config the planner plans for (default configs/clusters/h100_8x.py)",
    )
    ap.add_argument(
        "--recompile",
        help="a json this wrote: compile its rows' plans again with this checkout and price them again "
        "(the same plans; --json/--markdown write the result)",
    )
    ap.add_argument(
        "--reprice",
        help="a json this wrote: price its rows' plans again with this checkout's planner, no compile (the "
        "compiled peaks stay as measured); a row whose pick the planner would change now says so",
    )
    ap.add_argument(
        "--only",
        help="with --recompile: a comma list of MODEL:GPUS (or MODEL:GPUS:PxDxFxT) rows to compile again; "
        "the others stay as recorded",
    )
    ap.add_argument(
        "--reuse",
        help="comma list of jsons this wrote with this checkout's program: a plan they hold is not compiled again",
    )
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    from boost_jax.tools import aot

    if not aot.available():
        raise SystemExit(f"benchmarks/aot_fit.py compiles for GPUs without them: {aot.INSTALL} ({aot.missing()})")
    aot.target_config(args.target)  # an unknown target: one line naming the known ones
    cluster = Path(args.cluster) if Path(args.cluster).is_absolute() else ROOT / args.cluster
    if not cluster.is_file():
        raise SystemExit(f"--cluster: no such file {args.cluster} (e.g. configs/clusters/a100_4x.py)")
    if args.smoke:
        models, devices, batch, seq = ["tiny"], [2], 8, 64
    else:
        models, devices, batch, seq = args.models.split(","), [int(x) for x in args.devices.split(",")], None, None
    rows, small = [], []
    if args.reuse:
        reuse(args.reuse)
    if args.reprice:
        return _reprice_table(args)
    if args.recompile:
        old = json.loads(Path(args.recompile).read_text())
        done: dict = {}  # a plan in both tables compiles once
        for group, out in (("rows", rows), ("smallest", small)):
            for r in old[group]:
                if r.get("plan") and _chosen(r, args.only):
                    key = (r["model"], r["devices"], r["plan"])
                    done[key] = r = done.get(key) or recompile(
                        r, old["target"], ROOT / "configs" / "clusters" / f"{old['cluster']}.py", _pipelined()
                    )
                    print(json.dumps({k: v for k, v in r.items() if k not in ("kernels", "planner_parts")}), flush=True)
                out.append(r)
        models, args.target, cluster = [], old["target"], ROOT / "configs" / "clusters" / f"{old['cluster']}.py"
    if args.fixed:
        for name, mesh, strategy in FIXED:
            r = fixed_row(name, mesh, strategy, target=args.target, cluster=cluster)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "planner_parts"}), flush=True)
        models = []
    for name in models:
        config = ROOT / "configs" / f"{name}.py"
        for n in devices:
            r = row(config, n, batch, seq, args.target, cluster)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("kernels", "planner_parts")}), flush=True)
        if args.smallest:
            s = smallest(config, max(devices), batch, seq, args.target, cluster)
            if s is not None:
                small.append(s)
    text = markdown(
        rows,
        small,
        f"plan (fixed: batch {FIXED_BATCH} x seq {FIXED_SEQ}, cudnn, pallas norm)"
        if args.fixed or "aot_fit_fixed" in Path(args.recompile or "").stem
        else "plan (planner's pick)",
        LABELS.get(args.target, args.target),
    )
    print(text)
    out = {
        "target": args.target,
        "cluster": cluster.stem,
        "pipelined_collectives": _pipelined(),
        "rows": rows,
        "smallest": small,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
