"""Write and remove ``kda_patches.pth``: activation of the overlay in every interpreter of a site dir.

Python runs the ``import`` lines of every ``.pth`` file in a site-packages directory at startup, so a
one-line ``kda_patches.pth`` activates the overlay in every process that uses that directory: the
engine core, each TP/PP worker, spawned children, Ray actors. The line never breaks startup: when
``kda_patches`` is no longer importable it first tries the tree it was installed from (recorded at
install time, needed when the ``.pth`` sits in a site dir processed before the package's own), and
otherwise writes one warning to stderr and lets Python start unpatched.
"""

from __future__ import annotations

import os
import sys

PTH_NAME = "kda_patches.pth"

_ACTIVATION = '''\
import os, sys
try:
    import kda_patches
except ModuleNotFoundError as error:
    if error.name != "kda_patches":
        raise
    root = {fallback!r}
    if root and os.path.isfile(os.path.join(root, "kda_patches", "__init__.py")):
        sys.path.insert(0, root)
        try:
            import kda_patches
        finally:
            if root in sys.path:
                sys.path.remove(root)
    else:
        sys.stderr.write("kda_patches.pth: kda_patches is not importable, so the overlay is NOT active in "
                         "this interpreter; reinstall kda-patches, or remove {pth} (kda-patches uninstall)\\n")
'''


def site_packages_dir(user: bool = False, prefix: str | None = None) -> str:
    """Return the site-packages directory a ``.pth`` file is written to.

    Args:
        user: the user site (``site.getusersitepackages()``, honours ``PYTHONUSERBASE``).
        prefix: an install prefix: ``PREFIX/lib/pythonX.Y/site-packages`` for this interpreter's X.Y.
    Returns:
        The directory; the default is the running interpreter's purelib (the venv's site-packages).
    Raises:
        ValueError: both ``user`` and ``prefix`` were given.
    """
    if user and prefix:
        raise ValueError("choose either --user or --prefix, not both")
    if prefix:
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        return os.path.join(os.path.abspath(prefix), "lib", version, "site-packages")
    if user:
        import site

        return site.getusersitepackages()
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def render_pth(target_dir: str) -> str:
    """Return the content of ``kda_patches.pth`` for ``target_dir`` (deterministic for one install).

    Args:
        target_dir: the site-packages directory the file goes to.
    Returns:
        Two comment lines and one ``import`` line that activates the overlay.
    """
    import kda_patches

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(kda_patches.__file__)))
    fallback = None if os.path.normpath(package_root) == os.path.normpath(target_dir) else package_root
    code = _ACTIVATION.format(fallback=fallback, pth=os.path.join(target_dir, PTH_NAME))
    return ("# kda_patches: activates the overlay in every interpreter that uses this site-packages dir.\n"
            "# Written by `kda-patches install`; remove it with `kda-patches uninstall`.\n"
            f"import sys; exec({code!r}, {{'__name__': 'kda_patches_pth'}})\n")


def install_pth(user: bool = False, prefix: str | None = None) -> str:
    """Write ``kda_patches.pth`` into the target site-packages (idempotent).

    Args:
        user: write to the user site instead of the interpreter's site-packages.
        prefix: write to ``PREFIX/lib/pythonX.Y/site-packages`` (created if missing).
    Returns:
        The path of the ``.pth`` file. A file with the same content is left untouched.
    Raises:
        ValueError: both ``user`` and ``prefix`` were given.
    """
    target = site_packages_dir(user=user, prefix=prefix)
    if user:
        import site

        if not site.ENABLE_USER_SITE:
            import logging

            logging.getLogger("kda_patches").warning(
                "kda_patches: the user site is disabled for this interpreter (virtual environment, -s or "
                "PYTHONNOUSERSITE); %s only takes effect in interpreters that enable it", target)
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, PTH_NAME)
    content = render_pth(target)
    try:
        with open(path) as handle:
            if handle.read() == content:
                return path
    except FileNotFoundError:
        pass
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as handle:
        handle.write(content)
    os.replace(temporary, path)
    return path


def uninstall_pth(user: bool = False, prefix: str | None = None) -> str | None:
    """Remove ``kda_patches.pth`` from the target site-packages (same targets as :func:`install_pth`).

    Returns:
        The path removed, or None when there was no file (uninstalling twice is fine).
    Raises:
        ValueError: both ``user`` and ``prefix`` were given.
    """
    path = os.path.join(site_packages_dir(user=user, prefix=prefix), PTH_NAME)
    try:
        os.remove(path)
    except FileNotFoundError:
        return None
    return path
