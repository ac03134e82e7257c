"""Run the Triton RMSNorm (and residual add + RMSNorm) kernels under Triton's interpreter on CPU (no GPU,
no torch, no jax-triton).

    TRITON_INTERPRET=1 python tests/triton_interpreted.py CASES.npz OUT.npz

CASES.npz holds, per case i: `x{i}`, `w{i}`, `dy{i}`, `ds{i}` (bfloat16 stored as uint16 with
`x{i}_dtype`), `eps{i}`, `rows{i}` and `programs{i}` (the backward's grid; 0: the module's choice). OUT.npz gets
`y{i}`, `s{i}`, `dx{i}`, `dw{i}` (dw: the
kernel's [programs, d] partials, summed) as the kernels wrote them; a case with a residual `r{i}` and
h's gradient `dh{i}` also runs the fused residual add + norm into `add_y{i}`, `add_h{i}`, `add_dx{i}`,
`add_dw{i}`, and `add_inv{i}` (1/rms, kernels/norm_gemm.py's statistics). Triton's interpreter expects torch
tensors; `HostArray` gives a numpy array the few torch methods it calls (the data stays in place).
"""

import os
import sys

import numpy as np


class _DType:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return "torch." + self.name  # how Triton reads an argument's element type

    __repr__ = __str__


_DTYPES: dict = {}  # one object per name: Triton caches an argument's type by its dtype object


class HostArray:
    def __init__(self, array, dtype_name=None):
        self.array = np.ascontiguousarray(array)
        name = dtype_name or self.array.dtype.name
        self.dtype = _DTYPES.setdefault(name, _DType(name))

    def data_ptr(self):
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args):
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, other):  # host and "device" are the same memory here
        return self


def run_case(T, x, w, dy, ds, eps, rows, programs, x_dtype):
    n, d = x.shape
    y, s = np.zeros_like(x), np.zeros(n, np.float32)
    p = programs or T.programs(n, rows)
    dx, dw = np.zeros_like(x), np.zeros((p, d), np.float32)
    hx = lambda a: HostArray(a, x_dtype)  # noqa: E731
    consts = dict(n_rows=n, d=d, eps=eps, ROWS=rows, BLOCK_D=T.block_d(d))
    T.rmsnorm_fwd_kernel[(-(-n // rows),)](hx(x), HostArray(w), hx(y), HostArray(s), **consts)
    T.rmsnorm_bwd_kernel[(p,)](hx(x), HostArray(w), hx(dy), HostArray(ds), hx(dx), HostArray(dw), **consts, PROGRAMS=p)
    return y, s, dx, dw.sum(axis=0)


def run_add_case(T, x, r, w, dy, dh, eps, rows, programs, x_dtype):
    """The fused residual add + norm: (y, h, dx, dscale, 1/rms from the statistics-only forward)."""
    n, d = x.shape
    y, h = np.zeros_like(x), np.zeros_like(x)
    p = programs or T.programs(n, rows)
    dx, dw = np.zeros_like(x), np.zeros((p, d), np.float32)
    hx = lambda a: HostArray(a, x_dtype)  # noqa: E731
    consts = dict(n_rows=n, d=d, eps=eps, ROWS=rows, BLOCK_D=T.block_d(d))
    T.add_rmsnorm_fwd_kernel[(-(-n // rows),)](hx(x), hx(r), HostArray(w), hx(y), hx(h), **consts)
    T.add_rmsnorm_bwd_kernel[(p,)](hx(h), HostArray(w), hx(dy), hx(dh), hx(dx), HostArray(dw), **consts, PROGRAMS=p)
    h2, inv = np.zeros_like(x), np.zeros(n, np.float32)
    T.add_rms_fwd_kernel[(-(-n // rows),)](hx(x), hx(r), HostArray(w), hx(h2), HostArray(inv), **consts)
    assert np.array_equal(h2, h), "the statistics-only forward wrote another h"
    return y, h, dx, dw.sum(axis=0), inv


def main(cases_path, out_path):
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Triton is imported"
    from boost_jax.kernels import rmsnorm_triton as T

    cases = np.load(cases_path)
    out = {}
    i = 0
    while f"x{i}" in cases:
        got = run_case(
            T,
            cases[f"x{i}"],
            cases[f"w{i}"],
            cases[f"dy{i}"],
            cases[f"ds{i}"],
            float(cases[f"eps{i}"]),
            int(cases[f"rows{i}"]),
            int(cases[f"programs{i}"]),
            str(cases[f"x{i}_dtype"]),
        )
        out.update({f"{k}{i}": v for k, v in zip(("y", "s", "dx", "dw"), got)})
        if f"r{i}" in cases:  # the same case through the fused residual add + norm
            got = run_add_case(
                T,
                cases[f"x{i}"],
                cases[f"r{i}"],
                cases[f"w{i}"],
                cases[f"dy{i}"],
                cases[f"dh{i}"],
                float(cases[f"eps{i}"]),
                int(cases[f"rows{i}"]),
                int(cases[f"programs{i}"]),
                str(cases[f"x{i}_dtype"]),
            )
            out.update({f"add_{k}{i}": v for k, v in zip(("y", "h", "dx", "dw", "inv"), got)})
        i += 1
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
