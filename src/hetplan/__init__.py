"""hetplan: plan, simulate and run the training of PyTorch models split across heterogeneous devices.

The flow: a model becomes a `Graph` (profiled, or imported from PipeDream), a `Cluster` says what
devices there are, a planner turns both into a `Plan`, and a cost model or simulator predicts its
`Estimate`. Every one of these is a frozen dataclass that round-trips through JSON
(`hetplan.io.serde`).
"""

from hetplan.catalog import CATALOG, DeviceType
from hetplan.cluster import Cluster, Device, Link, LinkOverride
from hetplan.errors import HetplanError
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import load_cluster, presets
from hetplan.io.graphs import load_graph
from hetplan.plan import Estimate, Plan, Stage, validate_plan

__version__ = "0.1.0"

__all__ = [
    "CATALOG", "Cluster", "Device", "DeviceType", "Edge", "Estimate", "Graph", "HetplanError",
    "Link", "LinkOverride", "Node", "Plan", "Stage", "load_cluster", "load_graph", "presets", "validate_plan",
]
