"""Every script in benchmarks/ runs end to end at its smallest shapes, so none breaks silently.

Each test imports the script and calls its main(argv) in this process (8 emulated CPU devices,
tests/conftest.py), with `--smoke` or small-shape arguments, writing to tmp_path: the committed
JSON/MD results in benchmarks/ are never touched. The numbers are not measurements; the tests check
that each part ran and that what it wrote is there, finite and positive.

The heavier smoke runs (each compiling several programs of paths the feature tests cover: the
pipeline schedules, batching modes, the comm sweep, the planner study, ...) are marked slow and run
with `pytest -m slow`. Run elsewhere in the default suite, not repeated here: grad_reduce.py --pipeline
(tests/test_readme.py), gpu_bench.py --smoke's kernel, attention and test parts (a subprocess,
tests/test_gpu_bench.py).
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TINY = str(ROOT / "configs" / "tiny.py")


def load(name: str):
    """benchmarks/NAME.py as a module (its sibling imports, e.g. step_time, resolve)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_every_script_has_a_smoke_run():
    """A new script in benchmarks/ gets its smoke run: here, or in a test of its own that names it."""
    here = Path(__file__).read_text()
    others = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != Path(__file__).name)
    missing = [
        s.name
        for s in sorted(BENCH.glob("*.py"))
        if f'load("{s.stem}")' not in here
        and f"benchmarks/{s.name}" not in others
        and f'"benchmarks" / "{s.name}"' not in others
    ]
    assert not missing, f"benchmarks/ scripts that no test runs: {missing}"


def test_cfg_walk_counts_files_returns_and_stays():
    """`benchmarks/cfg_walk.py`'s counting on a walk written out by hand: files in first-visit order,
    a return each time the walk enters a file it had left, a stay per call in the file just visited."""
    walk = load("cfg_walk")
    calls = [("a.py", "f"), ("a.py", "g"), ("b.py", "h"), ("a.py", "f"), ("c.py", "k"), ("b.py", "h"), ("b.py", "m")]
    s = walk.summarize(calls)
    assert (s["files"], s["returns"], s["stays"], s["calls"]) == (3, 2, 2, 7)
    assert s["file_order"] == ["a.py", "b.py", "c.py"]


@pytest.mark.slow  # a two-step training run under a profiler hook (about a minute here)
def test_cfg_walk_follows_the_config_from_train_run(tmp_path, capsys):
    walk = load("cfg_walk")
    assert walk.main(["--json", str(tmp_path / "walk.json")]) == 0
    out = json.loads((tmp_path / "walk.json").read_text())
    assert out["call_list"][0] == ["boost_jax/train.py", "run"]
    assert out["file_order"][0] == "boost_jax/train.py" and "boost_jax/runtime/build.py" in out["file_order"]
    assert out["files"] == len(out["file_order"]) and out["calls"] == len(out["call_list"])
    assert f"files {out['files']}  returns {out['returns']}" in capsys.readouterr().out


