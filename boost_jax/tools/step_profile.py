"""Where a GPU step's time goes, read from its compiled program: every kernel of the optimized HLO,
priced on a target GPU's numbers and grouped into categories.

    python -m boost_jax.tools.aot --target h100 --devices 1 --config cola_1b --profile \\
        --config.train.seq_len=256 --config.train.global_batch=32 --config.remat.policy=lowrank

A kernel is what the GPU launches: a fusion, a GEMM (a Triton GEMM fusion, a cuBLAS or cuDNN call),
cuDNN attention, a Pallas/Triton kernel, a copy, a collective. Each instruction of a computation the
GPU executes (the entry, while bodies and conditions, conditional branches, async computations) is
one kernel, run as many times per step as its loops' trip counts say (tools/hlo_comm.py reads them;
a loop whose count the program hides, the accumulation loop, runs `accumulation` times; each branch
of a conditional counts as if it ran, and each loop iteration reads its predicate back as one more
launch). Bitcasts,
tuples, parameters, constants and the `-done` halves of async pairs launch nothing. Each kernel
carries:

* FLOPs: a dot's 2 x output x contraction (GEMM), cuDNN attention's two (forward) or five (backward)
  batched GEMMs, halved under a causal mask;
* bytes: what it reads and writes in HBM: each operand once and each output, except that a
  dynamic-update-slice writes its update slice in place (its buffer is neither read nor rewritten)
  and a dynamic-slice or slice of an operand reads the slice, not the operand;
* for a collective, the bytes it moves over the target's links (hlo_comm's payload rules).

`price` gives each kernel a time on a `Target` (HBM bandwidth, dense bf16 peak, NVLink and network
bandwidth and latency) under `Costs` fitted to measured steps (benchmarks/step_profile_fit.py): a
GEMM runs at max(FLOPs / (peak x efficiency of its shape class), bytes / bandwidth), attention at a
fixed efficiency, everything else at HBM bandwidth, a collective at its ring's bandwidth and latency,
and every kernel launch costs `launch_s` (the "launch" category). A deviceless compile has no GEMM
autotuner, so its GEMMs are Triton fusions with default tiles where the GPU would pick cuBLAS or
better tiles per shape: a GEMM is priced by its shape (`gemm_class`), never by the backend named.
Collectives are added as if none overlapped compute (the bound a step reaches without overlap).

`categorize(kernel)` puts a kernel in one of CATEGORIES by what runs (GEMM, attention, collective,
copy) and, for the rest, by the project source line the kernel came from (the HLO's stack frames:
kernels/rmsnorm.py -> norm, model/loss.py -> loss, the train step's update in runtime/step.py or
optax -> optimizer); data movement alone (transposes, slices, updates in place, copies) is
copies/layout, any other fusion elementwise. `measured(events, hlo_text)` groups the kernels of a
jax.profiler trace of the same program (`trace_events`) by the same function, so a measured step and
its prediction sit side by side (`side_by_side`).

Nothing here imports jax at module level.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

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

CATEGORIES = ("gemm", "attention", "norm", "elementwise", "copies/layout", "optimizer", "loss", "collectives", "launch")
COSTS_FILE = Path(__file__).with_name("targets") / "step_costs.json"

_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_DIMS = re.compile(r"\d+")

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
# Opcodes that only move data (inside a fusion: a fusion of these alone is a copy or a layout change).
MOVES = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "copy",
    "transpose",
    "reshape",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "broadcast",
    "iota",
    "gather",
    "scatter",
    "reverse",
}
_GEMM_BACKENDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas", "__cudnn$fusion", "__triton_fusion_gemm")


# ------------------------------------------------------------------------------------- shapes


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (tuples summed; tokens and unknown types 0)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        n = math.prod(int(d) for d in _DIMS.findall(dims.replace("<=", "")))
        total += n * _BYTES.get(dtype, 0)
    return total


def shape_dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in _DIMS.findall(m.group(2))] if m else []


def _dtype(shape: str) -> str:
    m = _ARRAY.search(shape)
    return m.group(1) if m else ""


def _tuple_members(shape: str) -> list[str]:
    """The top-level members of a tuple shape (the shape itself when it is an array)."""
    s = shape.strip()
    if not s.startswith("("):
        return [s]
    inner, depth, start, out = s[1:-1], 0, 0, []
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(inner[start:i])
            start = i + 1
    out.append(inner[start:])
    return [re.sub(r"/\*.*?\*/", "", m).strip() for m in out if m.strip()]


# ------------------------------------------------------------------------------- stack frames


@dataclass(frozen=True)
class Frame:
    file: str
    function: str
    line: int
    parent: int  # the caller's frame id (0: none)


def stack_frames(hlo_text: str) -> dict[int, Frame]:
    """{stack_frame_id: Frame} from the module's FileNames / FunctionNames / FileLocations / StackFrames
    tables (XLA prints them after the header when the program kept its source locations). The printed
    parent_frame_id is one more than the caller's id (1: no caller)."""
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
            continue
        if current is None:
            continue
        m = re.match(r"(\d+) (.*)$", line)
        if m is None:
            if line.strip() == "" or not line[0].isdigit():
                current = None
            continue
        current[int(m.group(1))] = m.group(2)
        if line.startswith("ENTRY") or line.startswith("%"):
            break
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in sections.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in sections.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", v)
        fn = re.search(r"function_name_id=(\d+)", v)
        ln = re.search(r"\bline=(\d+)", v)
        locations[k] = (
            files.get(int(f.group(1)), "") if f else "",
            functions.get(int(fn.group(1)), "") if fn else "",
            int(ln.group(1)) if ln else 0,
        )
    frames = {}
    for k, v in sections.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        parent = re.search(r"parent_frame_id=(\d+)", v)
        file, function, line = locations.get(int(loc.group(1)), ("", "", 0)) if loc else ("", "", 0)
        frames[k] = Frame(file, function, line, max(int(parent.group(1)) - 1, 0) if parent else 0)
    return frames


