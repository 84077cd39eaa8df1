"""Release conformance: the forks' released sources (fetched, never imported) read against the patch records.

- :mod:`kda_patches.releases.fetch`: one release's ``.py`` files from the package registry, cached on disk;
- :mod:`kda_patches.releases.source`: an ``ast`` reader of a release folder (definitions, signatures, classes);
- :mod:`kda_patches.releases.shapes`: named code shapes a wrapper relies on (``Target.shapes``);
- :mod:`kda_patches.releases.conformance`: what the registry would decide on a stack, and one verdict per patch;
- :mod:`kda_patches.releases.matrix`: the default support matrix and ``patches/SUPPORT_MATRIX.md``;
- :mod:`kda_patches.releases.cli`: ``kda-patches conformance``.
"""
