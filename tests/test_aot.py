"""The real train step compiled for H100s this host does not have (deviceless AOT, boost_jax/tools/aot.py).

What is checked: a step built on GPU devices takes the GPU paths (cuDNN attention under `auto`, with
per-row lengths for document rows; the Pallas and Triton norm kernels; bf16 under model.dtype=auto),
its collectives move what the CPU-emulated program of the same mesh moves (so the comm report's
numbers hold for GPUs), its memory report is consistent, and bad input is one line. Needs the `aot`
extra (`.ci/run` installs it); elsewhere every test here skips, naming the install command.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from boost_jax.tools import aot

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.py")

pytestmark = pytest.mark.skipif(not aot.available(), reason=f"needs the aot extra: {aot.INSTALL} ({aot.missing()})")


def _tiny(make_config, **kw):
    c = make_config(
        **{
            "model.dtype": "auto",
            "model.d_model": 64,
            "model.n_heads": 4,
            "model.n_kv_heads": 2,
            "model.d_ff": 128,
            "model.rank": 16,
            "train.seq_len": 64,
            "model.max_seq_len": 64,
            **kw,
        }
    )
    return c


def _cola_1b_shaped(mesh, strategy="btp", **kw):
    """cola_1b's widths (d 2048, I 5472, 32 heads, r 512) with 2 layers, at seq 256 and batch 8."""
    from boost_jax.config import sized_config

    c = sized_config("1b", "cola")
    c.model.n_layers = 2
    c.train.update(seq_len=256, global_batch=8, grad_accum=1)
    c.parallel.update(dict(zip(("pipeline", "data", "fsdp", "tensor"), mesh)), strategy=strategy)
    c.data.update(source="embedded", batching="document")
    for key, value in kw.items():
        section, field = key.split(".")
        c[section][field] = value
    return c


def _check_memory(r):
    assert r["peak_bytes"] == r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"] - r["alias_bytes"]
    assert r["peak_bytes"] > 0 and r["temp_bytes"] > 0 and r["compile_s"] > 0
    assert r["fits"] == (r["peak_bytes"] <= r["usable_bytes"])
    assert r["device_memory_bytes"] == aot.target_memory("h100")


def test_tiny_on_one_h100_takes_the_gpu_paths(make_config):
    """Document rows: cuDNN with per-row lengths (mask PADDING_CAUSAL) forward and backward at a head dim
    it pads (10, as 3B's 100), the Pallas norm as Triton kernels, bf16 compute under dtype=auto; the eval
    step compiles too."""
    odd_heads = {"model.d_model": 40, "model.n_heads": 4, "model.n_kv_heads": 2}
    extra = {"data.batching": "document", "model.attention": "auto", "kernels.rmsnorm": "pallas", **odd_heads}
    cfg = _tiny(make_config, **extra)
    rep = aot.compile_config(cfg, "h100", 1)
    train, ev = rep["train"], rep["eval"]
    layers = cfg.model.n_layers
    assert train["kernels"]["cudnn attention (fwd, padding_causal)"] >= 1
    assert train["kernels"]["cudnn attention (bwd, padding_causal)"] >= 1
    assert train["kernels"]["triton kernel rmsnorm_fwd"] >= 1 and train["kernels"]["triton kernel rmsnorm_bwd"] >= 1
    assert ev["kernels"]["cudnn attention (fwd, padding_causal)"] >= 1 and not any("bwd" in k for k in ev["kernels"])
    assert rep["device_kind"].startswith("NVIDIA H100") and rep["devices"] == 1 and layers == 2
    for r in (train, ev):
        _check_memory(r)
        assert r["collectives"] == {}  # one device
    # The same config built on the host's CPU devices keeps the CPU paths (no GPU kernel, float32).
    import jax

    from boost_jax.runtime.build import build

    built = build(cfg, jax.devices()[:1])
    cpu = built.lower_train().compile().as_text()
    assert "__cudnn" not in cpu and "triton" not in cpu
    assert aot.kernels(cpu) == {}
    devs = aot.devices("h100", 1)
    gpu_built = build(cfg, devs)
    assert _dtype_of(gpu_built) == "bfloat16" and _dtype_of(built) == "float32"


def _dtype_of(built):
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.merge(built.spec.graphdef, built.spec.abstract["params"])
    return jnp.dtype(model.dtype).name


def test_packed_rows_and_the_triton_norm(make_config):
    """Packed rows: auto does not pick cuDNN (it cannot mask segments) and says so; the jax-triton
    norm kernels are in the program, forward and backward."""
    pytest.importorskip("jax_triton", reason=f"the triton norm needs jax-triton: {aot.INSTALL}")
    cfg = _tiny(make_config, **{"data.batching": "packed", "model.attention": "auto", "kernels.rmsnorm": "triton"})
    with pytest.warns(UserWarning, match="packed rows"):
        rep = aot.compile_config(cfg, "h100", 1, programs=("train",))
    k = rep["train"]["kernels"]
    assert not any(name.startswith("cudnn") for name in k)
    assert k["triton kernel (jax-triton)"] >= 2 * cfg.model.n_layers  # fwd and bwd of every norm in the scan body


