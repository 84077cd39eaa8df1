"""``python -m kda_patches.bench state-copy --output FILE ...``."""

from __future__ import annotations

import sys

from kda_patches.bench import main

if __name__ == "__main__":
    sys.exit(main())
