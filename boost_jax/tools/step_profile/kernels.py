"""Every kernel of an optimized GPU program, read from its HLO text. A kernel is what the GPU launches:
a fusion, a GEMM (a Triton GEMM fusion, a cuBLAS or cuDNN call), cuDNN attention, a Pallas/Triton
kernel, a copy, a collective. Each instruction of a computation the GPU executes (the entry, while
bodies and conditions, conditional branches, async computations) is one kernel, run as many times
per step as its loops' trip counts say (a loop whose count the program hides, the accumulation loop,
runs `accumulation` times; a kernel in a conditional's branch carries the chain (`branch`): the
pricing runs only each conditional's costliest branch, branches.py; each loop iteration reads its
predicate back as one more launch). Bitcasts, tuples, parameters, constants and the `-done`
halves of async pairs launch nothing. Each kernel carries its FLOPs (a dot's 2 x output x
contraction; cuDNN attention's batched GEMMs, halved under a causal mask; a Pallas/Triton kernel
whose name carries a GEMM shape, kernels/priced.py, that GEMM's: it is then priced as that GEMM, in
its shape class; any other custom call has none), the bytes it reads and writes in HBM (each operand
once and each output, except that a dynamic-update-slice writes its update in place and a slice
reads the slice) and, for a collective, the bytes it moves over the
target's links (hlo_comm's payload rules).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from boost_jax.kernels.priced import gemm_shape
from boost_jax.tools.hlo_comm import (
    HloModule,
    Instruction,
    collective_of,
    hlo_attribute,
    operand_shape,
    parse_ints,
    parse_module,
    parse_replica_groups,
)
from boost_jax.tools.step_profile.branches import paths
from boost_jax.tools.step_profile.categories import categorize
from boost_jax.tools.step_profile.overlap import called, windows
from boost_jax.tools.step_profile.shapes import DTYPE_BYTES, shape_bytes, shape_dims, shape_dtype, tuple_members
from boost_jax.tools.step_profile.sources import Frame, short_path, stack_frames

# Instructions that launch nothing: views, bookkeeping, the halves of async pairs that only wait.
FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "domain",
    "async-start",
    "async-update",
    "async-done",
    "all-reduce-done",
    "all-gather-done",
    "collective-permute-done",
    "reduce-scatter-done",
    "all-to-all-done",
    "copy-done",
    "send-done",
    "recv-done",
    "partition-id",
    "replica-id",
    "get-dimension-size",
    "optimization-barrier",
}
COLLECTIVE_OPS = {
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "all-reduce-start",
    "all-gather-start",
    "reduce-scatter-start",
    "all-to-all-start",
    "collective-permute-start",
    "collective-broadcast",
}
# Elementwise ops a fusion computes for each output element it is asked for: a slice of their result
# reads only the slice of their operand (a stacked weight cast, then one layer sliced).
_PER_ELEMENT = {"convert", "bitcast-convert", "negate", "abs", "sqrt", "rsqrt", "exponential", "tanh", "copy"}
_GEMM_BACKENDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas", "__cudnn$fusion", "__triton_fusion_gemm")


@dataclass
class Kernel:
    """One kernel of the program. `flops`, `bytes` and `wire_bytes` are per execution; `count` is
    executions per step."""

    name: str  # the HLO instruction (what a profiler trace calls hlo_op)
    opcode: str  # fusion, custom-call, copy, all-reduce-start, ...
    kind: str  # what runs: gemm, attention, custom (a Pallas/Triton kernel), collective, fusion, op
    count: int
    flops: float = 0.0
    bytes: float = 0.0
    computation: str = ""
    backend: str = ""  # fusion kind (kLoop, __triton_nested_gemm_fusion, ...) or custom-call target
    op_name: str = ""  # JAX's name for it (HLO metadata)
    source: str = ""  # innermost project frame, "file:function:line"
    sources: tuple = ()  # the frames above it, innermost first (file:function)
    fused: tuple = ()  # opcodes inside a fusion
    gemm: tuple = ()  # (batch, m, n, k, operand dtype) of a GEMM
    attention: tuple = ()  # (batch, heads, queries, keys, head dim, backward, causal) of cuDNN attention
    collective: dict = field(default_factory=dict)  # kind, group_size, wire_bytes, steps, crosses_nodes
    category: str = ""
    remat_clone: bool = False  # a copy XLA's rematerialization made of another kernel (`remat_clone`)
    branch: tuple = ()  # the conditionals' branches it runs in, outermost first (branches.paths)
    skipped: bool = False  # in a branch the pricing takes not to run (branches.skip_untaken)
    window: tuple | None = None  # an async collective: the compute between its start and done (step_overlap)
    time_s: float = 0.0  # per execution, once priced

    def total_s(self) -> float:
        return self.time_s * self.count


def _fused_computation(ins: Instruction) -> str | None:
    m = re.search(r"\bcalls=%?([\w.\-]+)", ins.rest)
    return m.group(1) if m else None


def _backend_kind(ins: Instruction) -> str:
    m = re.search(r'"fusion_backend_config"\s*:\s*\{\s*"kind"\s*:\s*"([^"]+)"', ins.rest)
    if m:
        return m.group(1)
    m = re.search(r"\bkind=(k\w+)", ins.rest)
    return m.group(1) if m else ""


def _custom_target(ins: Instruction) -> str:
    m = re.search(r'custom_call_target="([^"]+)"', ins.rest)
    return m.group(1) if m else ""


def _operand_names(operands: list[str]) -> list[str]:
    return [re.sub(r"/\*.*?\*/", "", o).strip().rpartition(" ")[2].lstrip("%") for o in operands]


def _dot_shape(ins: Instruction, symbols: dict[str, str]) -> tuple:
    """(batch, m, n, k, lhs dtype) of a dot instruction."""
    operands, attrs = ins.operands_attrs()
    lhs, rhs = (operand_shape(o, symbols) for o in operands[:2])
    ld, rd = shape_dims(lhs), shape_dims(rhs)

    def dims(key):
        m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
        return [int(x) for x in m.group(1).split(",") if x] if m else []

    lb, lc, rb, rc = (
        dims("lhs_batch_dims"),
        dims("lhs_contracting_dims"),
        dims("rhs_batch_dims"),
        dims("rhs_contracting_dims"),
    )
    batch = math.prod(ld[i] for i in lb) if ld else 1
    k = math.prod(ld[i] for i in lc) if ld else 1
    m = math.prod(d for i, d in enumerate(ld) if i not in lb and i not in lc) if ld else 1
    n = math.prod(d for i, d in enumerate(rd) if i not in rb and i not in rc) if rd else 1
    return (batch, m, n, k, shape_dtype(lhs))


def _cublas_shape(ins: Instruction, symbols: dict[str, str]) -> tuple:
    """(batch, m, n, k, dtype) of a cuBLAS custom call, from its dot_dimension_numbers."""
    operands, _ = ins.operands_attrs()
    lhs, rhs = (operand_shape(o, symbols) for o in operands[:2])
    ld, rd = shape_dims(lhs), shape_dims(rhs)

    def dims(key):
        m = re.search(rf'"{key}"\s*:\s*\[([^\]]*)\]', ins.rest)
        return [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []

    lb, lc, rb, rc = (
        dims(k)
        for k in (
            "lhs_batch_dimensions",
            "lhs_contracting_dimensions",
            "rhs_batch_dimensions",
            "rhs_contracting_dimensions",
        )
    )
    batch = math.prod(ld[i] for i in lb)
    k = math.prod(ld[i] for i in lc)
    m = math.prod(d for i, d in enumerate(ld) if i not in lb and i not in lc)
    n = math.prod(d for i, d in enumerate(rd) if i not in rb and i not in rc)
    return (batch, m, n, k, shape_dtype(lhs))


def _attention_shape(ins: Instruction) -> tuple:
    """cuDNN fused attention's (batch, heads, queries, keys, head dim, backward, causal) from its backend
    config and operand layouts; () when the config names no scores' shape."""
    m = re.search(r'"intermediate_tensor_shape"\s*:\s*\{[^{]*?"dimensions"\s*:\s*\[([^\]]*)\]', ins.rest)
    if m is None:
        return ()
    b, h, sq, sk = (int(x) for x in re.findall(r"\d+", m.group(1))[:4])
    q = re.search(r"operand_layout_constraints=\{([^}]*)\}", ins.rest)
    qdims = shape_dims(q.group(1)) if q else []
    d = math.prod(qdims) // max(b * h * sq, 1) if qdims else 0
    backward = "Backward" in _custom_target(ins)
    causal = bool(re.search(r'"mask_type"\s*:\s*"(CAUSAL|PADDING_CAUSAL)"', ins.rest))
    return (b, h, sq, sk, d, backward, causal)