def _called_params(hlo_text: str, op_name: str) -> list[str]:
    """The parameter lists of the GEMM computations that instructions tagged `op_name` call (a
    fusion's operand types live in its computation's header; a reduction after a batched GEMM is not
    a GEMM)."""
    import re

    calls = {
        m.group(1)
        for line in hlo_text.splitlines()
        if f'op_name="{op_name}"' in line
        for m in [re.search(r"calls=%([\w.\-]+)", line)]
        if m
    }
    return [
        line.split(" -> ")[0]
        for line in hlo_text.splitlines()
        if any(line.startswith(f"%{c} (") for c in calls if "gemm" in c)
    ]


def _fused_add_norms(text):
    """(forward, backward) jax-triton calls of the fused residual add + norm in a compiled program: its
    forward returns two [R, d] arrays (y, h; the norm's returns y [R, d] and s [R]), its backward's
    fourth operand is h's gradient [R, d] (the norm's: ds [R])."""
    fwd = bwd = 0
    for line in text.splitlines():
        if 'custom_call_target="triton_kernel_call"' not in line:
            continue
        out = re.search(r"= \((\w+\[\d+,\d+\])\{1,0\}, (\w+\[\d+,\d+\])\{1,0\}\) custom-call", line)
        ins = re.search(r"operand_layout_constraints=\{([^}]*(?:\}[^}]*)*?)\}, api_version", line)
        shapes = re.findall(r"\w+\[[\d,]*\]", ins.group(1)) if ins else []
        fwd += bool(out and out.group(1) == out.group(2))
        bwd += len(shapes) == 4 and shapes[3] == shapes[0] and shapes[0].count(",") == 1
    return fwd, bwd


def test_defaults_resolve_to_the_fast_program_on_one_h100(make_config):
    """The `auto` defaults on one GPU (model/autos.py) resolve to what one H100 measured fastest (the
    A-only grouping and the fused residual adds: what the step-time table prices fastest), and the
    compiled program is that program: the layers unrolled (one cuDNN attention per layer, no layer
    loop), CoLA's A's grouped, remat none, the Triton norm; the head's backward GEMMs take bf16
    operands. On 8 GPUs with fsdp the scan and lowrank remat come back."""
    pytest.importorskip("jax_triton", reason=f"the triton norm needs jax-triton: {aot.INSTALL}")
    import jax

    from boost_jax.runtime.build import build

    cfg = _tiny(make_config, **{"model.attention": "auto"})
    # compiled once, read as aot.compile_config reads it (aot.resolved, aot.kernels)
    built = build(cfg, aot.devices("h100", 1))
    assert aot.resolved(built.cfg) == {
        "model.group_linears": "first",
        "model.scan_unroll": True,
        "remat.policy": "none",
        "kernels.rmsnorm": "triton",
        "model.gate_kernel": "gemm",
    }, aot.resolved(built.cfg)
    text = built.lower_train().compile().as_text()
    k = aot.kernels(text)
    layers, n = cfg.model.n_layers, cfg.train.global_batch * cfg.train.seq_len
    assert k["cudnn attention (fwd, causal)"] == layers and k["cudnn attention (bwd, causal)"] == layers, k
    assert k["triton kernel (jax-triton)"] >= 2 * (2 * layers + 1), k  # every norm, forward and backward
    # kernels.residual_norm=auto: every norm runs as the fused residual add + norm, one kernel each way
    # (the first block's adds zeros to the embedding; the final norm adds the last block's output);
    # model.bottleneck_kernel=auto (norm): q/k/v's and gate/up's adds write no normalised rows, their
    # first-stage GEMMs normalise what they load (kernels/norm_gemm.py), one kernel each way per group
    assert _fused_add_norms(text) == (1, 2 * layers + 1), _fused_add_norms(text)
    d, r = cfg.model.d_model, cfg.model.rank
    assert [
        k.get(f"triton kernel norm_gemm_{p}__gemm_1x{shape}")
        for p, g in (("fwd", 3), ("dw", 3), ("fwd", 2), ("dw", 2))
        for shape in [f"{n}x{g * r}x{d}" if p == "fwd" else f"{d}x{g * r}x{n}"]
    ] == [layers] * 4, k
    # model.gate_kernel=auto: the MLP's gate product inside the down projection's first GEMM, one Pallas
    # kernel each way per layer (the input gradient's and the weight's), named for the step-time table
    f = cfg.model.d_ff
    assert [
        k.get(f"triton kernel gated_gemm_{p}__gemm_1x{shape}")
        for p, shape in (("fwd", f"{n}x{r}x{f}"), ("dx", f"{n}x{f}x{r}"), ("dw", f"{f}x{r}x{n}"))
    ] == [layers] * 3, k
    assert " while(" not in text  # no layer scan (and no accumulation or loss-chunk loop at these shapes)
    for spec in ("btd,btv->dv", "btv,dv->btd"):  # model/loss.py's head backward
        params = _called_params(text, f"jit(train_step)/transpose(jvp({spec}))/dot_general")
        assert params and all("bf16[" in p and "f32[" not in p for p in params), (spec, params)
    fsdp = _tiny(make_config, **{"model.attention": "auto", "parallel.data": 1, "parallel.fsdp": 8})
    assert aot.compile_config(fsdp, "h100", 8, programs=("train",))["resolved"] == {
        "model.group_linears": "first",
        "model.scan_unroll": False,
        "remat.policy": "lowrank",
        "kernels.rmsnorm": "triton",
        "model.gate_kernel": "gemm",
    }
    dense = _tiny(make_config, **{"model.linear": "dense"})
    from boost_jax.model import autos

    assert autos.chosen(dense, 1, aot.devices("h100", 1))["model.group_linears"] is True
    assert autos.chosen(dense, 1, jax.devices("cpu")[:1]) == {  # CPUs: the scan, XLA's norm, no remat
        "model.group_linears": True,
        "model.scan_unroll": False,
        "remat.policy": "none",
        "kernels.rmsnorm": "xla",
        "model.gate_kernel": "xla",
    }


