"""Where a sealed plan's host time goes on the GPU host: checks, allocation, Triton's launcher (issue 8).

One 1-row gather and scatter (the GPU finishes each launch long before the next, so the loop measures the host),
timed in a tight loop (best of 5 x 3000 calls), next to torch's own gather and copy. Not a benchmark of the
copy: it says which part of the plan's eager enqueue is ours (checks, ``torch.empty``) and which is Triton's
compiled launcher.

Usage: ``python scripts/gpu/plan_host_profile.py --out DIR`` (CUDA only; writes ``DIR/plan_host_profile.json``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any


def best_us(call: Any, torch: Any, calls: int = 3000) -> float:
    """Best of 5 loops of ``calls`` calls, in microseconds per call (synchronized between loops)."""
    from kda_patches.bench.timing import best_loop_us

    return round(best_loop_us(call, calls, synchronize_device=torch.device("cuda")), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("plan_host_profile: no CUDA device; nothing measured")
        return 0
    from triton.runtime import driver

    from kda_patches.state_copy.worker import initialize

    device = torch.device("cuda")
    state = torch.randn(1024, 8, 128, 128, device=device)
    binding = initialize({"profile": state}, 256, final_dtypes=(torch.float32,))["profile"]
    plan = binding.plan
    indices = torch.randperm(1024, device=device)[:1].to(torch.int32)
    flags = torch.rand(1, device=device) < 0.75
    last = torch.randn(1, 8, 128, 128, device=device)
    packed = torch.empty_like(last)
    gather, scatter, grid = plan._gathers[torch.int32], plan._scatters[torch.float32][torch.int32], plan._grid(1)
    result = {
        "binding.gather (checks + torch.empty + launch)": best_us(lambda: binding.gather(state, indices, flags), torch),
        "binding.scatter (checks + launch)": best_us(lambda: binding.scatter(state, last, indices), torch),
        "plan._check_call": best_us(lambda: plan._check_call(state, indices, None), torch),
        "torch.empty of the packed rows": best_us(lambda: torch.empty((1, 8, 128, 128), device=device), torch),
        "CompiledVariant.launch (gather)": best_us(
            lambda: gather.launch(grid, state, packed, indices, flags, state.shape[0]), torch),
        "CompiledVariant.launch (scatter)": best_us(
            lambda: scatter.launch(grid, state, last, indices, plan._true_flags, state.shape[0]), torch),
        "Triton launcher alone (compiled.run)": best_us(lambda: gather._run(
            grid[0], grid[1], 1, driver.active.get_current_stream(0), gather._function, gather._metadata, None, None,
            None, state.data_ptr(), packed.data_ptr(), indices.data_ptr(), flags.data_ptr(), state.shape[0],
            *gather._args), torch),
        "torch gather state[indices]": best_us(lambda: state[indices], torch),
        "torch copy_ of one row": best_us(lambda: packed.copy_(last), torch),
    }
    print(json.dumps(result, indent=1))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_host_profile.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