def _attention_flops(shape: tuple) -> float:
    """The scores' GEMM and the values' GEMM (forward; the backward runs five, the scores recomputed),
    halved when causal."""
    if not shape:
        return 0.0
    b, h, sq, sk, d, backward, causal = shape
    return 2 * 2 * b * h * sq * sk * d * (2.5 if backward else 1.0) * (0.5 if causal else 1.0)


class _Reader:
    """Per-instruction facts of one module: kernels' bytes, FLOPs, sources."""

    def __init__(self, module: HloModule, frames: dict[int, Frame]):
        self.module = module
        self.frames = frames
        self._users_of: dict[str, dict] = {}

    # --- fused computations
    def _users(self, comp: str) -> dict[str, list[tuple[Instruction, int]]]:
        users: dict[str, list[tuple[Instruction, int]]] = {}
        for ins in self.module.computations.get(comp, []):
            operands, _ = ins.operands_attrs()
            for i, name in enumerate(_operand_names(operands)):
                users.setdefault(name, []).append((ins, i))
        return users

    def _params(self, comp: str) -> dict[int, Instruction]:
        params = {}
        for p in self.module.computations.get(comp, []):
            if p.opcode == "parameter":
                idx = re.match(r"\s*(\d+)", p.rest)
                params[int(idx.group(1)) if idx else len(params)] = p
        return params

    def _read(self, comp: str, name: str, full: float, depth: int = 0) -> float:
        """Bytes of `name` (in fused computation `comp`) read through its users: a slice or dynamic
        slice reads its slice, a dynamic-update-slice's buffer nothing (updated in place), a bitcast,
        a tuple element, a nested fusion's parameter or an elementwise op of the same shape
        (`_PER_ELEMENT`, not the root) what their own users read; any other use all."""
        users = self._users_of.get(comp)
        if users is None:  # (setdefault would rebuild the index on every call)
            users = self._users_of[comp] = self._users(comp)
        total = 0.0
        for user, pos in users.get(name, []):
            if depth > 8:
                return full
            if user.opcode == "bitcast":
                total += self._read(comp, user.name, full, depth + 1)
            elif user.opcode == "get-tuple-element":
                total += self._read(comp, user.name, shape_bytes(user.shape), depth + 1)
            elif (
                user.opcode in _PER_ELEMENT
                and user.name != self._root(comp)
                and shape_dims(user.shape) == self._dims(comp, name)
            ):  # computed per element it is asked for: what its own users read, in this dtype
                out = shape_bytes(user.shape)
                total += self._read(comp, user.name, out, depth + 1) * full / out if out else full
            elif user.opcode in ("dynamic-slice", "slice") and pos == 0:
                total += shape_bytes(user.shape)
            elif user.opcode == "dynamic-update-slice" and pos == 0:
                continue
            elif user.opcode == "fusion":
                nested = _fused_computation(user)
                p = self._params(nested or "").get(pos)
                if p is None:
                    return full
                total += self._read(nested, p.name, full, depth + 1)
            else:
                return full
        return min(total, full)

    def _dims(self, comp: str, name: str) -> list:
        shape = self.module.symbols.get(comp, {}).get(name)
        return shape_dims(shape) if shape else None

    def fusion_bytes(self, ins: Instruction) -> float:
        """HBM bytes a fusion reads and writes (see the module docstring's rules)."""
        comp = _fused_computation(ins)
        instrs = self.module.computations.get(comp or "", [])
        symbols = self.module.symbols[ins.computation]
        operands, _ = ins.operands_attrs()
        op_shapes = [operand_shape(o, symbols) for o in operands]
        if not instrs:
            return sum(shape_bytes(s) for s in op_shapes) + shape_bytes(ins.shape)
        params = self._params(comp)
        reads = 0.0
        for i, shape in enumerate(op_shapes):
            p = params.get(i)
            reads += self._read(comp, p.name, shape_bytes(shape)) if p is not None else shape_bytes(shape)
        root = next((x for x in instrs if x.name == self._root(comp)), instrs[-1])
        return reads + self._written(root, comp)

    def _root(self, comp: str) -> str:
        return self.module.roots.get(comp, "")

    def _written(self, root: Instruction, comp: str) -> float:
        local = {x.name: x for x in self.module.computations.get(comp, [])}
        if root.opcode == "tuple":
            operands, _ = root.operands_attrs()
            return sum(self._written(local[n], comp) if n in local else 0.0 for n in _operand_names(operands))
        if root.opcode == "bitcast":
            operands, _ = root.operands_attrs()
            n = _operand_names(operands)[0]
            return self._written(local[n], comp) if n in local else shape_bytes(root.shape)
        if root.opcode == "dynamic-update-slice":
            operands, _ = root.operands_attrs()
            return shape_bytes(operand_shape(operands[1], self.module.symbols[comp]))
        return shape_bytes(root.shape)

    def fused_opcodes(self, comp: str | None, depth: int = 0) -> set[str]:
        out = set()
        for x in self.module.computations.get(comp or "", []):
            out.add(x.opcode)
            if x.opcode == "fusion" and depth < 4:
                out |= self.fused_opcodes(_fused_computation(x), depth + 1)
        return out

    def dots(self, comp: str | None, depth: int = 0) -> list[tuple]:
        out = []
        for x in self.module.computations.get(comp or "", []):
            if x.opcode in ("dot", "convolution"):
                out.append(_dot_shape(x, self.module.symbols[x.computation]))
            elif x.opcode == "fusion" and depth < 4:
                out += self.dots(_fused_computation(x), depth + 1)
        return out

    # --- sources
    def source(self, ins: Instruction) -> tuple[str, tuple]:
        m = re.search(r"stack_frame_id=(\d+)", ins.rest)
        if m is None:
            return "", ()
        fid, chain = int(m.group(1)), []
        while fid and fid in self.frames and len(chain) < 64:
            f = self.frames[fid]
            chain.append(f"{short_path(f.file)}:{f.function}")
            fid = f.parent if f.parent != fid else 0
        f = self.frames.get(int(m.group(1)))
        return (f"{short_path(f.file)}:{f.function}:{f.line}" if f else ""), tuple(chain)