@pytest.mark.parametrize(
    "mesh",
    [{"data": 2}, pytest.param({"pipeline": 2, "data": 2, "pipeline_schedule": "1f1b"}, marks=pytest.mark.slow)],
    ids=["gradient_island", "pipeline_1f1b"],
)
def test_the_triton_norm_runs_where_the_model_is_vmapped(make_config, mesh):
    """The data-parallel gradient island and a pipeline's stages vmap the model; jax-triton's calls
    have no batching rule, so kernels/row_batching.py batches them: `auto` keeps the fused norm there
    and the program holds its kernels, forward and backward of every norm."""
    pytest.importorskip("jax_triton", reason=f"the triton norm needs jax-triton: {aot.INSTALL}")
    cfg = _tiny(make_config, **{f"parallel.{k}": v for k, v in mesh.items()})
    if mesh.get("pipeline", 1) > 1:
        cfg.parallel.microbatches = 4
    devices = mesh.get("pipeline", 1) * mesh["data"]
    from boost_jax.runtime.build import build

    built = build(cfg, aot.devices("h100", devices))
    text = built.lower_train().compile().as_text()
    assert aot.resolved(built.cfg)["kernels.rmsnorm"] == "triton", aot.resolved(built.cfg)
    # each device's share of the layers: forward and backward of its norms (and the final norm's)
    layers = cfg.model.n_layers // mesh.get("pipeline", 1)
    assert aot.kernels(text)["triton kernel (jax-triton)"] >= 2 * 2 * layers, aot.kernels(text)
    kernels = aot.kernels(text)  # the gate-in-GEMM kernels, per device (vmapped: the batch as more rows)
    gated = {
        p: sum(n for name, n in kernels.items() if name.startswith(f"triton kernel gated_gemm_{p}__"))
        for p in ("fwd", "dx", "dw")
    }
    assert min(gated.values()) >= layers, kernels
    if mesh.get("pipeline", 1) == 1:  # the fused residual add + norm, batched the same way
        fwd, bwd = _fused_add_norms(text)
        assert fwd == bwd == 2 * layers + 1, (fwd, bwd)


@pytest.mark.slow  # a deviceless 8-GPU compile of the tiny model (about 13 s here)
@pytest.mark.parametrize(
    "schedule",
    [{}, {"parallel.pipeline_schedule": "circular", "parallel.pipeline_repeats": 2}],
    ids=["gpipe", "circular"],
)
def test_the_gpu_pipeline_hands_over_with_one_permute_each_way(make_config, schedule):
    """GPipe or circular on pipeline 2 x data 2 x fsdp 2 (the stage state split over the batch replicas),
    compiled for 8 H100s: each tick hands the stage outputs on with one collective-permute over
    `pipeline` each way, and nothing else in the tick loop moves the state over `pipeline` (left to
    GSPMD, XLA:GPU rolled it with an all-reduce, three all-to-alls and permutes over every device,
    every tick)."""
    from boost_jax.runtime.build import build
    from boost_jax.tools.hlo_comm import parse_collectives

    cfg = _tiny(
        make_config,
        **{"parallel.pipeline": 2, "parallel.data": 2, "parallel.fsdp": 2, "parallel.microbatches": 4},
        **{"train.global_batch": 16, "train.grad_accum": 1, "model.n_layers": 4, **schedule},
    )
    built = build(cfg, aot.devices("h100", 8))
    colls = parse_collectives(built.lower_train().compile().as_text(), built.mesh)
    over = [(c.kind, c.axes) for c in colls if c.in_loop and "pipeline" in c.axes]
    assert over and set(over) == {("collective-permute", ("pipeline",))}, over


