"""The launcher behind ``python bootstrap.py -- CMD``, ``kda-run CMD`` and ``kda-patches run -- CMD``.

It prepares the environment in this process (the same bootstrap as at import: custom-op paths,
``LD_LIBRARY_PATH``, fork switches), puts the activation shim (``_site/sitecustomize.py``) first on
``PYTHONPATH`` so every Python child activates the overlay, and then ``exec``s the command. Setting
``LD_LIBRARY_PATH`` before ``exec`` is the only way it reaches bare-name ``dlopen`` in the new program:
glibc reads it once at process start. ``KDA_PATCHES=0`` passes the environment through unchanged.
"""

from __future__ import annotations

import os
import sys

from kda_patches.ledger import get_ledger

TYPE_CHECKING = False  # typing costs ~8 ms at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Any, NoReturn

USAGE = """usage: kda-run [--] COMMAND [ARG...]
       python bootstrap.py -- COMMAND [ARG...]
       kda-patches run -- COMMAND [ARG...]

Prepare the environment (CANN custom-op paths, LD_LIBRARY_PATH, preloads, fork switches; see
KDA_PATCHES_* switches) and replace this process with COMMAND. Python children activate the overlay.
"""


def activation_shim_dir() -> str:
    """Return the directory holding the activation ``sitecustomize.py`` put on ``PYTHONPATH``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


def prepare_child_environment() -> dict[str, Any]:
    """Apply the bootstrap to ``os.environ`` and add the activation shim to ``PYTHONPATH``.

    Returns:
        The launcher record also stored in the ledger (``bootstrap``/``launcher``): whether the overlay is
        enabled, the ``PYTHONPATH`` entries added and the bootstrap report's path additions.
    """
    import kda_patches
    from kda_patches.bootstrap_env.discovery import prepend_paths

    flags = kda_patches.current_flags()
    if not flags.enabled:
        record: dict[str, Any] = {"enabled": False, "note": "KDA_PATCHES=0: environment passed through unchanged"}
    else:
        from kda_patches.env import bootstrap_environment

        report = bootstrap_environment(flags)  # already ran at activation: returns the same report
        record = {"enabled": True, "mode": report["mode"],
                  "PYTHONPATH": {"added": prepend_paths(os.environ, "PYTHONPATH", [activation_shim_dir()])},
                  "ASCEND_CUSTOM_OPP_PATH": os.environ.get("ASCEND_CUSTOM_OPP_PATH"),
                  "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH")}
    get_ledger().set_fact("bootstrap", "launcher", record)
    return record


def exec_command(command: list[str]) -> NoReturn:
    """Replace this process with ``command`` (searched on ``PATH``), passing ``os.environ``.

    Exits 127 when the command is not found and 126 when it cannot be executed, like a shell.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, os.environ)
    except FileNotFoundError:
        sys.stderr.write(f"kda-run: command not found: {command[0]}\n")
        raise SystemExit(127) from None
    except OSError as error:
        sys.stderr.write(f"kda-run: cannot execute {command[0]}: {error}\n")
        raise SystemExit(126) from None


def launch_command(argv: list[str]) -> NoReturn:
    """Entry of the launcher: parse ``[--] COMMAND [ARG...]``, prepare the environment, ``exec``.

    Args:
        argv: arguments after the program name; a leading ``--`` is dropped, ``-h``/``--help`` prints usage.
    """
    args = list(argv)
    if args[:1] == ["--"]:
        args = args[1:]
    elif args[:1] in (["-h"], ["--help"]):
        sys.stdout.write(USAGE)
        raise SystemExit(0)
    if not args:
        sys.stderr.write(USAGE)
        raise SystemExit(2)
    prepare_child_environment()
    exec_command(args)
