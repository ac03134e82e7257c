"""Every zoo config compiles its train step for one H100, deviceless (boost_jax/tools/aot.py).

A width XLA:GPU's Triton GEMM tiles cannot split (cola_3b / llama_3b's head_dim 100, the tensor-train
modes 19 x 18 of tt_1b's d_ff) failed the compile ("Couldn't find output tile sizes that satisfy
hlo"); such a program runs its GEMMs on cuBLAS (boost_jax/xla_gpu_flags.py `gemm_options`), the rest
keep Triton's. The default suite compiles the two failing shapes with one layer; the zoo at its
micro-batch on one H100 (seq 256) runs with -m slow, two layers each: a GEMM's tiles depend on a
layer's shapes, not on the depth (whether the whole model fits is the planner's and aot_fit's check).
"""

from pathlib import Path

import pytest

from boost_jax.model.transformer import split_widths
from boost_jax.tools import aot

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ZOO = sorted(p.stem for p in CONFIGS.glob("*.py") if p.stem != "tiny")
MICRO_BATCH = {"3b": 16, "7b": 8, "13b": 8}  # rows per step on one H100 at seq 256 (else 32)
LAYERS = 2  # the shapes that decide a GEMM's tiles are a layer's; full depth only costs compile time

pytestmark = pytest.mark.skipif(not aot.available(), reason=f"needs the aot extra: {aot.INSTALL} ({aot.missing()})")


def _zoo(name: str, seq: int, batch: int, layers: int | None = None):
    overrides = [
        f"--config.train.seq_len={seq}",
        f"--config.train.global_batch={batch}",
        "--config.train.grad_accum=1",
        "--config.data.batching=stream",
    ]
    if layers:
        overrides.append(f"--config.model.n_layers={layers}")
    return aot.load(str(CONFIGS / f"{name}.py"), overrides)


def _gemms(kernels: dict) -> tuple[int, int]:
    """(Triton GEMMs, cuBLAS GEMMs) of a compiled program's kernel counts."""
    return kernels.get("triton gemm", 0), kernels.get("cublas gemm", 0) + kernels.get("cublasLt matmul", 0)


@pytest.mark.parametrize("name,width,seq,batch", [("cola_3b", 100, 256, 16), ("tt_1b", 18, 128, 4)])
def test_widths_triton_cannot_tile_compile_on_cublas(name, width, seq, batch):
    """cola_3b's head_dim 100 (heads x head_dim into the output projection: the 4096 x 800 GEMM of
    `btd,gdr->btgr`) and tt_1b's d_ff mode 18 (its 342 = 19 x 18 wide core product of `aib,bj->aji`):
    one layer compiles for an H100, every GEMM on cuBLAS (with Triton's, both shapes fail)."""
    cfg = _zoo(name, seq, batch, layers=1)
    assert width in [w for w in split_widths(cfg.model).values() if w % 64]
    k = aot.compile_config(cfg, "h100", 1, programs=("train",))["train"]["kernels"]
    triton, cublas = _gemms(k)
    assert triton == 0 and cublas > 0, k


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_zoo_compiles_for_one_h100(name):
    """Each zoo config's train step at seq 256 and its one-H100 micro-batch compiles; GEMMs stay on
    Triton wherever its tiles split the model's widths."""
    size = name.split("_")[1]
    cfg = _zoo(name, 256, MICRO_BATCH.get(size, 32), LAYERS)
    rep = aot.compile_config(cfg, "h100", 1, programs=("train",))
    assert rep["train"]["peak_bytes"] > 0
    triton, cublas = _gemms(rep["train"]["kernels"])
    if all(w % 64 == 0 or 64 % w == 0 for w in split_widths(cfg.model).values()):
        assert triton > 0, rep["train"]["kernels"]
    else:
        assert triton == 0 and cublas > 0, rep["train"]["kernels"]