def _executed(hlo_text, mesh) -> dict:
    return {kind: c["elements"] for kind, c in aot.collectives(hlo_text, mesh).items()}


ST, PIPELINE = ((1, 1, 2, 2), "btp", {"parallel.linear_partition": "st"}), ((2, 1, 1, 4), "btp", {})


@pytest.mark.parametrize(
    "mesh,strategy,extra,tolerance",
    [
        ((1, 1, 1, 8), "btp", {}, "scalars"),
        pytest.param((1, 1, 2, 4), "megatron", {}, "scalars", marks=pytest.mark.slow),  # the btp row's check
        # the point-to-point rings: compiled for the GPU and against the CPU program in the slow run only
        # (the default suite's time; a pipelined GPU compile stays there, in the planner's peak test below)
        pytest.param(*ST, "fewer", marks=pytest.mark.slow),
        pytest.param(*PIPELINE, "fewer", marks=pytest.mark.slow),
    ],
    ids=["btp-tensor8", "megatron-fsdp2-tensor4", "st-2x2-vs-cpu", "pipeline2-tensor4-vs-cpu"],
)
def test_gpu_collectives_are_the_cpu_programs(mesh, strategy, extra, tolerance):
    """cola_1b-shaped, 2 layers: what the H100 program's collectives move per step (through its loops'
    trip counts) equals the CPU-emulated program's, kind by kind, up to the scalars of the step's
    bookkeeping that the two compilers combine differently (<= 1,024 elements). Where the program is a
    ring of point-to-point steps (pipeline ticks, the spatial-temporal GEMMs), XLA:GPU unrolls or
    peels the loops (trip counts 2 -> 1, 5 -> 1 + 2 x 2) and sends 2-4% fewer permuted elements than
    XLA:CPU (measured: st 2x2 159.2M vs 165.4M, pipeline 2 4.72M vs 4.72M + 2,560, and one
    262,144-element all-reduce fewer): there the CPU count is an upper bound within 5%."""
    import jax

    from boost_jax.runtime.build import build

    n = math.prod(mesh)
    # The same program on both: the fields `auto` decides by platform (model/autos.py) set as the CPU's.
    same = {"remat.policy": "none", "kernels.rmsnorm": "xla", "model.scan_unroll": False}
    cfg = _cola_1b_shaped(mesh, strategy, **{"model.dtype": "bfloat16", **same, **extra})
    rep = aot.compile_config(cfg, "h100", n, programs=("train",))
    _check_memory(rep["train"])
    assert rep["train"]["kernels"]["cudnn attention (fwd, padding_causal)"] >= 1
    gpu = {kind: c["elements"] for kind, c in rep["train"]["collectives"].items()}
    kinds = {"collective-permute"} if "linear_partition" in extra or mesh[0] > 1 else {"all-reduce"}
    assert kinds <= set(gpu) and all(v > 0 for v in gpu.values())  # the ring's (or tensor's) collectives are there
    cpu_cfg = _cola_1b_shaped(mesh, strategy, **{"model.dtype": "bfloat16", "model.attention": "xla", **same, **extra})
    built = build(cpu_cfg, jax.devices("cpu")[:n])
    cpu = _executed(built.lower_train().compile().as_text(), built.mesh)
    assert sorted(gpu) == sorted(cpu), (gpu, cpu)
    for kind in cpu:
        if tolerance == "scalars":
            assert abs(gpu[kind] - cpu[kind]) <= 1024, (kind, gpu, cpu)
        else:  # the CPU program's count is an upper bound within 5%
            assert 0.95 * cpu[kind] <= gpu[kind] <= cpu[kind], (kind, gpu, cpu)


def test_cli_json_and_one_line_errors(tmp_path, capsys, monkeypatch):
    out = tmp_path / "aot.json"
    rep = aot.main(
        [
            "--target",
            "h100",
            "--devices",
            "2",
            "--config",
            "tiny",
            "--mesh",
            "1,1,1,2",  # a name, as train takes
            "--json",
            str(out),
            "--train-only",
            "--config.train.global_batch=4",
        ]
    )
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    for key in (
        "peak_bytes",
        "argument_bytes",
        "temp_bytes",
        "output_bytes",
        "device_memory_bytes",
        "fits",
        "kernels",
        "collectives",
        "compile_s",
    ):
        assert key in saved["train"], key
    assert saved["train"]["peak_bytes"] == rep["train"]["peak_bytes"] and saved["mesh"]["tensor"] == 2
    assert "all-reduce" in saved["train"]["collectives"] and "peak" in text and "fits" in text

    def error(argv):
        with pytest.raises(SystemExit) as e:
            aot.main(argv)
        err = capsys.readouterr().err.strip()
        err = "\n".join(ln for ln in err.splitlines() if not ln.startswith("aot: compiling"))  # its progress line
        assert e.value.code != 0 and err.count("\n") == 0 and "Traceback" not in err, err
        return err

    base = ["--devices", "1", "--config", TINY]
    assert "--target: unknown GPU 'h900'; one of a100, a100_40gb, h100, h200" in error(["--target", "h900", *base])
    assert "--mesh 1,1,2,2: 4 devices, but --devices 2" in error(
        ["--target", "h100", "--devices", "2", "--config", TINY, "--mesh", "1,1,2,2"]
    )
    assert "model.n_layres" in error(["--target", "h100", *base, "--config.model.n_layres=3"])
    assert "--config: no such file cola_8b" in error(["--target", "h100", "--devices", "1", "--config", "cola_8b"])
    # cuDNN refuses a head dim past 128 (cudnn pads 260 to 264): named, with the field to change.
    assert "model.attention" in error(
        [
            "--target",
            "h100",
            *base,
            "--config.model.attention=cudnn",
            "--config.model.d_model=1040",
            "--config.model.n_heads=4",
            "--config.model.n_kv_heads=4",
        ]
    )
    monkeypatch.setattr(aot, "missing", lambda: "jax-cuda13-plugin (jax's CUDA plugin)")
    assert aot.INSTALL in error(["--target", "h100", *base])


