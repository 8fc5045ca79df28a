"""Importing this module imports what every local worker needs before its first step; the server
that forks the workers imports it once (`hetplan.forked`).

torch with the packages a worker uses (distributed, DTensor, export), hetplan's runtime, and where
transformers is installed the machinery every one of its models shares: `modeling_utils` takes
2.7 s of one core here, the model's own module a few hundredths more. Nothing here runs a torch
kernel: the server must not start OpenMP threads, which a forked worker could not use.
"""

import contextlib

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.export  # noqa: F401

import hetplan.runtime.executor  # noqa: F401
import hetplan.runtime.rank  # noqa: F401
import hetplan.runtime.tensor_parallel  # noqa: F401
import hetplan.runtime.transport  # noqa: F401
import hetplan.runtime.worker  # noqa: F401
from hetplan.zoo import models

with contextlib.suppress(ImportError):  # a model of transformers imports it when it is built
    models.transformers_machinery()
