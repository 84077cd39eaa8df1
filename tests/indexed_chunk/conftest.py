"""tests/indexed_chunk: the released-code harness of tests/released (its loader, stand-ins, interpreter fixes)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "released"))
