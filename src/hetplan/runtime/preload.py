"""Importing this module imports what every local worker needs before its first step; the server
that forks the workers imports it once (`hetplan.forked`).

torch with the packages a worker uses (distributed, DTensor, export) and hetplan's runtime; a
transformers model's workers import `preload_transformers` too. Nothing here runs a torch kernel:
the server must not start OpenMP threads, which a forked worker could not use.

`torch.export.export` imports its machinery at its first call (about 1.3 s of one core here, and
sympy's tensor module at the first symbolic shape): imported here, each run's tracing process
starts with them. torch's is a private module: a version without it is passed over.
"""

import contextlib
import importlib

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.export  # noqa: F401

import hetplan.runtime.executor  # noqa: F401
import hetplan.runtime.rank  # noqa: F401
import hetplan.runtime.tensor_parallel  # noqa: F401
import hetplan.runtime.traces  # noqa: F401
import hetplan.runtime.transport  # noqa: F401
import hetplan.runtime.worker  # noqa: F401
import hetplan.zoo.models  # noqa: F401

EXPORT_MACHINERY = ("torch.export._trace", "sympy.tensor.tensor")
for _name in EXPORT_MACHINERY:
    with contextlib.suppress(ImportError):
        importlib.import_module(_name)
