"""`python -m dedupe.cli`: the same as the `dedupe-worker` command."""

from __future__ import annotations

import sys

from dedupe.cli import main

sys.exit(main())
