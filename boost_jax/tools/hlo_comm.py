"""Every collective in the optimized HLO of a compiled JAX program (``compiled_collectives``, or
``parse_collectives(jax.jit(f).lower(*args).compile().as_text())``), and the HLO module parser the
step-time table reads kernels with. Counted per participating device:

* ``elements``, not bytes (XLA:CPU combines all-reduces into tuples and carries bf16 ones as f32):
  all-reduce / all-to-all / collective-permute: operand size; all-gather: output size;
  reduce-scatter: input size; tuple operands summed. ``partitioned_hlo`` gives the dtypes.
* Async ``*-start`` ops count as their base kind, ``*-done`` halves not; a collective wrapped in
  ``async-start(...), calls=%comp`` counts inside ``%comp``.
* ``in_loop``: reachable from a ``while`` body or condition through any call edge; ``trips``: the
  product of the ``known_trip_count`` of every enclosing ``while`` (None when one has none).
* Replica-group ids are LOGICAL (positions in ``mesh.devices.flat``, not ``device.id``); explicit,
  empty, iota (``[2,4]<=[8]``, ``[4,2]<=[2,4]T(1,0)``) and mesh-axes group syntaxes are understood.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    from jax.sharding import Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Opcode -> base kind. `-done` halves are absent on purpose so they are skipped.
_OPCODES = {**{k: k for k in KINDS}, **{f"{k}-start": k for k in KINDS}}

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s")
# `name = shape opcode(` ; shape may be a (nested) tuple, so it is matched lazily up to the opcode.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLEES = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_WHILE_BODY = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_INTS = re.compile(r"-?\d+")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclass
class Collective:
    kind: str
    elements: int
    dtype: str
    group_size: int
    axes: tuple[str, ...]
    computation: str
    in_loop: bool
    trips: int | None = 1
    op_name: str = ""  # the JAX operation it came from (HLO metadata), e.g. ".../transpose(jvp())/dot_general"


# ---------------------------------------------------------------- shapes and operands


def _shape_elements(shape: str) -> int:
    """Elements of an HLO shape string, summed over tuple members (tokens count 0)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype == "token":
            continue
        total += math.prod(int(d) for d in _INTS.findall(dims.replace("<=", "")))
    return total


def _shape_dtype(shape: str) -> str:
    m = _ARRAY.search(shape)
    return m.group(1) if m else ""


def _split_top(s: str) -> tuple[list[str], str]:
    """Split the text after `opcode(` into top-level operands and the attribute tail."""
    depth, start, parts = 0, 0, []
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:  # the `)` closing the operand list
                parts.append(s[start:i])
                return [p.strip() for p in parts if p.strip()], s[i + 1 :]
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return [p.strip() for p in parts if p.strip()], ""


_COMMENT = re.compile(r"/\*.*?\*/")


def operand_shape(operand: str, symbols: dict[str, str]) -> str:
    """An operand's shape text (`f32[4]{0}`), printed inline or looked up in the computation's symbols."""
    # Operands print either bare (`%x`) or with their shape (`f32[4]{0} %x`), depending on options;
    # long operand lists carry `/*index=5*/` comments (XLA:GPU's combined collectives).
    shape, _, name = _COMMENT.sub("", operand).strip().rpartition(" ")
    return shape if shape else symbols.get(name.lstrip("%"), "")


# ---------------------------------------------------------------- replica groups


