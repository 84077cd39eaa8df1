"""``python -m kda_patches`` == ``kda-patches``."""

import sys

from kda_patches.cli import main

sys.exit(main())
