"""Release conformance: the forks' released sources (fetched, never imported) read against the patch records.

- :mod:`kda_patches.releases.fetch`: one release's ``.py`` files from the package registry, cached on disk.
"""