def test_plan_verify_target_compiles_the_plan_for_the_gpu(capsys):
    """`plan --verify --target h100`: the plan's own step at full size on its GPUs; the planner's peak
    next to the compiled one, and the exit code says whether they agree within 10% (and it fits)."""
    from boost_jax import plan

    cluster = str(Path(TINY).parents[0] / "clusters" / "h100_8x.py")
    code = plan.main(
        [
            "--config",
            TINY,
            "--devices",
            "2",
            "--cluster",
            cluster,
            "--batch",
            "8",
            "--seq",
            "64",
            "--remat",
            "none",
            "--pipeline",
            "1",
            "--verify",
            "--target",
            "h100",
        ]
    )
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| peak |"))
    predicted, compiled, ratio, agrees = (c.strip() for c in row.strip("|").split("|")[1:])
    p, c = (float(x.split()[0]) for x in (predicted, compiled))
    rounding = 0.0005 / p + 0.0005 / c  # GB printed to 3 decimals: each value within 0.0005 of its own
    assert c > 0 and float(ratio) == pytest.approx(p / c, rel=rounding + 0.01)
    assert (agrees == "yes") == (abs(float(ratio) - 1) <= 0.1 or abs(1 / float(ratio) - 1) <= 0.1)
    assert (code == 0) == (agrees == "yes")
    with pytest.raises(SystemExit, match="--target compiles the plan for a GPU: it goes with --verify"):
        plan.main(["--config", TINY, "--devices", "2", "--cluster", cluster, "--target", "h100"])


@pytest.mark.slow  # four or five deviceless compiles of the tiny model (about 2 minutes here)
def test_plan_verify_target_falls_back_to_a_plan_that_fits(capsys):
    """`plan --verify --target h100 --device-memory GB` under the compiled peak of the planner's pick: one
    line names the pick with its compiled and the device's GB, and the search's next plan (the search
    without it) is compiled and checked, as parallel.plan=auto does on the GPUs."""
    import dataclasses

    from boost_jax import plan
    from boost_jax.planner import Options, load_cluster, search
    from boost_jax.planner.auto import short
    from boost_jax.tools.devices import load_config

    cluster = str(Path(TINY).parents[0] / "clusters" / "h100_8x.py")
    opts = Options(batch=8, seq=64, remat=("none",), pipeline=(1,))
    cfg = load_config(TINY)
    first = search(cfg, load_cluster(cluster), 2, opts).best_runnable
    flags = [a for a in first.overrides.split() if a.startswith("--config.")]
    peak = aot.compile_config(aot.load(TINY, flags), "h100", 2, programs=("train",))["train"]["peak_bytes"]
    memory = 0.99 * peak / 1e9
    argv = ["--config", TINY, "--devices", "2", "--cluster", cluster, "--batch", "8", "--seq", "64"]
    argv += ["--remat", "none", "--pipeline", "1", "--verify", "--target", "h100", "--device-memory", str(memory)]
    plan.main(argv)
    lines = capsys.readouterr().out.splitlines()
    over = next(ln for ln in lines if " does not fit: " in ln)
    assert over.startswith(f"--verify --target h100: the pick ({short(first)}) does not fit: its compiled train ")
    assert f"needs {peak / 1e9:.3g} GB per device, the device has {memory:.3g} GB (--device-memory)" in over
    second = search(
        cfg, load_cluster(cluster), 2, dataclasses.replace(opts, exclude=frozenset({first.overrides}))
    ).best_runnable
    assert f"--verify --target h100: next, {short(second)}" in lines
    assert f"  (explicitly: {second.overrides})" in lines