# ------------------------------------------------------------------------------------ kernels


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
    collective: dict = field(default_factory=dict)  # kind, group_size, wire_bytes, steps, crosses_nodes
    category: str = ""
    remat_clone: bool = False  # a copy XLA's rematerialization made of another kernel (`remat_clone`)
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
    return (batch, m, n, k, _dtype(lhs))


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
    return (batch, m, n, k, _dtype(lhs))


def _attention_flops(ins: Instruction) -> float:
    """cuDNN fused attention: the scores' GEMM and the values' GEMM (forward; the backward runs five,
    the scores recomputed), on [batch, heads, queries, keys] from its backend config, halved when causal."""
    m = re.search(r'"intermediate_tensor_shape"\s*:\s*\{[^{]*?"dimensions"\s*:\s*\[([^\]]*)\]', ins.rest)
    if m is None:
        return 0.0
    b, h, sq, sk = (int(x) for x in re.findall(r"\d+", m.group(1))[:4])
    q = re.search(r"operand_layout_constraints=\{([^}]*)\}", ins.rest)
    qdims = shape_dims(q.group(1)) if q else []
    d = math.prod(qdims) // max(b * h * sq, 1) if qdims else 0
    flops = 2 * 2 * b * h * sq * sk * d
    if "Backward" in _custom_target(ins):
        flops *= 2.5
    if re.search(r'"mask_type"\s*:\s*"(CAUSAL|PADDING_CAUSAL)"', ins.rest):
        flops *= 0.5
    return float(flops)


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
        a tuple element or a nested fusion's parameter what their own users read; any other use all."""
        users = self._users_of.setdefault(comp, self._users(comp))
        total = 0.0
        for user, pos in users.get(name, []):
            if depth > 8:
                return full
            if user.opcode == "bitcast":
                total += self._read(comp, user.name, full, depth + 1)
            elif user.opcode == "get-tuple-element":
                total += self._read(comp, user.name, shape_bytes(user.shape), depth + 1)
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
            chain.append(f"{_short(f.file)}:{f.function}")
            fid = f.parent if f.parent != fid else 0
        f = self.frames.get(int(m.group(1)))
        return (f"{_short(f.file)}:{f.function}:{f.line}" if f else ""), tuple(chain)


