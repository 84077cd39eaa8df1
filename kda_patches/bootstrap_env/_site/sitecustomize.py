"""Activation shim for processes started by the kda_patches launcher (first on ``PYTHONPATH``).

Python imports ``sitecustomize`` at startup; this one activates the overlay (``import kda_patches``),
then hands over to the next ``sitecustomize`` on ``sys.path`` (the distribution's or the user's), so
installing the launcher never hides another site customization. The shim's directory is removed from
``sys.path`` of this process (``PYTHONPATH`` still carries it to grandchildren).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _import_overlay() -> None:
    """Import kda_patches (if it is not installed, from the tree this shim belongs to) and say so in the ledger."""
    try:
        import kda_patches
    except ModuleNotFoundError as error:
        if error.name != "kda_patches":
            raise
        root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
        sys.path.insert(0, root)
        try:
            import kda_patches
        finally:
            if root in sys.path:
                sys.path.remove(root)
    kda_patches.get_ledger().set_fact("bootstrap", "activated_by", "launcher (sitecustomize shim on PYTHONPATH)")


def _chain_next_sitecustomize() -> None:
    """Import the next ``sitecustomize`` on ``sys.path`` in place of this one, if there is one."""
    this = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the next one: this directory is off sys.path now)
    except ImportError as error:
        if error.name != "sitecustomize":
            raise
        if this is not None:
            sys.modules["sitecustomize"] = this


sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
try:
    _import_overlay()
finally:
    _chain_next_sitecustomize()