def test_aot_fit_smoke(tmp_path):
    """benchmarks/aot_fit.py --smoke: the planner's pick for the tiny config on 2 H100s, compiled;
    every row has the planner's and the compiled peak and their ratio, the planner's step ms and the
    step-time table's of the same compile (`table_ms`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aot_fit", Path(TINY).parents[1] / "benchmarks" / "aot_fit.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    out = fit.main(["--smoke", "--json", str(tmp_path / "fit.json"), "--markdown", str(tmp_path / "fit.md")])
    rows = json.loads((tmp_path / "fit.json").read_text())["rows"]
    assert [r["devices"] for r in rows] == [2] and rows == out["rows"]
    for r in rows:
        assert (
            r["peak_bytes"] > 0
            and r["planner_bytes"] > 0
            and r["ratio"] == pytest.approx(r["planner_bytes"] / r["peak_bytes"])
        )
        assert math.prod(r["mesh"].values()) == r["devices"]
        assert r["planner_ms"] > 0 and r["table_ms"] > 0
        assert f"| {r['planner_ms']:.1f} | {r['table_ms']:.1f} |" in (tmp_path / "fit.md").read_text()
    assert "| tiny | 2 |" in (tmp_path / "fit.md").read_text()


@pytest.mark.slow
def test_aot_fit_readme_command(tmp_path):
    """The README's "Will it fit?" command at its shapes (the zoo on 8 and 64 H100s, smallest meshes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aot_fit", Path(TINY).parents[1] / "benchmarks" / "aot_fit.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    out = fit.main(["--smallest", "--json", str(tmp_path / "fit.json")])
    assert len(out["rows"]) == len(fit.MODELS) * len(fit.DEVICES)


@pytest.mark.slow
def test_aot_fit_a100_readme_command(tmp_path):
    """The README's A100 "Will it fit?" command at its shapes (the zoo on 8 and 64 A100 40GB, the
    a100_4x cluster): every row compiled for the 40 GB part, or the planner finds no plan."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aot_fit", Path(TINY).parents[1] / "benchmarks" / "aot_fit.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    out = fit.main(
        ["--target", "a100_40gb", "--cluster", "configs/clusters/a100_4x.py", "--json", str(tmp_path / "fit.json")]
    )
    assert len(out["rows"]) == len(fit.MODELS) * len(fit.DEVICES) and out["target"] == "a100_40gb"
    for r in out["rows"]:
        assert r.get("plan") is None or (
            r["device_kind"] == "NVIDIA A100-SXM4-40GB"
            and r["usable_bytes"] == int(0.9 * aot.target_memory("a100_40gb"))
        )


@pytest.mark.slow  # six full-size compiles, about 1.5 minutes
def test_aot_fit_fixed_plans_within_10_percent(tmp_path):
    """`benchmarks/aot_fit.py --fixed`: the memory model's check at seq 2048 (batch 8, cuDNN attention, the
    Pallas norm; cola_1b on 1 H100, cola_7b on tensor 8 and on fsdp 2 x tensor 4 among them, the three
    plans it was 29% over, 8% and 30% under before the GPU counts): the planner's peak per GPU within
    10% under and 11% over the deviceless compile's on every plan."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aot_fit", Path(TINY).parents[1] / "benchmarks" / "aot_fit.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    out = fit.main(["--fixed", "--json", str(tmp_path / "fit.json")])
    assert len(out["rows"]) == len(fit.FIXED)
    for r in out["rows"]:
        mesh = "x".join(str(r["mesh"][a]) for a in ("pipeline", "data", "fsdp", "tensor"))
        why = (r["model"], mesh, r["planner_parts"], r["peak_bytes"])
        assert r["ratio"] >= 0.9, why  # never priced more than 10% under its compile
        if (r["model"], mesh) in FIXED_OVER:  # fails once the row is back within 11%: drop its entry
            assert r["ratio"] > 1.11, ("back within 11%, drop it from FIXED_OVER", *why)
        else:
            # 1.11 above: cola_1b on fsdp 8 priced 1.100 of its compile once the head's backward GEMMs ran
            # in bf16 (model/loss.py), which the memory model (fitted before) does not yet count
            assert r["ratio"] <= 1.11, why


# Fixed plans the memory model over-prices by more than 11%, each with why (none since the re-fit of
# 2026-11-29, benchmarks/RESULTS.md: the collective pipeliner's term and XLA's packing).
FIXED_OVER: dict = {}


README_AOT = (
    "python -m boost_jax.tools.aot --target h100 --devices 8 --config configs/cola_1b.py --mesh 1,1,8,1 --train-only"
)
README_PLAN = (
    "python -m boost_jax.plan --config configs/cola_7b.py --devices 8 --cluster configs/clusters/h100_8x.py "
    "--verify --target h100"
)


