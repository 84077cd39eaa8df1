"""Read and write result JSON, plain (``.json``) or xz-compressed (``.json.xz``).

Raw run JSON under ``docs/results`` is committed compressed as ``.json.xz`` (every GPU run carries the
whole working tree). Read one from a shell with ``xz -dc FILE.json.xz | python -m json.tool``.

``python -m kda_patches.results_io FILE.json ...`` compresses each file to ``FILE.json.xz`` (the exact
bytes, preset 9 extreme) and deletes the original once the compressed copy decodes to the same bytes.

Standard library only, and imports nothing from the package, so a script can load this file by path
without activating the overlay (see ``scripts/compare_bench.py``).
"""

from __future__ import annotations

import json
import lzma
import os
import sys
from typing import Any

PRESET = 9 | lzma.PRESET_EXTREME


def read_json(path: str | os.PathLike[str]) -> Any:
    """Return the parsed JSON of ``path``: decompressed when it ends in ``.xz``, plain otherwise.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names it, and its ``.json.xz`` twin
            when ``path`` is a plain ``.json`` that was compressed).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        hint = f" (committed results are compressed: try {path}.xz)" if os.path.isfile(path + ".xz") else ""
        raise FileNotFoundError(f"no result file {path!r}{hint}")
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return json.load(handle)


def write_json(path: str | os.PathLike[str], data: Any) -> str:
    """Write ``data`` as indented JSON, xz-compressed, to ``path`` (``.xz`` appended if missing); return it.

    Refuses to overwrite an existing file (``FileExistsError``), like the benchmarks' own writers.
    """
    path = os.fspath(path)
    if not path.endswith(".xz"):
        path += ".xz"
    text = json.dumps(data, indent=1, sort_keys=True, default=str) + "\n"
    with lzma.open(path, "xt", encoding="utf-8", preset=PRESET) as handle:
        handle.write(text)
    return path


def compress(path: str | os.PathLike[str]) -> str:
    """Compress the JSON file ``path`` to ``path + '.xz'`` byte for byte, delete ``path``, return the new path."""
    path = os.fspath(path)
    with open(path, "rb") as handle:
        raw = handle.read()
    json.loads(raw)  # refuse a file that is not JSON before touching anything
    target = path + ".xz"
    with open(target, "xb") as handle:
        handle.write(lzma.compress(raw, preset=PRESET))
    with lzma.open(target, "rb") as handle:
        if handle.read() != raw:
            raise OSError(f"{target} does not decode to the bytes of {path}; original kept")
    os.remove(path)
    return target


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__.splitlines()[0] + "\nusage: python -m kda_patches.results_io FILE.json ...", file=sys.stderr)
        return 2
    for path in paths:
        target = compress(path)
        print(f"{path}: {os.path.getsize(target)} bytes as {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
