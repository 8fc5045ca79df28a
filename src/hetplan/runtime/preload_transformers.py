"""Importing this module imports the machinery every transformers model shares
(`transformers.modeling_utils`: 2.7 s of one core here; a model's own module then takes a few
hundredths), with the zoo's settings (offline, quiet); the worker server imports it for a model
that uses transformers (`hetplan.forked`, `hetplan.zoo.uses_transformers`).
"""

import contextlib

from hetplan.zoo import models

with contextlib.suppress(ImportError):  # not installed: a model that needs it says so when built
    models.transformers_machinery()