def _executed(module: HloModule) -> list[str]:
    """Computations whose instructions are kernels: the entry and what it runs through while loops,
    conditionals, calls and async computations (not fused computations or reducers)."""
    out, todo = [], [module.entry]
    seen = set()
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in module.computations:
            continue
        seen.add(comp)
        out.append(comp)
        for ins in module.computations[comp]:
            todo.extend(called(ins))
    return out


def kernels(hlo_text: str, accumulation: int = 1, mesh=None, gpus_per_node: int = 8) -> list[Kernel]:
    """Every kernel of an optimized GPU program, with its executions per step, FLOPs and bytes, and
    its category (`categorize`). `accumulation`: the trip count of a loop whose count the program
    hides (the GPU step's accumulation loop)."""
    module = parse_module(hlo_text)
    reader = _Reader(module, stack_frames(hlo_text))
    trips = module.trips(accumulation)
    branch_of = paths(module)
    out = []
    for comp in _executed(module):
        count = trips.get(comp, 1) or 1
        symbols = module.symbols[comp]
        for ins in module.computations[comp]:
            k = _kernel(ins, reader, symbols, count, mesh, module.num_devices, gpus_per_node)
            if k is None:
                continue
            k.category = categorize(k)
            k.branch = branch_of.get(comp, ())
            out.append(k)
        # each iteration of a while loop reads its condition's predicate back on the host
    for (caller, callee), _ in module.loop_trips.items():
        if (
            any(
                ins.opcode == "while" and re.search(rf"\bcondition=%?{re.escape(callee)}\b", ins.rest)
                for ins in module.computations.get(caller, [])
            )
            and caller in trips
        ):
            k = Kernel(f"{callee} (loop predicate)", "while", "sync", (trips.get(callee) or 1), computation=callee)
            k.category, k.branch = categorize(k), branch_of.get(callee, ())
            out.append(k)
    windows(module, out, trips)
    return out


