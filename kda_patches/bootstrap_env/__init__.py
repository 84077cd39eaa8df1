"""Environment bootstrap internals (stdlib only): discovery, preloads, launcher, activation shim.

The public entry points live in :mod:`kda_patches.env`; the modules here are imported only when
they have work to do, so that ``import kda_patches`` stays cheap on machines without Ascend.
"""