@pytest.mark.slow  # two full-size compiles and a search (about a minute): `pytest -m slow tests/test_aot.py`
def test_readme_commands(monkeypatch, capsys):
    """The README's aot and `plan --verify --target` commands at their shapes (the zoo's recipe: compiled
    for 8 H100s from abstract shapes), run from the repository root as the README runs them."""
    from boost_jax import plan

    monkeypatch.chdir(Path(TINY).parents[1])
    rep = aot.main(README_AOT.split()[3:])
    assert rep["mesh"]["fsdp"] == 8 and rep["train"]["kernels"]["cudnn attention (fwd, padding_causal)"] >= 1
    assert "eval" not in rep and rep["train"]["collectives"]["all-gather"]["count"] > 0
    code = plan.main(README_PLAN.split()[3:])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| peak |"))
    assert (code == 0) == row.rstrip().endswith("| yes |")


# How jax 0.11.2 compiles for real GPUs: its XLA has none of the collective pipeliner's options
# (benchmarks/RESULTS.md, "compiled as jax 0.11.2 compiles"). Named in XLA_FLAGS, the trainer leaves
# them out of the step's compiler options, so XLA's defaults (off) apply.
NOT_PIPELINED = (
    "--xla_gpu_enable_pipelined_all_gather=false --xla_gpu_enable_pipelined_reduce_scatter=false "
    "--xla_gpu_enable_pipelined_all_reduce=false"
)


# The planner prices this plan 8.9 GB, counting the sequence-parallel gathers' outputs. Its compile
# peaked at 7.7 GB (1.15x, a strict xfail) until `rules.regathered` (2026-11-29, eleventh session, h-spf)
# made the column-parallel GEMMs read the residual gathered over the sequence: about 8.7 GB since.
@pytest.mark.slow
def test_planner_peak_of_a_pipelined_plan_within_10_percent_of_the_h100_compile(tmp_path):
    """llama_1b's widths with 8 layers, circular V 2 over pipeline 2 x fsdp 2 x tensor 2 (megatron-SP),
    M 4, batch 128 x seq 256, XLA's norm: the planner's peak per GPU within 10% of the deviceless H100
    compile's. Before the tick loop's compute-dtype weights (every tick's chunk, a scan
    residual) and the split norms' float32 arrays were priced, the planner said 8.7 GB (0.87)."""
    from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for
    from boost_jax.planner.ops.strategy_tables import uniform_plan

    root = Path(__file__).resolve().parents[1]
    flags = [
        "--config.model.n_layers=8",
        "--config.parallel.pipeline=2",
        "--config.parallel.data=1",
        "--config.parallel.fsdp=2",
        "--config.parallel.tensor=2",
        "--config.parallel.strategy=megatron",
        "--config.parallel.sequence_parallel=true",
        "--config.parallel.microbatches=4",
        "--config.parallel.pipeline_schedule=circular",
        "--config.parallel.pipeline_repeats=2",
        "--config.train.global_batch=128",
        "--config.train.grad_accum=1",
        "--config.train.seq_len=256",
        "--config.remat.policy=none",
    ]
    cfg = aot.load(str(root / "configs" / "llama_1b.py"), flags)
    plan = plan_for(
        cfg,
        load_cluster(str(root / "configs" / "clusters" / "h100_8x.py")),
        Mesh(1, 2, 2, pipeline=2),
        1,
        "none",
        Layer(*uniform_plan("megatron", True)),
        Options(batch=128, seq=256, check_memory=False),
        microbatches=4,
        schedule="circular",
        repeats=2,
    )
    # XLA reads XLA_FLAGS once per process: the compile runs in its own, as jax 0.11.2 compiles.
    out = tmp_path / "aot.json"
    env = {**os.environ, "XLA_FLAGS": NOT_PIPELINED, "JAX_PLATFORMS": "cpu"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "boost_jax.tools.aot",
            "--target",
            "h100",
            "--devices",
            "8",
            "--config",
            str(root / "configs" / "llama_1b.py"),
            "--mesh",
            "2,1,2,2",
            "--train-only",
            "--json",
            str(out),
            *flags,
        ],
        check=True,
        env=env,
        capture_output=True,
        cwd=root,
    )
    train = json.loads(out.read_text())["train"]
    ratio = plan.memory["total"] / train["peak_bytes"]
    assert 0.9 <= ratio <= 1.1, (plan.memory, train["peak_bytes"], ratio)


