"""Whether the layer stack runs unrolled where `model.scan_unroll` is `auto` on a GPU: the rule the
trainer's `auto` (model/autos.py) and the planner's search (planner/search_space.py) both read.
Imports no JAX."""


def unrolls(split: set[str], policy: str) -> bool:
    """`split`: the mesh axes with more than one device. Unrolled where at most `data` splits the mesh,
    or `data` and `tensor` under remat `none` (the scan would keep the same activations and copy them
    into and out of its stacks); pipeline, fsdp and context splits keep the scan."""
    return split <= {"data"} or (split <= {"data", "tensor"} and policy == "none")
