"""TIDE: layout-aware, zero-copy collectives for fully sharded training.

Framework-free face of the shared C++ core: the planner (`plan`), the virtual cluster that runs
TIDE programs (`VirtualCluster`) and the CLI. Importing `tide` needs neither torch nor jax.
"""
from tide import _core
from tide._core import PlanError, TimeoutError  # noqa: A004  (tide.TimeoutError is ours)
from tide._core import n_rounds, recoverable_overhead_fraction
from tide.cluster import VirtualCluster
from tide.options import ExecutorOptions
from tide.plan import GroupSignature, Topology, layout, plan

__all__ = ["ExecutorOptions", "GroupSignature", "PlanError", "TimeoutError", "Topology",
           "VirtualCluster", "layout", "n_rounds", "plan", "recoverable_overhead_fraction"]
__version__ = "0.1.0"
