"""A vLLM worker extension that writes the overlay's ledger on request, before the engine is stopped.

A process's ledger is written at most once a second while counters change and once more at exit. vLLM's GPU
engine-core process is stopped by a signal and exits without running exit handlers, so the counters of the last
second -- on a small A/B workload, every routed call -- never reached the status dir (seen on the H200: routed
counts of one workload read 2, 6, 10 and 16 in four processes). The A/B workloads therefore name this class as
vLLM's ``worker_extension_cls`` (vLLM's own mechanism for RPCs into its workers) and call
``llm.collective_rpc("write_kda_ledger")`` after generating: every worker writes its complete ledger.
"""

from __future__ import annotations

EXTENSION = "kda_patches.regress.worker_ledger.LedgerWriterExtension"
METHOD = "write_kda_ledger"


class LedgerWriterExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; adds :meth:`write_kda_ledger`."""

    def write_kda_ledger(self) -> str | None:
        """Write this worker process's ledger now; return its path (None without a status dir)."""
        from kda_patches.ledger import get_ledger

        return get_ledger().flush(force=True)


def with_ledger_writer(engine_args: dict) -> dict:
    """Return ``engine_args`` with :data:`EXTENSION` as ``worker_extension_cls``.

    Raises:
        ValueError: the caller already names another worker extension (vLLM takes one; the A/B's ledgers
            would then be cut off at the engine's stop without saying so).
    """
    given = engine_args.get("worker_extension_cls")
    if given and given != EXTENSION:
        raise ValueError(f"worker_extension_cls={given!r} is set, and the A/B needs {EXTENSION} there to write every "
                         "worker's ledger before the engine stops; leave worker_extension_cls unset for the A/B")
    return dict(engine_args, worker_extension_cls=EXTENSION)
