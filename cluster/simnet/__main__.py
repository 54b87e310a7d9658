"""``python -m pdserve.cluster.simnet``: the by-hand commands (``cli.py``)."""

from __future__ import annotations

import sys

from pdserve.cluster.simnet.cli import main

sys.exit(main())
