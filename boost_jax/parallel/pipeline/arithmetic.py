"""The pipeline schedules' arithmetic, without JAX: ticks of a pass, the bubble, 1F1B's item order,
delays and ring slots. The schedules (gspmd.py, one_f_one_b.py), the comm report and the planner
(which must not load JAX) all count with these functions.

S stages, M micro-batches, V layer chunks per stage (circular and interleaved 1F1B; 1 otherwise).
The item-order functions take Python ints or traced integer arrays alike (operators only)."""

from __future__ import annotations

ONE_F_ONE_B = "1f1b"  # parallel.pipeline_schedule: the head and loss run inside the schedule


def layout_chunks(schedule: str, repeats: int) -> int | None:
    """The layer chunks per stage of the stage layout (layout.py `stage_layout`): V for circular and
    interleaved 1F1B, None for gpipe's (and plain 1F1B's) contiguous blocks."""
    return repeats if schedule == "circular" or (schedule == ONE_F_ONE_B and repeats > 1) else None


def ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Ticks of one GPipe / circular pass: every micro-batch crosses every stage `repeats` times (V M
    items), the last one entering stage 0 at tick V M - 1 and leaving stage S-1 S-1 ticks later."""
    return repeats * microbatches + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle share of the stage-ticks: (S-1)/(V M + S-1) (gpipe: V = 1; 1F1B's as well)."""
    return (stages - 1) / ticks(stages, microbatches, repeats)


def delay(stages: int, repeats: int = 1) -> int:
    """1F1B's D: backward item j runs at stage s at tick j + D - s."""
    return repeats * stages + stages - 2


def ticks_1f1b(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Ticks of a 1F1B pass (forward and backward, lockstep): V M + V S + S - 2."""
    return repeats * microbatches + delay(stages, repeats)


def lifetime(stages: int, repeats: int, stage: int, chunk: int) -> int:
    """1F1B: ticks from an item's forward to its backward at `stage`, for its `chunk` (0..V-1)."""
    return (repeats - 1 - 2 * chunk) * stages + delay(stages, repeats) - 2 * stage


def ring_slots(stages: int, repeats: int = 1, reread_first: bool = True) -> int:
    """Slots of a 1F1B stage's ring of forward items (indexed by item mod slots): one more than the
    longest lifetime of a kept item, so an item's slot is rewritten only after its backward.
    `reread_first` (stage remat): stage 0's first chunk is read from the pass's input again, not kept."""
    return 1 + max(
        [
            lifetime(stages, repeats, s, v)
            for s in range(stages)
            for v in range(repeats)
            if not (reread_first and s == 0 and v == 0)
        ]
        + [0]
    )


def decode(item, stages: int, repeats: int, backward: bool = False):
    """1F1B: (micro-batch, chunk) of forward item `item` (backward: chunks in reverse order). Items go
    in groups of S micro-batches: item k is group k // (S V), chunk (k mod S V) // S."""
    per_group = stages * repeats
    within = item % per_group
    v = within // stages
    return (item // per_group) * stages + within % stages, (repeats - 1 - v) if backward else v


def forward_item(item, stages: int, repeats: int):
    """1F1B: the forward index of backward item `item` (same micro-batch and chunk)."""
    per_group = stages * repeats
    within = item % per_group
    return (item // per_group) * per_group + (repeats - 1 - within // stages) * stages + within % stages
