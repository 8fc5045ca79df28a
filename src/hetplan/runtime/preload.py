"""Importing this module imports what every local worker needs before its first step; the server
that forks the workers imports it once (`hetplan.forked`).

torch with the packages a worker uses (distributed, DTensor, export) and hetplan's runtime; a
transformers model's workers import `preload_transformers` too. Nothing here runs a torch kernel:
the server must not start OpenMP threads, which a forked worker could not use.
"""

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.export  # noqa: F401

import hetplan.runtime.executor  # noqa: F401
import hetplan.runtime.rank  # noqa: F401
import hetplan.runtime.tensor_parallel  # noqa: F401
import hetplan.runtime.transport  # noqa: F401
import hetplan.runtime.worker  # noqa: F401
import hetplan.zoo.models  # noqa: F401
