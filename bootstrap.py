"""Launcher entry: ``python bootstrap.py -- CMD [ARG...]``.

Prepares the environment (CANN custom-op paths, ``LD_LIBRARY_PATH``, preloads, fork switches) and
then ``exec``s CMD, whose Python processes activate the overlay. Same as ``kda-run CMD`` and
``kda-patches run -- CMD``. Package code never imports this file: it imports
``kda_patches.env`` by its full name, so a user's own ``bootstrap.py`` cannot shadow it.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Run the launcher with ``argv`` (default: this script's arguments)."""
    from kda_patches.env import launch

    launch(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
