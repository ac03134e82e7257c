"""Parallelism planner: price partition plans with an α-β / GEMM-efficiency / memory model and search
the best (mesh, per-group partition choices, remat, micro-batching) for a cluster. CLI: boost_jax.plan.

ops/ is what is priced (a layer's operators and the arrays they keep), pricing/ how (the cluster, time
and memory terms, a whole plan's price); the search is here: search.py over search_space.py and
layer_search.py, with parallel.plan=auto (auto.py) and --verify (verify.py) on top."""

from boost_jax.planner.pricing.cluster import Cluster, Link, load_cluster
from boost_jax.planner.pricing.plans import Layer, Mesh, Options, Plan, Result
from boost_jax.planner.search import plan_for, search

__all__ = ["Cluster", "Layer", "Link", "Mesh", "Options", "Plan", "Result", "load_cluster", "plan_for", "search"]
