"""Startup-compiled Triton state-copy plans for KDA prefill (gather initial / scatter final states).

Imported only by the state-copy patches at run time (never by ``import kda_patches``): it imports
torch and triton. Modules: ``kernels`` (Triton kernels), ``casts`` (the final-state cast folded into
the scatter, exact to torch's ``.to()``), ``naive`` (pure-torch twins), ``layout``
(metadata contract), ``device`` (capability routing), ``variants`` (direct compiled launches),
``plan`` (fused/fallback plans), ``worker`` (``initialize`` and per-layer bindings), ``ops`` (custom
ops), ``context`` (forward-context lookup), ``errors`` (refusals and the ledger).

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU tensors.
"""
