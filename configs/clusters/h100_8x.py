"""DGX/HGX H100 nodes: 8 x H100-SXM5-80GB per node, NVLink4 + NVSwitch inside, one InfiniBand NDR
NIC per GPU between. Bandwidths are per GPU and *effective* (what a ring collective achieves).

Provenance: peaks and bandwidths are datasheet values, link efficiencies and kernel efficiencies are
published benchmark figures (nccl-tests, cuBLAS, FlashAttention papers) or assumptions, as each
comment says. The step-time constants in the block at the end (`c.fitted` lists them) are fitted to
the train steps measured on one H100 (benchmarks/h100_measured.json: cola_1b and llama_1b at seq 256 x
32 and 4096 x 4, each remat policy) by `python benchmarks/planner_time_fit.py --write`, which chooses
which constants to fit by leave-one-out and rewrites the block; tests/test_planner_time.py checks
those rows within 15% and the planner's remat pick against the measured fastest. Nothing multi-GPU
is measured: the links and everything a plan on several GPUs adds are predictions."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.name = "h100_8x"
    c.gpus_per_node = 8
    # Dense bf16 tensor-core peak, H100 SXM5 datasheet (1979 TFLOP/s is with 2:4 sparsity).
    c.peak_flops = 989e12
    # H100 SXM5 80 GB HBM3, 3.35 TB/s.
    c.hbm_bytes = 80e9
    c.hbm_bandwidth = 3.35e12
    # See a100_4x.py: set XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 (JAX preallocates 75% by default).
    c.usable_hbm_fraction = 0.9
    # NVLink4: 18 links x 25 GB/s = 450 GB/s per direction per GPU. nccl-tests all-reduce bus
    # bandwidth on 8 x H100 is ~360 GB/s without NVLS (~470 with it); we take 360 (80% of hardware,
    # a little above the 73% the A100 fit gives). ~7 µs per ring step.
    c.intra_bandwidth = 360e9
    c.intra_latency = 7e-6
    # InfiniBand NDR 400 Gb/s = 50 GB/s per GPU (one ConnectX-7 per GPU); ~80% in ring collectives.
    c.inter_bandwidth = 40e9
    c.inter_latency = 15e-6
    # Large bf16 GEMMs: ~750 TFLOP/s of 989 with cuBLAS(Lt). Hopper's bigger tiles need bigger dims to
    # fill the machine, hence a larger half-efficiency dimension than the A100's 96.
    c.gemm_efficiency = 0.75
    c.gemm_half_dim = 128
    # FlashAttention-2 on H100 reaches ~350 TFLOP/s fwd+bwd, FlashAttention-3 ~600: take 0.45 of peak.
    c.flash_efficiency = 0.45
    c.elementwise_passes = 6  # see a100_4x.py
    # HBM passes per byte of activation kept for the backward (boost_jax/planner/pricing/cost.py): not known
    # from a datasheet; 0 leaves it unpriced, the fitted block below sets it
    c.kept_passes = 0.0
    c.fitted = {}
    # planner_time_fit: begin (written by `python benchmarks/planner_time_fit.py --write`; it overrides the
    # values above with the constants fitted to the measured steps)
    c.kept_passes = 8.919
    c.fitted = {
        "kept_passes": "8.919: least squares of the relative step-time error over the 8 fit "
        "rows of benchmarks/h100_measured.json (2026-11-26 to 2026-11-27; leave-one-out RMS 5.4%)",
    }
    # planner_time_fit: end
    return c
