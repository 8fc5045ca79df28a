"""`python -m hetplan.cli`, as `hetplan`."""

import sys

from hetplan.cli import main

sys.exit(main())