_REMAT = re.compile(r"\.remat\d*(\.|$)")


def remat_clone(name: str) -> bool:
    """Whether an instruction is a clone XLA's HloRematerialization made (`NAME.remat`, `.remat2`, ...).
    A deviceless compile budgets memory below the GPU's and its rematerialization estimate runs far
    above the final peak, so it clones kernels (re-running fusions and GEMMs for a later use) that
    cut the peak by well under 1%; the measured H100 steps are priced within 15% only without them
    (benchmarks/RESULTS.md 2026-11-27), so `Costs.remat_clone_share` is 0 until a GPU-compiled
    program shows them."""
    return bool(_REMAT.search(name))


def _kernel(
    ins: Instruction, reader: _Reader, symbols: dict[str, str], count: int, mesh, num_devices: int, gpus_per_node: int
) -> Kernel | None:
    op = ins.opcode
    if op in FREE:
        return None
    meta = re.search(r'op_name="([^"]*)"', ins.rest)
    source, chain = reader.source(ins)
    k = Kernel(
        ins.name,
        op,
        "op",
        count,
        computation=ins.computation,
        op_name=meta.group(1) if meta else "",
        source=source,
        sources=chain,
        remat_clone=remat_clone(ins.name),
    )
    operands, _ = ins.operands_attrs()
    op_shapes = [operand_shape(o, symbols) for o in operands]
    if op in COLLECTIVE_OPS:
        c = collective_of(ins, symbols, num_devices if mesh is None else mesh.devices.size, mesh)
        size = c.elements * DTYPE_BYTES.get(c.dtype, 4)
        n = max(c.group_size, 1)
        base = c.kind
        if base == "all-reduce":
            wire, steps = 2 * (n - 1) / n * size, 2 * (n - 1)
        elif base in ("all-gather", "reduce-scatter", "all-to-all"):
            wire, steps = (n - 1) / n * size, n - 1
        else:
            wire, steps = size, 1
        crosses = n > gpus_per_node or (mesh is not None and _crosses_nodes(ins, num_devices, gpus_per_node))
        k.kind, k.bytes = "collective", 0.0
        k.collective = {
            "kind": base,
            "group_size": n,
            "payload_bytes": size,
            "wire_bytes": wire,
            "steps": steps,
            "crosses_nodes": bool(crosses),
        }
        return k
    if op == "fusion":
        comp = _fused_computation(ins)
        k.backend = _backend_kind(ins)
        k.fused = tuple(sorted(reader.fused_opcodes(comp)))
        dots = reader.dots(comp)
        k.bytes = reader.fusion_bytes(ins)
        if dots or any(k.backend.startswith(b) for b in _GEMM_BACKENDS):
            k.kind = "gemm"
            k.flops = float(sum(2 * b * m * n * kk for b, m, n, kk, _ in dots))
            k.gemm = max(dots, key=lambda d: d[0] * d[1] * d[2] * d[3]) if dots else ()
        else:
            k.kind = "fusion"
        return k
    if op == "custom-call":
        return _custom_call(k, ins, symbols, op_shapes)
    if op in ("dot", "convolution"):
        k.kind = "gemm"
        k.gemm = _dot_shape(ins, symbols)
        b, m, n, kk, _ = k.gemm
        k.flops = float(2 * b * m * n * kk)
        k.bytes = sum(shape_bytes(s) for s in op_shapes) + shape_bytes(ins.shape)
        return k
    if op == "dynamic-update-slice":
        k.bytes = 2 * shape_bytes(op_shapes[1]) if len(op_shapes) > 1 else shape_bytes(ins.shape)
    elif op in ("dynamic-slice", "slice"):
        k.bytes = 2 * shape_bytes(ins.shape)
    elif op == "copy-start":
        k.bytes = 2 * shape_bytes(op_shapes[0]) if op_shapes else 0.0
    else:
        k.bytes = sum(shape_bytes(s) for s in op_shapes) + shape_bytes(ins.shape)
    k.fused = (op,)
    return k


