"""Test-only sitecustomize: spawned children end without the interpreter teardown (``kda_test_fast_exit``).
It does not activate the overlay (the activation-path tests choose their own path)."""

import kda_test_fast_exit

kda_test_fast_exit.install()