def _iota(dims: Sequence[int], reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    """XLA iota tile assignment: iota(prod) reshaped to `reshape`, transposed by `perm`, shaped `dims`."""
    a = np.arange(math.prod(reshape)).reshape(reshape)
    if perm:
        a = a.transpose(perm)
    return a.reshape(dims)


def parse_ints(s: str | None) -> list[int]:
    """Every integer in an HLO attribute's text, in order ([] for None)."""
    return [int(x) for x in _INTS.findall(s or "")]


def _mesh_axes_groups(text: str) -> list[list[int]]:
    """Expand `mesh[...](, device_ids=(...))? {axis refs}` into explicit groups."""
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}", text)
    if m is None:
        raise ValueError(f"unrecognised mesh replica groups: {text[:120]!r}")
    names, sizes = [], []
    for name, size in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1)):
        names.append(name)
        sizes.append(int(size))
    n = math.prod(sizes)
    ids_text = (m.group(2) or "").strip()
    if not ids_text:
        devices = np.arange(n).reshape(sizes)
    elif ids_text.startswith("["):  # iota form `[reshape]T(perm)` (dims are the mesh's)
        it = re.match(r"\[([\d,]*)\](?:<=\[([\d,]*)\])?(?:T\(([\d,]*)\))?", ids_text)
        reshape = parse_ints(it.group(2)) or parse_ints(it.group(1))
        devices = _iota(sizes, reshape, parse_ints(it.group(3)) or None)
    else:
        devices = np.asarray(parse_ints(ids_text)).reshape(sizes)
    coords = np.indices(sizes).reshape(len(sizes), -1).T  # row-major coords of each position
    # For each grouped (sub-)axis: (mesh axis index, stride inside that axis, size).
    grouped = []
    for ref in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", m.group(3)):
        name, pre, size = ref
        i = names.index(name)
        if pre:  # sub-axis `(pre)size`: axis = [pre, size, rest] with `pre` the major part
            grouped.append((i, sizes[i] // (int(pre) * int(size)), int(size)))
        else:
            grouped.append((i, 1, sizes[i]))
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = defaultdict(list)
    for pos, c in enumerate(coords):
        key = list(c)
        order = []
        for i, stride, size in grouped:
            sub = (c[i] // stride) % size
            key[i] -= sub * stride  # drop the grouped component: members share the rest
            order.append(sub)
        groups[tuple(key)].append((tuple(order), int(devices.flat[pos])))
    return [[d for _, d in sorted(members)] for _, members in sorted(groups.items())]


def parse_replica_groups(text: str, num_devices: int | None = None) -> list[list[int]]:
    """Parse the value of a `replica_groups=` attribute (any syntax) into explicit id groups."""
    text = text.strip()
    if text.startswith("mesh["):
        return _mesh_axes_groups(text)
    if text.startswith("["):  # iota: [groups,size]<=[reshape]T(perm)
        m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        if m is None:
            raise ValueError(f"unrecognised iota replica groups: {text[:120]!r}")
        dims = parse_ints(m.group(1))
        arr = _iota(dims, parse_ints(m.group(2)), parse_ints(m.group(3)) or None)
        return arr.reshape(dims[0], -1).tolist()
    if text.startswith("{"):
        groups = [parse_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", text[1:])]
        groups = [g for g in groups if g]
        if groups:
            return groups
        if num_devices is None:  # `{}` means one group of every device
            raise ValueError("replica_groups={} needs the device count")
        return [list(range(num_devices))]
    raise ValueError(f"unrecognised replica groups: {text[:120]!r}")


def _braced(s: str) -> str:
    """The leading `{...}` of s, braces balanced."""
    depth = 0
    for j, ch in enumerate(s):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return s[: j + 1]
    return s


def hlo_attribute(attrs: str, key: str) -> str | None:
    """Raw value of `key=`; the mesh form contains a space, so it is cut at its closing `}`."""
    m = re.search(rf"\b{key}=", attrs)
    if m is None:
        return None
    s = attrs[m.end() :]
    if s.startswith("mesh["):
        return s[: s.index("}") + 1]
    if s.startswith("{"):
        return _braced(s)
    m = re.match(r"\[[\d,]*\]<=\[[\d,]*\](?:T\([\d,]*\))?", s)  # iota form
    return m.group(0) if m else None


# ---------------------------------------------------------------- mesh axes


def _axes_of(groups: Iterable[Sequence[int]], mesh: Mesh | None) -> tuple[str, ...]:
    """Mesh axes along which members of any group differ (ids are positions in mesh.devices.flat)."""
    if mesh is None:
        return ()
    shape = mesh.devices.shape
    size = math.prod(shape)
    varying: set[int] = set()
    for g in groups:
        if any(d >= size for d in g):
            raise ValueError(f"device id {max(g)} outside a mesh of {size} devices")
        coords = np.array(np.unravel_index(np.asarray(g), shape))  # [ndim, members]
        varying |= {i for i in range(len(shape)) if len(set(coords[i].tolist())) > 1}
    return tuple(mesh.axis_names[i] for i in sorted(varying))


def _permute_group_size(pairs: list[list[int]]) -> int:
    """Largest connected component of the source->target graph (a ring of n gives n)."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            x = parent[x]
        return x

    for s, t in pairs:
        if s != t:
            parent[find(s)] = find(t)
    sizes = defaultdict(int)
    for x in list(parent):
        sizes[find(x)] += 1
    return max(sizes.values(), default=2)


# ---------------------------------------------------------------- main entry points


@dataclass
class Instruction:
    """One instruction of an HLO module: `name = shape opcode(rest`; `rest` holds its operands and
    attributes (split by `operands_attrs()`)."""

    name: str
    shape: str
    opcode: str
    rest: str
    computation: str

    def operands_attrs(self) -> tuple[list[str], str]:
        return _split_top(self.rest)


@dataclass
class HloModule:
    """An optimized HLO module read once: its computations' instructions in textual order, each
    computation's symbol table (name -> shape), the call graph and the while loops' trip counts."""

    computations: dict[str, list[Instruction]]
    symbols: dict[str, dict[str, str]]
    entry: str
    calls: dict[str, set[str]]
    loop_roots: set[str]  # while bodies and conditions
    loop_trips: dict[tuple[str, str], int | None]  # (caller, while body/condition) -> known trip count
    num_devices: int  # from the header: num_partitions x replica_count
    roots: dict[str, str] = field(default_factory=dict)  # computation -> its ROOT instruction

    def instructions(self) -> Iterable[Instruction]:
        for instrs in self.computations.values():
            yield from instrs

    def in_loop(self) -> set[str]:
        """Computations reachable from any while body/condition."""
        seen, todo = set(), list(self.loop_roots)
        while todo:
            c = todo.pop()
            if c not in seen:
                seen.add(c)
                todo.extend(self.calls.get(c, ()))
        return seen

    def trips(self, unknown: int | None = None) -> dict[str, int | None]:
        """Executions of each computation reachable from the entry per run (see `_trip_counts`)."""
        return _trip_counts(self.entry, self.calls, self.loop_trips, unknown)


def parse_module(hlo_text: str) -> HloModule:
    """Read an optimized HLO module's text (`compiled.as_text()`) into an HloModule."""
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    replicas = re.search(r"replica_count=(\d+)", hlo_text)
    num_devices = int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)
    computations: dict[str, list[Instruction]] = {}
    symbols_of: dict[str, dict[str, str]] = {}
    calls: dict[str, set[str]] = defaultdict(set)
    loop_roots: set[str] = set()
    loop_trips: dict[tuple[str, str], int | None] = {}
    roots: dict[str, str] = {}
    entry = ""
    comp, instrs, symbols = "", [], {}
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{") and not line.startswith("HloModule"):
            header_name = _HEADER.match(line)
            comp = header_name.group(1) if header_name else line.split()[0]
            instrs, symbols = computations.setdefault(comp, []), symbols_of.setdefault(comp, {})
            entry = comp if line.startswith("ENTRY") else entry
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        name, shape, opcode, rest = m.groups()
        symbols[name] = shape
        instrs.append(Instruction(name, shape, opcode, rest, comp))
        if line.lstrip().startswith("ROOT "):
            roots[comp] = name
        for callee in _CALLEES.findall(rest):
            calls[comp].update(c.lstrip("%") for c in re.findall(r"%?([\w.\-]+)", callee))
        if opcode == "while":
            loop_roots.update(_WHILE_BODY.findall(rest))
            trip = _TRIP_COUNT.search(rest)
            for callee in _WHILE_BODY.findall(rest):
                loop_trips[(comp, callee)] = int(trip.group(1)) if trip else None
    return HloModule(computations, symbols_of, entry, calls, loop_roots, loop_trips, num_devices, roots)


def parse_collectives(hlo_text: str, mesh: Mesh | None = None, unknown_trips: int | None = None) -> list[Collective]:
    """Every collective in an optimized HLO module, in textual order. Without a mesh, axes=().
    `unknown_trips`: the trip count to read for a `while` without a known one (a GPU train step's
    accumulation loop hides its count from XLA: parallel/grad_reduce.py each_micro_batch); None
    leaves such loops' collectives at trips None."""
    module = parse_module(hlo_text)
    # Needed for `replica_groups={}` (= every device); the module header knows the count.
    num_devices = mesh.devices.size if mesh is not None else module.num_devices
    in_loop = module.in_loop()
    trips = module.trips(unknown_trips)
    out = []
    for ins in module.instructions():
        if ins.opcode in _OPCODES:
            out.append(
                collective_of(
                    ins,
                    module.symbols[ins.computation],
                    num_devices,
                    mesh,
                    ins.computation in in_loop,
                    trips.get(ins.computation, 1),
                )
            )
    return out


def collective_of(
    ins: Instruction,
    symbols: dict[str, str],
    num_devices: int,
    mesh: Mesh | None = None,
    in_loop: bool = False,
    trips: int | None = 1,
) -> Collective:
    """The Collective of one collective instruction (its payload per the module docstring's rules)."""
    kind = _OPCODES[ins.opcode]
    operands, attrs = ins.operands_attrs()
    shape = ins.shape
    op_shapes = [operand_shape(o, symbols) for o in operands]
    if kind == "collective-permute":
        if hlo_attribute(attrs, "slice_sizes") is not None:  # the in-place form: output buffer and offsets follow
            op_shapes = op_shapes[:1]  # (XLA:GPU combines permutes of one pairing into one tuple op: all count)
        pairs = (hlo_attribute(attrs, "source_target_pairs") or "{}")[1:]
        groups = [parse_ints(p) for p in re.findall(r"\{([\d,\s]*)\}", pairs)]
        group_size = _permute_group_size(groups)
    else:
        groups = parse_replica_groups(hlo_attribute(attrs, "replica_groups") or "{}", num_devices)
        group_size = len(groups[0])
    if all(op_shapes):
        elements = sum(_shape_elements(s) for s in op_shapes)
        elements *= group_size if kind == "all-gather" else 1  # gather payload = gathered size
    else:  # operand shape unknown: fall back on the result (only meaningful for sync ops)
        elements = _shape_elements(shape) * (group_size if kind == "reduce-scatter" else 1)
    dtype = _shape_dtype(op_shapes[0] if op_shapes and op_shapes[0] else shape)
    op_name = re.search(r'op_name="([^"]*)"', attrs)
    return Collective(
        kind,
        elements,
        dtype,
        group_size,
        _axes_of(groups, mesh),
        ins.computation,
        in_loop,
        trips,
        op_name.group(1) if op_name else "",
    )


def _trip_counts(
    entry: str, calls: dict[str, set[str]], loop_trips: dict, unknown: int | None = None
) -> dict[str, int | None]:
    """Executions of every computation reachable from `entry` per run of the program: a while's
    body/condition multiplies its caller's count by the loop's known trip count (else `unknown`;
    None: unknown)."""
    trips: dict[str, int | None] = {entry: 1}
    todo = [entry]
    while todo:
        comp = todo.pop()
        for callee in calls.get(comp, ()):
            n = trips[comp]
            if (comp, callee) in loop_trips:
                k = loop_trips[(comp, callee)]
                k = unknown if k is None else k
                n = None if n is None or k is None else n * k
            if callee not in trips:
                trips[callee] = n
                todo.append(callee)
    return trips


def summarize(collectives: Iterable[Collective], *, by: Sequence[str] = ("kind",)) -> dict:
    """{key: {"count", "elements"}}; key is the field value for one field, else a tuple of values."""
    out: dict = {}
    for c in collectives:
        values = tuple(getattr(c, f) for f in by)
        key = values[0] if len(by) == 1 else values
        slot = out.setdefault(key, {"count": 0, "elements": 0})
        slot["count"] += 1
        slot["elements"] += c.elements
    return out


def partitioned_hlo(lowered) -> str:
    """The HLO of a lowered JAX program right after SPMD partitioning, where every collective carries
    its logical dtype. (The optimized CPU program is no guide to dtypes: XLA:CPU runs bf16
    all-reduces and all-gathers in float32, converting before and after, so a bf16 collective and a
    float32 one print alike there.) Compiles once more; `compile_partitioned` also returns the program."""
    return compile_partitioned(lowered)[1]


def compile_partitioned(lowered):
    """(the compiled program, its HLO right after SPMD partitioning): one compile that dumps that pass
    to a temporary folder. It really compiles: JAX's persistent compilation cache (when one is set)
    is bypassed, as a program served from it would dump nothing."""
    import glob
    import os
    import tempfile

    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()  # JAX decides once whether it uses the cache: ask again
    try:
        with tempfile.TemporaryDirectory() as folder:
            compiled = lowered.compile(
                compiler_options={
                    "xla_dump_to": folder,
                    "xla_dump_hlo_as_text": True,
                    "xla_dump_hlo_pass_re": "spmd-partitioning",
                }
            )
            found = sorted(glob.glob(os.path.join(folder, "*after_spmd-partitioning*.txt")))
            if not found:
                raise RuntimeError("XLA wrote no HLO after the spmd-partitioning pass (is the program sharded?)")
            with open(found[-1]) as f:
                return compiled, f.read()
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
        cc.reset_cache()


def compiled_collectives(fn: Callable, *args: Any, mesh: Mesh | None = None, **kwargs: Any) -> list[Collective]:
    """Compile `fn` (jitted or not) for these arguments and parse its collectives."""
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return parse_collectives(jitted.lower(*args, **kwargs).compile().as_text(), mesh)