def _short(path: str) -> str:
    """A source path from the package down (`boost_jax/model/loss.py`), else its last two parts."""
    i = path.rfind("boost_jax/")
    return path[i:] if i >= 0 else "/".join(path.split("/")[-2:])


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
            keys = ()
            if ins.opcode == "while":
                keys = ("body", "condition")
            elif ins.opcode == "conditional":
                keys = ("true_computation", "false_computation", "branch_computations")
            elif ins.opcode in ("call", "async-start"):
                keys = ("calls", "to_apply")
            for key in keys:
                for m in re.finditer(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", ins.rest):
                    todo.extend(c.lstrip("%") for c in re.findall(r"%?([\w.\-]+)", m.group(1)))
    return out


def kernels(hlo_text: str, accumulation: int = 1, mesh=None, gpus_per_node: int = 8) -> list[Kernel]:
    """Every kernel of an optimized GPU program, with its executions per step, FLOPs and bytes, and
    its category (`categorize`). `accumulation`: the trip count of a loop whose count the program
    hides (the GPU step's accumulation loop)."""
    module = parse_module(hlo_text)
    reader = _Reader(module, stack_frames(hlo_text))
    trips = module.trips(accumulation)
    out = []
    for comp in _executed(module):
        count = trips.get(comp, 1) or 1
        symbols = module.symbols[comp]
        for ins in module.computations[comp]:
            k = _kernel(ins, reader, symbols, count, mesh, module.num_devices, gpus_per_node)
            if k is None:
                continue
            k.category = categorize(k)
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
            k.category = categorize(k)
            out.append(k)
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
        size = c.elements * _BYTES.get(c.dtype, 4)
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
        target = _custom_target(ins)
        k.backend = target
        k.bytes = sum(shape_bytes(s) for s in op_shapes) + sum(
            shape_bytes(s) for s in _tuple_members(ins.shape) if not s.startswith("u8[") and not s.startswith("s8[")
        )
        if target.startswith("__cublas"):
            k.kind = "gemm"
            k.gemm = _cublas_shape(ins, symbols)
            b, m, n, kk, _ = k.gemm
            k.flops = float(2 * b * m * n * kk)
        elif target.startswith("__cudnn$fmha"):
            k.kind = "attention"
            k.flops = _attention_flops(ins)
        elif target == "__gpu$xla.gpu.triton" or target.startswith("triton_kernel_call"):
            name = re.search(r'\bname\s*=\s*"([^"]+)"|"name"\s*:\s*"([^"]+)"', ins.rest)
            k.kind = "custom"
            k.backend = f"{target} {(name.group(1) or name.group(2)) if name else ''}".strip()
        else:
            k.kind = "custom"
        return k
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


# ---------------------------------------------------------------------------------- categories


def categorize(k) -> str:
    """The category of a kernel (a Kernel, or a dict with its fields): GEMM, attention and collectives
    by what runs; norm, loss and optimizer by the project source the kernel came from; data movement
    alone is copies/layout; any other fusion elementwise; a loop's predicate read-back is launch."""
    get = (
        (lambda key, default="": getattr(k, key, default))
        if not isinstance(k, dict)
        else (lambda key, default="": k.get(key, default))
    )
    kind, backend, source = get("kind"), get("backend") or "", get("source") or ""
    sources = tuple(get("sources", ()) or ())
    opcode, op_name = get("opcode"), get("op_name") or ""
    fused = set(get("fused", ()) or ())
    where = " ".join((source, *sources))
    name = backend.lower()
    if kind == "sync":
        return "launch"
    if kind == "collective":
        return "collectives"
    if kind == "attention" or any(w in name for w in ("attention", "flash", "mha")):
        return "attention"
    if kind == "gemm":
        fn = source.split(":")[1] if source.count(":") >= 2 else ""
        if source.startswith("boost_jax/model/attention/") and fn in (
            "xla_attention",
            "_block_scores",
            "_chunked_fwd",
            "_chunked_bwd",
            "attend",
        ):
            return "attention"
        return "gemm"
    if kind == "custom" and "norm" in name:
        return "norm"
    if "boost_jax/kernels/rmsnorm.py" in source or re.search(r":(\w*\.)?(RMSNorm|Norm)\.", source):
        return "norm"
    if source.startswith("boost_jax/model/loss.py"):
        return "loss"
    if _optimizer(source) or (
        not source and op_name and "jvp(" not in op_name and get("computation") and "train_step" in op_name
    ):
        return "optimizer"
    if opcode in (
        "copy",
        "copy-start",
        "transpose",
        "dynamic-slice",
        "dynamic-update-slice",
        "slice",
        "concatenate",
        "pad",
        "reshape",
        "broadcast",
        "gather",
        "scatter",
        "reverse",
    ):
        return "copies/layout"
    if opcode == "fusion" and fused and fused <= MOVES:
        return "copies/layout"
    if backend == "__custom_fusion":  # XLA's dynamic-slice fusions: address arithmetic around a copy
        return "copies/layout"
    if source.startswith("boost_jax/model/attention/") and any(
        f in where for f in (":xla_attention", ":_chunked", ":_block_scores", ":cudnn_attention")
    ):
        return "attention"
    return "elementwise"


def _optimizer(source: str) -> bool:
    """The optimizer's update: runtime/step.py `optimizer_update` (the gradient norm, the optax update,
    the finite check and the kept state) or optax itself."""
    if "optax/" in source:
        return True
    if not source.startswith("boost_jax/runtime/step.py"):
        return False
    return source.split(":")[1].startswith("optimizer_update")


# ------------------------------------------------------------------------------------ pricing


@dataclass(frozen=True)
class Target:
    """A GPU's numbers: `hbm_bytes_per_s` the bandwidth a copy kernel reaches, `bf16_flops` the dense
    bf16 tensor-core peak (float32 operands run at half: TF32), `link_*` one GPU's NVLink bandwidth
    in a ring collective and its per-step latency, `node_*` the network's between nodes."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    link_bytes_per_s: float
    link_latency_s: float
    node_bytes_per_s: float
    node_latency_s: float
    gpus_per_node: int = 8
    source: str = ""


# The H100's copy bandwidth is measured (benchmarks/gpu_bench.json, rmsnorm part, "copy (x + 1)" on
# [16384, 4096] bf16: 2,269 GB/s, 68% of the 3.35 TB/s datasheet figure); the other GPUs take the
# same share of their datasheet bandwidth. Peaks are datasheet dense bf16; link figures are those of
# configs/clusters (nccl-tests ring bandwidths).
COPY_SHARE = 2268.7e9 / 3.35e12
TARGETS = {
    "h100": Target(
        "h100",
        COPY_SHARE * 3.35e12,
        989e12,
        360e9,
        7e-6,
        40e9,
        15e-6,
        source="H100 SXM5 80GB: 3.35 TB/s HBM3, 989 TFLOP/s bf16, NVLink4 (configs/clusters/h100_8x.py)",
    ),
    "h200": Target(
        "h200",
        COPY_SHARE * 4.8e12,
        989e12,
        360e9,
        7e-6,
        40e9,
        15e-6,
        source="H200 SXM 141GB: 4.8 TB/s HBM3e, 989 TFLOP/s bf16, NVLink4",
    ),
    "a100": Target(
        "a100",
        COPY_SHARE * 2.039e12,
        312e12,
        230e9,
        10e-6,
        20e9,
        20e-6,
        source="A100 SXM4 80GB: 2.04 TB/s HBM2e, 312 TFLOP/s bf16, NVLink3 (configs/clusters/a100_4x.py)",
    ),
    "a100_40gb": Target(
        "a100_40gb",
        COPY_SHARE * 1.555e12,
        312e12,
        230e9,
        10e-6,
        20e9,
        20e-6,
        source="A100 SXM4 40GB: 1.56 TB/s HBM2, 312 TFLOP/s bf16, NVLink3",
    ),
}

# GEMM shape classes, by the smallest of m, n and k (the dimension that limits a tile's reuse), and
# a batched GEMM (batch > 1: grouped projections) apart: the classes `Costs.gemm_efficiency` holds a
# fraction of peak for.
GEMM_CLASSES = ("large", "medium", "batched")
LARGE_DIM = 1024


def gemm_class(gemm: tuple) -> str:
    """The shape class of a GEMM (batch, m, n, k, dtype): `batched` when batch > 1, else `large` when
    min(m, n, k) > LARGE_DIM, `medium` otherwise (a bottleneck's rank, d/4: 512 on cola_1b, 1024 on
    cola_7b)."""
    if not gemm:
        return "medium"
    batch, m, n, k = gemm[:4]
    if batch > 1:
        return "batched"
    return "large" if min(m, n, k) > LARGE_DIM else "medium"


@dataclass(frozen=True)
class Costs:
    """The fitted constants: the fraction of peak a GEMM reaches per shape class, cuDNN attention's
    fraction of peak, the time one kernel launch adds, and the share of XLA's rematerialized clones
    priced (`Kernel.remat_clone`; 0: none, see `remat_clone`)."""

    gemm_efficiency: dict
    attention_efficiency: float
    launch_s: float
    remat_clone_share: float = 0.0
    fitted_on: tuple = ()
    note: str = ""


DEFAULT_COSTS = Costs(
    {"large": 0.75, "medium": 0.6, "batched": 0.6}, 0.4, 5e-6, note="unfitted defaults (datasheet-scale guesses)"
)


def costs(target: str) -> Costs:
    """The fitted Costs for `target` (boost_jax/tools/targets/step_costs.json, written by
    benchmarks/step_profile_fit.py); a target fitted on none takes the H100's fit, then the defaults."""
    try:
        table = json.loads(COSTS_FILE.read_text())
    except (OSError, ValueError):
        return DEFAULT_COSTS
    entry = table.get(target) or table.get("h100")
    if not entry:
        return DEFAULT_COSTS
    return Costs(
        dict(entry["gemm_efficiency"]),
        float(entry["attention_efficiency"]),
        float(entry["launch_s"]),
        float(entry.get("remat_clone_share", 0.0)),
        tuple(entry.get("fitted_on", ())),
        entry.get("note", ""),
    )


def kernel_time(k: Kernel, target: Target, c: Costs) -> float:
    """Seconds one execution of kernel `k` takes on `target` (its launch apart)."""
    memory = k.bytes / target.hbm_bytes_per_s
    if k.kind == "collective":
        info = k.collective
        bw, lat = (
            (target.node_bytes_per_s, target.node_latency_s)
            if info.get("crosses_nodes")
            else (target.link_bytes_per_s, target.link_latency_s)
        )
        return info["wire_bytes"] / bw + info["steps"] * lat
    if k.kind == "gemm":
        peak = target.bf16_flops * (0.5 if k.gemm and k.gemm[4] in ("f32", "f64") else 1.0)
        return max(k.flops / (peak * c.gemm_efficiency[gemm_class(k.gemm)]), memory)
    if k.kind == "attention":
        return max(k.flops / (target.bf16_flops * c.attention_efficiency), memory)
    return memory


def price(ks: list[Kernel], target: str | Target = "h100", c: Costs | None = None) -> dict:
    """Each kernel's time on `target`; the step's time by category (seconds; `launch` = launches x
    `launch_s`; a loop's predicate read-back counts as a launch); the step's time the sum of all (no
    overlap). XLA's rematerialized clones count `remat_clone_share` of their time and launches;
    "remat_clones" says what they would add in full."""
    t = TARGETS[target] if isinstance(target, str) else target
    c = c or costs(t.name)
    by = dict.fromkeys(CATEGORIES, 0.0)
    n = 0.0
    clones = {"kernels": 0, "launches": 0, "time_s": 0.0}
    for k in ks:
        k.time_s = kernel_time(k, t, c)
        share = c.remat_clone_share if k.remat_clone else 1.0
        by[k.category] += share * k.total_s()
        n += share * k.count
        if k.remat_clone:
            clones["kernels"] += 1
            clones["launches"] += k.count
            clones["time_s"] += k.total_s() + k.count * c.launch_s
    by["launch"] += n * c.launch_s
    return {
        "target": t.name,
        "predicted_step_s": sum(by.values()),
        "time_by_category": by,
        "launches": int(round(n)),
        "remat_clones": clones,
        "remat_clone_share": c.remat_clone_share,
        "costs": asdict(c),
    }


def summary(ks: list[Kernel], priced: dict, top: int = 15) -> dict:
    """The JSON of a priced program: step time, time by category, launches, FLOPs and bytes per
    category (HBM traffic; for collectives the bytes over the links) and the `top` kernels by time."""
    flops = dict.fromkeys(CATEGORIES, 0.0)
    hbm = dict.fromkeys(CATEGORIES, 0.0)
    kcount = dict.fromkeys(CATEGORIES, 0)
    share = priced.get("remat_clone_share", 0.0)
    for k in ks:
        w = share if k.remat_clone else 1.0
        flops[k.category] += w * k.flops * k.count
        hbm[k.category] += w * _moved(k) * k.count
        kcount[k.category] += int(round(w * k.count))
    ranked = sorted((k for k in ks if share or not k.remat_clone), key=lambda k: -k.total_s())[:top]
    return {
        **priced,
        "kernels_per_step": kcount,
        "flops_by_category": flops,
        "bytes_by_category": hbm,
        "gemm_flops_by_class": _by_class(ks),
        "top_kernels": [
            {
                "name": k.name,
                "category": k.category,
                "kind": k.kind,
                "count": k.count,
                "time_s": k.total_s(),
                "flops": k.flops * k.count,
                "bytes": _moved(k) * k.count,
                "gemm": list(k.gemm),
                "backend": k.backend,
                "source": k.source,
            }
            for k in ranked
        ],
    }


def _moved(k: Kernel) -> float:
    """Bytes a kernel moves per execution: HBM traffic, or for a collective what its ring sends."""
    return k.collective.get("wire_bytes", 0.0) if k.kind == "collective" else k.bytes


def _by_class(ks: list[Kernel]) -> dict:
    out = dict.fromkeys(GEMM_CLASSES, 0.0)
    for k in ks:
        if k.kind == "gemm":
            out[gemm_class(k.gemm)] += k.flops * k.count
    return out


def profile(
    hlo_text: str, target: str = "h100", accumulation: int = 1, mesh=None, top: int = 15, c: Costs | None = None
) -> dict:
    """The step-time table of one compiled GPU program (see `summary`)."""
    t = TARGETS[target]
    ks = kernels(hlo_text, accumulation, mesh, t.gpus_per_node)
    return summary(ks, price(ks, t, c), top)


# ----------------------------------------------------------------------------- measured traces


def trace_events(xspace_path: str, module: str | None = None) -> list[dict]:
    """The GPU kernels of a jax.profiler trace (`*.xplane.pb`), one row per (kernel, hlo_op, hlo_module):
    {"name", "hlo_op", "hlo_module", "duration_us" (summed), "count"}. Kernels come from the device
    planes (`/device:GPU:N`); a trace with none (a CPU run) gives the host's events that name an
    hlo_op. `module`: keep only this hlo_module (and events that name none)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xspace_path))
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    derived = {
        "XLA Modules",
        "XLA Ops",
        "Steps",
        "Framework Name Scope",
        "Framework Ops",
        "Source code",
        "XLA TraceMe",
        "Launch Stats",
        "TensorFlow Name Scope",
        "TensorFlow Ops",
    }
    rows: dict[tuple, dict] = {}

    def add(ev, stats):
        mod = str(stats.get("hlo_module", ""))
        if module and mod and not mod.startswith(module):
            return
        key = (ev.name, str(stats.get("hlo_op", "")), mod)
        row = rows.setdefault(
            key, {"name": key[0], "hlo_op": key[1], "hlo_module": key[2], "duration_us": 0.0, "count": 0}
        )
        row["duration_us"] += ev.duration_ns / 1e3
        row["count"] += 1

    for p in planes:
        for line in p.lines:
            if line.name in derived:
                continue
            for ev in line.events:
                add(ev, dict(ev.stats))
    if not planes:
        for p in data.planes:
            for line in p.lines:
                for ev in line.events:
                    stats = dict(ev.stats)
                    if "hlo_op" in stats:
                        add(ev, stats)
    return sorted(rows.values(), key=lambda r: -r["duration_us"])


def module_name(hlo_text: str) -> str:
    """The HLO module's name (what a trace's events call hlo_module)."""
    m = re.match(r"HloModule\s+([\w.\-]+)", hlo_text)
    return m.group(1) if m else ""


def _event_category(row: dict, by_name: dict[str, Kernel]) -> str:
    k = by_name.get(row.get("hlo_op", ""))
    if k is not None:
        return k.category
    name = row.get("name", "").lower()
    if "nccl" in name:
        return "collectives"
    if any(w in name for w in ("fmha", "flash", "attention", "cudnn")):
        return "attention"
    if any(w in name for w in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "sm80", "matmul", "cublas")):
        return "gemm"
    if "memcpy" in name or "memset" in name:
        return "copies/layout"
    return "elementwise"


_UNITS = {"duration_us": 1.0, "duration_ns": 1e-3, "duration_ms": 1e3, "duration_s": 1e6}


def _event_row(i: int, r: dict) -> dict:
    """One event row with its kernel `name` (or `kernel`) and `duration_us` (or _ns, _ms, _s: the time
    summed over its `count` occurrences in the trace)."""
    unit = next((k for k in _UNITS if k in r), None)
    if unit is None:
        raise ValueError(
            f"events[{i}]: no duration_us (or duration_ns / _ms / _s: the time summed over its "
            f"count occurrences); got keys {sorted(r)}"
        )
    return {**r, "name": r.get("name", r.get("kernel", "")), "duration_us": float(r[unit]) * _UNITS[unit]}


def measured(events: dict | list, hlo_text: str, accumulation: int = 1) -> dict:
    """The category table of a measured trace: `events` is {"steps": N, "step_s": wall seconds per
    step (optional), "events": [{"name", "hlo_op", "hlo_module", "duration_us", "count"}]} (or the
    bare list, one step; `kernel` for `name` and duration_ns / _ms / _s are read too), `hlo_text` the same program's
    optimized HLO (as the GPU compiled it). Each
    event takes the category of the HLO instruction it names (`categorize`); one that names none, by
    its kernel name. Seconds per step; `launch` is the step's wall time the kernels leave idle
    (launches, host work, syncs) when `step_s` is given."""
    if isinstance(events, list):
        events = {"steps": 1, "events": events}
    steps = float(events.get("steps", 1)) or 1.0
    rows = [_event_row(i, r) for i, r in enumerate(events.get("events", []))]
    ks = kernels(hlo_text, accumulation)
    by_name = {k.name: k for k in ks}
    by = dict.fromkeys(CATEGORIES, 0.0)
    per_kernel: dict[str, float] = {}
    launches_ = 0
    for r in rows:
        cat = _event_category(r, by_name)
        secs = r["duration_us"] / 1e6 / steps
        by[cat] += secs
        per_kernel[r.get("hlo_op") or r.get("name", "?")] = (
            per_kernel.get(r.get("hlo_op") or r.get("name", "?"), 0) + secs
        )
        launches_ += r.get("count", 0)
    busy = sum(by.values())
    out = {
        "busy_s": busy,
        "time_by_category": by,
        "launches": launches_ / steps,
        "top_kernels": [
            {
                "name": n,
                "time_s": s,
                "category": by_name[n].category if n in by_name else _event_category({"name": n}, by_name),
            }
            for n, s in sorted(per_kernel.items(), key=lambda x: -x[1])[:15]
        ],
    }
    if events.get("step_s"):
        out["measured_step_s"] = float(events["step_s"])
        by["launch"] += max(float(events["step_s"]) - busy, 0.0)
    out["step_s"] = sum(by.values())
    return out


# ------------------------------------------------------------------------------------- text


def to_text(p: dict, title: str = "") -> str:
    """The table of one profile: per category, time, share, kernels per step, TFLOP and GB moved."""
    step = p["predicted_step_s"]
    lines = [
        f"{title}predicted step {step * 1e3:.1f} ms on {p['target']} ({p['launches']} kernel launches)",
        f"  {'category':<14} {'ms':>8} {'share':>6} {'kernels':>8} {'TFLOP':>8} {'GB':>8}",
    ]
    for cat in CATEGORIES:
        t = p["time_by_category"][cat]
        lines.append(
            f"  {cat:<14} {t * 1e3:8.2f} {t / step if step else 0:6.1%} {p['kernels_per_step'][cat]:8d} "
            f"{p['flops_by_category'][cat] / 1e12:8.2f} {p['bytes_by_category'][cat] / 1e9:8.2f}"
        )
    clones = p.get("remat_clones", {})
    if clones.get("kernels"):
        lines.append(
            f"  XLA's rematerialized clones: {clones['kernels']} kernels, {clones['launches']} launches, "
            f"{clones['time_s'] * 1e3:.1f} ms if run; priced at {p.get('remat_clone_share', 0):.0%} "
            "(step_profile.remat_clone)"
        )
    lines.append("  top kernels:")
    for k in p["top_kernels"][:10]:
        shape = "x".join(str(d) for d in k["gemm"][:4]) if k["gemm"] else ""
        lines.append(
            f"    {k['time_s'] * 1e3:7.2f} ms  {k['category']:<13} {k['name']} x{k['count']}"
            + (f" (gemm b,m,n,k {shape})" if shape else "")
            + (f"  [{k['source']}]" if k["source"] else "")
        )
    return "\n".join(lines)


def side_by_side(predicted: dict, measured_: dict) -> str:
    """Predicted and measured seconds per category, one row each."""
    lines = [f"  {'category':<14} {'predicted ms':>13} {'measured ms':>12}"]
    for cat in CATEGORIES:
        lines.append(
            f"  {cat:<14} {predicted['time_by_category'][cat] * 1e3:13.2f} "
            f"{measured_['time_by_category'][cat] * 1e3:12.2f}"
        )
    lines.append(f"  {'step':<14} {predicted['predicted_step_s'] * 1e3:13.2f} {measured_['step_s'] * 1e3:12.2f}")
    return "\n".join(lines)


def costs_dict(c: Costs) -> dict:
    return asdict(c)


def _read(path: str) -> str:
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def main(argv=None) -> dict:
    """`python -m boost_jax.tools.step_profile --hlo PROGRAM.hlo[.gz] [--events EVENTS.json] [--target h100]`:
    the predicted table of a compiled program's text; with a trace's events of the same program
    (benchmarks/step_profile_trace.py writes both), the measured table beside it."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m boost_jax.tools.step_profile", description=main.__doc__.split("\n")[0])
    ap.add_argument("--hlo", required=True, help="the optimized HLO text of the program (.gz allowed)")
    ap.add_argument("--events", help="a trace's kernels (JSON: steps, step_s, events) of the same program")
    ap.add_argument("--target", default="h100", help=f"one of {', '.join(TARGETS)}")
    ap.add_argument("--accumulation", type=int, default=1, help="trip count of a loop whose count XLA hides")
    args = ap.parse_args(argv)
    try:
        if args.target not in TARGETS:
            raise ValueError(f"--target: unknown GPU {args.target!r}; one of {', '.join(TARGETS)}")
        text = _read(args.hlo)
        pred = profile(text, args.target, args.accumulation)
        out = {"predicted": pred}
        print(to_text(pred))
        if args.events:
            got = measured(json.loads(_read(args.events)), text, args.accumulation)
            out["measured"] = got
            print(side_by_side(pred, got))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return out


if __name__ == "__main__":
    main()
