"""benchmarks/gpu_bench.py stays one working command: its --smoke mode (tiny shapes) on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _smoke(tmp_path, parts):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_bench.py"),
            "--smoke",
            "--steps",
            "1",
            "--parts",
            parts,
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, json.loads(out.read_text())


def test_smoke_kernels_attention_and_tests(tmp_path):
    text, res = _smoke(tmp_path, "device,rmsnorm,attention,tests")
    assert res["device"]["device_kind"] and res["device"]["versions"]["jax"]
    norms = {(r["impl"], r.get("pass")): r for r in res["rmsnorm"]}
    for impl in ("xla", "pallas", "triton"):
        for p in ("fwd", "fwd+bwd"):
            assert norms[impl, p]["gb_per_s"] > 0
    # What ran is reported, never a fallback under the kernel's name.
    assert norms["triton", "fwd"]["ran"].startswith("xla (triton unavailable")
    assert norms["pallas", "fwd"]["ran"] == "pallas (interpreted)"
    attn = {r["impl"]: r for r in res["attention"]}
    assert all(attn[i]["ms"] > 0 for i in ("xla", "chunked", "pallas"))
    assert "cudnn needs an NVIDIA GPU" in attn["cudnn"]["error"]  # a failing row; the others still ran
    assert "skipped" in res["tests"]["summary"] and res["tests"]["returncode"] == 0
    assert "| cudnn | failed: " in text and "kernel tests" in text


@pytest.mark.slow
def test_smoke_train_variants(tmp_path):
    text, res = _smoke(tmp_path, "layer7b,train1b")
    rows = {r["variant"]: r for r in res["train"]}
    assert set(rows) == {"llama_1b", "cola_1b triton norm", "cola_7b, 1 layer"}
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows.values()), rows
    assert rows["cola_1b triton norm"]["norm_ran"].startswith("xla (triton unavailable")
    assert "7B-shaped single layer" in text and "1B models" in text
