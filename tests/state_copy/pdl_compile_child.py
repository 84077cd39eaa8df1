"""Cross-compile the fused plan's variants for an SM90 GPU on this machine and report the grid-dependency
instructions in their PTX (run without ``TRITON_INTERPRET``: the JIT functions must be compilable).

argv[1]: ``pdl`` or ``plain`` (the plan's request). Prints one JSON line: variant name -> whether its PTX waits
(``griddepcontrol.wait``) and releases (``griddepcontrol.launch_dependents``), and its ``launch_pdl`` option.
"""

from __future__ import annotations

import json
import sys

import torch

from kda_patches.state_copy import casts, sass
from kda_patches.state_copy.device import CUDA_PDL_TARGET
from kda_patches.state_copy.plan import FusedStatePlan


def main() -> None:
    state = torch.empty((8, 12, 128, 128), dtype=torch.bfloat16, device="meta")
    policies = {final: casts.CastPolicy(final, torch.bfloat16, casts.NAN_QUIET) for final in (torch.bfloat16,
                                                                                              torch.float32)}
    found = {}
    for spec in FusedStatePlan.variant_specs(state, 8, CUDA_PDL_TARGET, policies, pdl=sys.argv[1] == "pdl"):
        ptx = sass.cross_compile(spec).asm["ptx"]
        found[spec["name"]] = {"wait": "griddepcontrol.wait" in ptx,
                               "launch_dependents": "griddepcontrol.launch_dependents" in ptx,
                               "launch_pdl": spec["launch_pdl"]}
    print(json.dumps(found))


if __name__ == "__main__":
    main()
