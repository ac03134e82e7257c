"""Perlmutter-like A100 nodes, the BOOST paper's setup: 4 x A100-SXM4 per node, NVLink3 inside,
Slingshot-11 between. Bandwidths are per GPU and *effective* (what a ring collective achieves), so
the α-β formulas in boost_jax/planner/pricing/cost.py use them directly.

Provenance: three numbers are FITTED to BOOST's reported LLaMA-7B TP-4 measurements (listed in
`c.fitted` below, reproduced by `python benchmarks/planner_validation.py --fit`, and guarded by
tests/test_planner.py to within 10%): intra_bandwidth and intra_latency (least squares on the three
per-layer forward TP timings) and gemm_half_dim (the vanilla/BTP GEMM-efficiency ratio). Every
other number is a datasheet value or a stated assumption, fitted to nothing. BOOST's end-to-end
iteration times were not used to set any constant: they are the held-out check
(benchmarks/planner.md, "Validation")."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.name = "a100_4x"
    c.gpus_per_node = 4
    # Dense bf16 tensor-core peak, A100 datasheet (also the MFU denominator in boost_jax/runtime/metrics.py).
    c.peak_flops = 312e12
    # 40 GB: Perlmutter's standard GPU nodes carry A100-40GB (a set of 80 GB nodes exists; copy this
    # file with 80e9 / 2.0e12 for those). HBM2 bandwidth of the 40 GB part: 1555 GB/s.
    c.hbm_bytes = 40e9
    c.hbm_bandwidth = 1.555e12
    # Part of HBM a plan may use: allocator fragmentation, CUDA context, XLA workspace. JAX
    # preallocates only 75% by default: run with XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 to get this much.
    c.usable_hbm_fraction = 0.9
    # NVLink3: 12 links x 25 GB/s = 300 GB/s per direction per GPU. Effective all-reduce bus bandwidth
    # 220 GB/s and 10 µs per ring step are the least-squares fit to BOOST's own TP-4 forward timings
    # (0.25 GiB in 2 all-reduces: 2.01 ms; 1.30 GiB in 4: 9.87 ms; 0.22 GiB in 4: 1.85 ms).
    c.intra_bandwidth = 220e9
    c.intra_latency = 10e-6
    # Slingshot-11: 4 NICs x 200 Gb/s = 25 GB/s per GPU; ~80% of it in NCCL ring collectives.
    # Latency per ring step across the dragonfly network: ~20 µs (NCCL over libfabric/CXI).
    c.inter_bandwidth = 20e9
    c.inter_latency = 20e-6
    # Large bf16 GEMMs run at ~85% of peak (cuBLAS, 4096^3: ~265 TFLOP/s). Skinny-GEMM penalty: each
    # dim x of an (m, k, n) GEMM scales that by x / (x + 96). 96 makes r/p = 256 (vanilla TP-4 at
    # r = 1024) reach 0.8x the efficiency of r = 1024 (BTP), BOOST's measured 59% vs 70-75% HFU.
    c.gemm_efficiency = 0.85
    c.gemm_half_dim = 96
    # FlashAttention-2, causal, head dim 128, fwd+bwd on A100: ~190 TFLOP/s (FA2 paper) = 0.6 of peak.
    # Only used with --attention flash (our XLA attention materialises the scores; see cost.py).
    c.flash_efficiency = 0.6
    # Memory-bound elementwise work (norms, σ, RoPE, residual adds, SwiGLU products): every activation
    # element produced is moved through HBM about this many times over forward + backward (written,
    # read by its consumer, read again by the backward, its gradient written and read).
    c.elementwise_passes = 6
    # HBM passes per byte of activation kept for the backward (boost_jax/planner/pricing/cost.py): the
    # scanned layer stack writes each kept array into its stacked residual and reads it back, the same
    # XLA program on any GPU. Not measured on an A100: h100_8x.py's fit to measured H100 steps, taken as
    # it is; the A100 step-time tables of the scanned picks agree (benchmarks/RESULTS.md 2026-11-29,
    # eleventh session).
    c.kept_passes = 8.919
    c.fitted = {
        "kept_passes": "8.919: h100_8x.py's fit to the measured H100 steps of benchmarks/h100_measured.json "
        "(2026-11-26 to 2026-11-27), the same program's passes; not refitted on an A100",
        "intra_bandwidth": "least squares (with intra_latency) to BOOST's LLaMA-7B TP-4 per-layer forward "
        "times on A100 NVLink: full-rank 2.01 ms, vanilla low-rank 9.87 ms, BTP 1.85 ms "
        "(batch 4 x seq 4096, bf16); the fit gives 217 GB/s, rounded to 220",
        "intra_latency": "the same least-squares fit; gives 9.8 µs, rounded to 10",
        "gemm_half_dim": "BOOST's 7B GEMM efficiency, vanilla TP-4 ~59% vs BTP ~70-75% HFU: s(256)/s(1024) "
        "= 0.81 gives h = 85; 96 (ratio 0.80) is used",
    }
    return c
