"""``python -m tome_core.bench``: the benchmark's command line."""

import sys

from tome_core.bench.cli import main

sys.exit(main())
