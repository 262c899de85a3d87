"""``python -m tome_core.gpucheck``: the one-call GPU check, kept under this name; it lives in
``tome_core.bench.gpucheck``."""

import sys

from tome_core.bench.gpucheck import main

if __name__ == "__main__":
    sys.exit(main())