def test_attention_memory(tmp_path):
    out = tmp_path / "attention_memory.json"
    assert (
        load("attention_memory").main(
            [
                "--configs",
                "tiny",
                "--seqs",
                "64",
                "--attention",
                "chunked",
                "--tensor",
                "2",
                "--devices",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["config"], row["seq"], row["attention"]) == ("tiny", 64, "chunked")
    assert positive(row["temp_gib"], row["total_gib"]) and row["total_gib"] > row["temp_gib"], row


@pytest.mark.slow  # a heavier smoke run: with -m slow (the default suite's time)
def test_batching(tmp_path):
    out = tmp_path / "batching.json"
    assert load("batching").main(["--smoke", "--modes", "packed,document", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["smoke"] and [r["batching"] for r in res["rows"]] == ["packed", "document"]
    for r in res["rows"]:
        assert positive(r["rows_per_epoch"], r["tokens_per_s"], r["loader_s_per_batch"]), r
        assert 0 <= r["pad_fraction"] < 1
    assert res["rows"][1]["pad_fraction"] > 0  # a document row pads its tail
    assert [m["batching"] for m in res["memory"]] == ["stream", "packed"]
    assert all(positive(m["temp_bytes"]) for m in res["memory"])


@pytest.mark.slow  # a heavier smoke run: with -m slow (the default suite's time)
def test_bottleneck_zoo(tmp_path):
    out = tmp_path / "zoo.json"
    load("bottleneck_zoo").main(["--smoke", "--kinds", "cola", "--json", str(out)])
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert res["smoke"] and (row["kind"], row["strategy"]) == ("cola", "btp")
    assert positive(row["final_eval_loss"], row["params"], row["flops_per_token"], row["step_time_s"]), row
    assert positive(row["tp_fwd_elements_per_token"], row["tp_fwd_in_r"], row["tp_fwd_collectives"]), row


@pytest.mark.slow  # a heavier smoke run: with -m slow (the default suite's time)
def test_comm_sweep(tmp_path):
    load("comm_sweep").main(
        ["--sizes", "60m", "--tensor", "2", "--strategy", "btp", "--batch", "1", "--seq", "32", "--out", str(tmp_path)]
    )
    rows = json.loads((tmp_path / "comm.json").read_text())["rows"]
    assert [(r["size"], r["tensor"], r["strategy"]) for r in rows] == [("60m", 2, "btp")]
    assert positive(rows[0]["fwd_elements_per_token"], rows[0]["fwd_collectives"], rows[0]["step_tensor_gib"])
    assert "| cola_60m | 2 | btp |" in (tmp_path / "comm.md").read_text()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "comm.png").stat().st_size > 0


def test_data_prepare(tmp_path):
    out = tmp_path / "data_prepare.json"
    assert load("data_prepare").main(["--mb", "0.2", "--workers", "1", "--unit-mb", "0.05", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["workers"] == 1 and positive(row["mb_per_s"], row["tokens"], row["documents"], row["cpu_seconds"])
    assert len(res["peak_rss_mb_by_input"]) == 2 and positive(*res["peak_rss_mb_by_input"].values())


def test_gpu_bench_train_variant():
    """The train parts (layer7b, train1b) build and time a step here; the whole --smoke train run,
    each variant in a subprocess, is `pytest -m slow tests/test_gpu_bench.py`."""
    bench = load("gpu_bench")
    spec = next(s for s in bench.train_variants(smoke=True) if s["part"] == "train1b")
    row = bench.train_variant(spec, steps=1, smoke=True)
    assert positive(row["step_ms"], row["tokens_per_s"], row["tflops"])
    assert (row["seq"], row["batch"]) == (bench.shapes(True)["seq"], bench.shapes(True)["batch1b"])


@pytest.mark.slow  # a heavier smoke run: with -m slow (the default suite's time)
def test_gpu_bench_aot_h100(tmp_path, capsys):
    """`gpu_bench.py --aot h100` compiles what it would time for an H100 without one: here the
    attention part and the one 7B-layer train variant at --smoke shapes."""
    from boost_jax.tools import aot

    if not aot.available():
        pytest.skip(f"needs the aot extra ({aot.missing()} missing): {aot.INSTALL}")
    out = tmp_path / "aot.json"
    rc = load("gpu_bench").main(["--aot", "h100", "--smoke", "--parts", "attention,layer7b", "--json", str(out)])
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    rows = {(r["part"], r["name"]): r for r in res["rows"]}
    assert rc == 0, text
    from boost_jax.model.attention import IMPLEMENTATIONS

    assert set(rows) == {("attention", impl) for impl in IMPLEMENTATIONS} | {("layer7b", "cola_7b, 1 layer")}
    for (part, name), r in rows.items():
        assert r["ok"] and positive(r["compile_s"]), r
        assert f"{part} {name}: compiled OK" in text

    # The programs took their GPU paths: cuDNN's fused attention, Pallas on Triton.
    def has(row, prefix):
        return any(k.startswith(prefix) for k in row["kernels"])

    cudnn = rows["attention", "cudnn"]
    assert has(cudnn, "cudnn attention (fwd") and has(cudnn, "cudnn attention (bwd")
    assert has(rows["attention", "pallas"], "triton kernel mha")
    layer = rows["layer7b", "cola_7b, 1 layer"]
    assert has(layer, "cudnn attention (bwd") and layer["fits"]
    assert 0 < layer["peak_bytes"] <= layer["usable_bytes"]


def test_gpu_bench_aot_without_the_extra(monkeypatch, capsys):
    from boost_jax.tools import aot

    monkeypatch.setattr(aot, "missing", lambda: "jax-cuda13-plugin (jax's CUDA plugin)")
    assert load("gpu_bench").main(["--aot", "h100", "--parts", "device"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and aot.INSTALL in err


def test_loader_start(tmp_path):
    out = tmp_path / "loader_start.json"
    rows = load("loader_start").main(
        ["--tokens", "1e6", "--shuffle", "feistel,numpy", "--dir", str(tmp_path / "c"), "--json", str(out)]
    )
    assert [r["shuffle"] for r in rows] == ["feistel", "numpy"]
    for r in rows:
        assert "error" not in r, r
        assert positive(
            r["samples_per_epoch"], r["build_s"], r["first_batch_s"], r["epoch1_batch_s"], r["peak_rss_gib"]
        ), r
    assert json.loads(out.read_text())["rows"] == rows


@pytest.mark.slow  # a heavier smoke run: with -m slow (the default suite's time)
def test_pipeline_bubble(tmp_path):
    bench = load("pipeline_bubble")
    out = tmp_path / "schedules.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["schedule"], r["repeats"], r["remat.pipeline"]) for r in rows] == list(bench.SMOKE_CASES)
    for r in rows:
        assert r["bubble"] == pytest.approx(1 / (r["repeats"] * r["microbatches"] + 1))  # (S-1)/(VM+S-1), S = 2
        assert positive(r["temp_bytes"], r["executed_elements"].get("pipeline", 0)), r
    timed = tmp_path / "bubble.json"
    assert bench.main(["--smoke", "--time", "--steps", "1", "--json", str(timed)]) == 0
    (row,) = json.loads(timed.read_text())
    assert positive(row["pipelined_s"], row["data_parallel_s"], row["bubble"])


def test_planner_memory(tmp_path):
    out = tmp_path / "planner_memory.json"
    rc = load("planner_memory").main(["--smoke", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc in (0, 1) and len(rows) == 1  # 1: a ratio beyond 15% (the script's own verdict, not a crash)
    assert rows[0]["plan"] == "btp st/st/st/st" and rows[0]["mesh"] == "1x2x2"
    assert all(positive(r["compiled_bytes"], r["planner_bytes"], r["ratio"]) for r in rows), rows


def test_planner_pipelines(capsys):
    load("planner_pipelines").main(["--smoke"])
    text = capsys.readouterr().out
    assert "cola_13b on 8 x h100_8x" in text
    for name in ("no pipeline", "gpipe", "gpipe + stage remat", "circular", "circular + stage remat"):
        assert f"\n| {name} |" in text


def test_planner_speed(tmp_path):
    """planner_speed.py on the tiny config and 8 devices: pruned and exhaustive, the same plans."""
    out = tmp_path / "speed.json"
    assert load("planner_speed").main(["--config", TINY, "--devices", "8", "--repeat", "1", "--json", str(out)]) == 0
    speed = json.loads(out.read_text())
    assert speed["same_plans"] is True and set(speed["runs"]) == {"pruned", "exhaustive"}
    runs = speed["runs"]
    assert runs["pruned"]["considered"] == runs["exhaustive"]["considered"] == runs["exhaustive"]["priced"] > 0
    assert 0 < runs["pruned"]["priced"] <= runs["exhaustive"]["priced"] and positive(runs["pruned"]["cpu_s"])


@pytest.mark.slow  # a heavier smoke run: with -m slow (the default suite's time)
def test_planner_study(tmp_path):
    out = tmp_path / "planner_study.json"
    assert load("planner_study").main(["--smoke", "--json", str(out)]) == 0
    (study,) = json.loads(out.read_text())
    assert (study["config"], study["cluster"], study["devices"]) == ("cola_7b", "h100_8x", 8)
    best = study["plans"]["best"]
    assert positive(best["step_s"], best["mfu"], best["memory_gb"]) and study["considered"] > 0


def test_planner_validation(tmp_path):
    out, md = tmp_path / "validation.json", tmp_path / "validation.md"
    rc = load("planner_validation").main(["--json", str(out), "--markdown", str(md)])
    res = json.loads(out.read_text())
    assert set(res["held_out"]) == {"btp", "megatron", "vanilla"}
    assert all(positive(v["predicted_s"], v["memory_gb"]) for v in res["held_out"].values())
    assert res["pass"] == (rc == 0) and "BTP (BOOST)" in md.read_text()


@pytest.mark.slow  # a heavier smoke run: with -m slow (the default suite's time)
def test_remat_memory(tmp_path):
    out = tmp_path / "remat.json"
    load("remat_memory").main(
        [
            "--config",
            TINY,
            "--seq",
            "32",
            "--batch",
            "1",
            "--dtype",
            "float32",
            "--policies",
            "none",
            "--json",
            str(out),
        ]
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["policy"] == "none" and row["activation_vs_none"] == 1 and row["recompute_overhead"] == 0
    assert positive(row["temp_bytes"], row["argument_bytes"], row["layer_flops"], row["step_flops"]), row
    assert row["step_flops"] > 4 * row["layer_flops"]  # 4 layers, and the embedding, head and optimizer


def test_step_time(tmp_path):
    out = tmp_path / "step_time.json"
    load("step_time").main(
        [
            "--config",
            TINY,
            "--layers",
            "1",
            "--batch",
            "4",
            "--seq",
            "16",
            "--strategy",
            "btp",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--json",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert set(res["strategies"]) == {"btp"} and res["mesh"]["tensor"] == 4
    assert all(positive(s["median_s"], s["tokens_per_s"]) for s in res["strategies"].values())


def test_vs_torch(tmp_path, capsys):
    """benchmarks/vs_torch.py at tiny widths: the project's rows, Hugging Face Llama's and its CoLA form
    (each in its own process; the CoLA form has the project's parameter count, the dense form the
    project's llama's), and the official CoLA row saying what it needs (no checkout here)."""
    pytest.importorskip("torch", reason="vs_torch's torch rows need torch (CI installs torch==2.13.0)")
    pytest.importorskip("transformers", reason="vs_torch's hf rows need transformers (CI installs it)")
    out = tmp_path / "vs_torch.json"
    assert load("vs_torch").main(["--smoke", "--rows", "project,cola,hf_cola,hf", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    cola, llama = res["models"]["cola_1b"], res["models"]["llama_1b"]
    assert set(cola) == {"project", "cola", "hf_cola"} and set(llama) == {"project", "hf"}
    assert "--cola-repo" in cola["cola"]["error"]
    for row in (cola["project"], cola["hf_cola"], llama["project"], llama["hf"]):
        assert positive(row["step_s"], row["flops_per_token"], row["loss"]), row
    assert cola["hf_cola"]["params"] == cola["project"]["params"]
    assert llama["hf"]["params"] == llama["project"]["params"]
    table = capsys.readouterr().out
    assert "| llama_1b | hf | bf16 params + AdamW state |" in table and "needs --cola-repo" in table


@pytest.mark.slow  # a heavier smoke run: with -m slow (the default suite's time)
def test_gpu_bench_train256_one_process_profile(tmp_path):
    """`gpu_bench.py --parts device,train256 --one-process --profile DIR` at --smoke shapes: the defaults
    before and the `auto` defaults in one process, each traced (on a CPU the host's events stand in for
    the GPU's kernels) and its compiled program saved."""
    import gzip

    bench = load("gpu_bench")
    out, prof = tmp_path / "gpu.json", tmp_path / "prof"
    assert (
        bench.main(
            ["--smoke", "--parts", "device,train256", "--one-process", "--profile", str(prof), "--json", str(out)]
        )
        == 0
    )
    rows = {r["variant"]: r for r in json.loads(out.read_text())["train"]}
    assert set(rows) == {"cola_1b before", "cola_1b auto"}
    for name, row in rows.items():
        assert positive(row["step_ms"], row["tokens_per_s"]), row
        events = json.loads((prof / f"{bench._slug(name)}.events.json").read_text())
        assert events["steps"] == bench.PROFILE_STEPS and positive(events["step_s"])
        assert "ENTRY" in gzip.open(prof / f"{bench._slug(name)}.hlo.gz", "rt").read()
        assert "time_by_category" in row["profile"] or "measured_step_s" in row["profile"], row["profile"]