def _custom_call(k: Kernel, ins: Instruction, symbols: dict[str, str], op_shapes: list) -> Kernel:
    """A custom call's kernel: cuBLAS GEMMs and cuDNN attention by their shapes, Pallas/Triton kernels
    by name (a GEMM where the name carries one, kernels/priced.py), any other by its bytes alone."""
    target = _custom_target(ins)
    k.backend = target
    k.bytes = sum(shape_bytes(s) for s in op_shapes) + sum(
        shape_bytes(s) for s in tuple_members(ins.shape) if not s.startswith("u8[") and not s.startswith("s8[")
    )
    if target.startswith("__cublas"):
        k.kind = "gemm"
        k.gemm = _cublas_shape(ins, symbols)
        b, m, n, kk, _ = k.gemm
        k.flops = float(2 * b * m * n * kk)
    elif target.startswith("__cudnn$fmha"):
        k.kind = "attention"
        k.attention = _attention_shape(ins)
        k.flops = _attention_flops(k.attention)
    elif target == "__gpu$xla.gpu.triton" or target.startswith("triton_kernel_call"):
        name = re.search(r'\bname\s*=\s*"([^"]+)"|"name"\s*:\s*"([^"]+)"', ins.rest)
        name = (name.group(1) or name.group(2)) if name else ""
        k.kind = "custom"
        k.backend = f"{target} {name}".strip()
        shape = gemm_shape(name)
        if shape:  # a kernel that names its GEMM (kernels/priced.py): priced as a GEMM of that shape
            k.kind = "gemm"
            k.gemm = (*shape, shape_dtype(op_shapes[0]) if op_shapes else "bf16")
            k.flops = 2.0 * math.prod(shape)
    else:
        k.kind = "custom"
    return k


def _crosses_nodes(ins: Instruction, num_devices: int, gpus_per_node: int) -> bool:
    """Whether a collective's groups span GPUs of more than one node (ids are mesh positions, 8 a node)."""
    _, attrs = ins.operands_attrs()
    text = hlo_attribute(attrs, "replica_groups")
    if text is not None:
        groups = parse_replica_groups(text, num_devices)
    else:
        pairs = (hlo_attribute(attrs, "source_target_pairs") or "{}")[1:]
        groups = [parse_ints(p) for p in re.findall(r"\{([\d,\s]*)\}", pairs)]
    return any(len({d // gpus_per_node for d in g}) > 1 for g in groups)