@pytest.mark.parametrize("mesh", [(1, 8), pytest.param((2, 4), marks=pytest.mark.slow)], ids=["fsdp8", "data2_fsdp4"])
def test_an_accumulation_step_keeps_one_micro_batch_and_counts_its_collectives(mesh):
    """llama_1b's widths with 4 layers on 8 A100 40GB (megatron, no remat, batch 256 x seq 256), with
    the project's GPU flags: at grad_accum 2 the step keeps one micro-batch's activations, so its
    peak is well under grad_accum 1's (7.4 -> 4.8 GB on fsdp 8, 8.0 -> 5.5 on data 2 x fsdp 4). While
    XLA knew the accumulation loop's trip count, its while-loop double buffering unrolled it and ran
    both forwards first: 8.2 and 8.8 GB, more than at grad_accum 1 (parallel/grad_reduce.py
    each_micro_batch; the full llama_1b on 8 A100s: 59.5 GB against 31.9). The loop's collectives
    still count once per micro-batch: the FSDP gathers twice grad_accum 1's."""
    root = Path(__file__).resolve().parents[1]
    d, f = mesh

    def train(accum):
        flags = [
            "--config.model.n_layers=4",
            "--config.train.global_batch=256",
            f"--config.train.grad_accum={accum}",
            f"--config.parallel.data={d}",
            f"--config.parallel.fsdp={f}",
            "--config.parallel.tensor=1",
            "--config.parallel.strategy=megatron",
            "--config.remat.policy=none",
        ]
        cfg = aot.load(str(root / "configs" / "llama_1b.py"), flags)
        return aot.compile_config(cfg, "a100_40gb", 8, programs=("train",))["train"]

    one, two = train(1), train(2)
    assert two["peak_bytes"] < 0.85 * one["peak_bytes"], (one["peak_bytes"], two["peak_bytes"])
    gathers = [r["collectives"]["all-gather"] for r in (one, two)]
    assert gathers[1]["count"] == 2 * gathers[0]["count"] and gathers[1]["elements"] == 2 * gathers[0]["elements"], (
        gathers
    )


def _compile_in_process(tmp_path, target: str, devices: int, config: str, mesh: str, flags: list, xla_flags: str):
    """The train step's compiled memory for `target`, compiled in a process of its own (XLA reads
    XLA_FLAGS once per process)."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / f"aot_{target}.json"
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "boost_jax.tools.aot",
            "--target",
            target,
            "--devices",
            str(devices),
            "--config",
            str(root / "configs" / config),
            "--mesh",
            mesh,
            "--train-only",
            "--json",
            str(out),
            *flags,
        ],
        check=True,
        env=env,
        capture_output=True,
        cwd=root,
    )
    return json.loads(out.read_text())["train"]


# The program PIPELINED_SIGMA was first fitted on: grouped linears and XLA's norm (the defaults then).
COLA_FSDP = [
    "--config.model.group_linears=true",
    "--config.kernels.rmsnorm=xla",
    "--config.parallel.data=1",
    "--config.parallel.fsdp=8",
    "--config.parallel.tensor=1",
    "--config.parallel.strategy=btp",
    "--config.train.global_batch=256",
    "--config.train.grad_accum=1",
    "--config.train.seq_len=256",
    "--config.remat.policy=none",
]


# The A100 row repeats the H100 row's check on another GPU (and the recorded A100 picks are re-priced by
# tests/test_planner_picks.py): it runs with -m slow.
@pytest.mark.parametrize(
    "target,cluster", [("h100", "h100_8x"), pytest.param("a100_40gb", "a100_4x", marks=pytest.mark.slow)]
)
def test_planner_peak_of_a_cola_fsdp_plan_under_the_collective_pipeliner_within_10_percent(tmp_path, target, cluster):
    """cola_1b on fsdp 8 (btp, batch 256 x seq 256: half the recipe's, no remat), compiled for 8 H100s
    and for 8 A100 40GB with the project's GPU flags, XLA's collective pipeliner included (as jaxlib
    0.10 takes them): the planner's peak per GPU within 10% of the compiled one once it prices the
    pipeliner's stacked bottleneck arrays (cost.PIPELINED_SIGMA, fitted at the recipe's batch 512 on
    benchmarks/aot_fit*.json's cola FSDP rows, this row held out). Without them the H100 peak is more
    than 10% under."""
    from boost_jax import xla_gpu_flags
    from boost_jax.config import PROJECTION_GROUPS
    from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for
    from boost_jax.planner.pricing import cost as C

    if not set(C.PIPELINER_NEEDS) <= xla_gpu_flags.pipelined({}):
        pytest.skip("this jaxlib's XLA has no collective pipeliner options (jaxlib >= 0.11)")
    root = Path(__file__).resolve().parents[1]
    cfg = aot.load(str(root / "configs" / "cola_1b.py"), COLA_FSDP)
    layer = Layer("R", ("none",) * len(PROJECTION_GROUPS), "R", "R")
    priced = {
        on: plan_for(
            cfg,
            load_cluster(str(root / "configs" / "clusters" / f"{cluster}.py")),
            Mesh(1, 8, 1),
            1,
            "none",
            layer,
            Options(batch=256, seq=256, check_memory=False, pipelined=on),
        ).memory
        for on in (True, False)
    }
    assert priced[True]["pipeliner"] > 0 == priced[False]["pipeliner"]
    train = _compile_in_process(tmp_path, target, 8, "cola_1b.py", "1,1,8,1", COLA_FSDP, "")
    ratio = priced[True]["total"] / train["peak_bytes"]
    assert 0.9 <= ratio <= 1.1, (priced[True], train["peak_bytes"], ratio)
    if target == "h100":
        assert priced[False]["total"] / train["peak_bytes"] < 0.9, (priced[False], train["peak_bytes"])
