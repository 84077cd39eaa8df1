"""Which launch entry a compiled variant uses: Triton's C entry (declared releases) or its launcher.

The CPU tests check the declaration on dummy launchers; the GPU tests (``--run-gpu``) launch real
plans and check that the direct entry skips ``CudaLauncher.__call__``, that an installed launch hook
sends launches back through the launcher (and sees them), and that the bytes are the naive twin's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from state_copy_helpers import bits

from kda_patches.state_copy import naive
from kda_patches.state_copy.variants import DIRECT_ENTRY_RELEASES, direct_entry


def c_entry(*args: Any) -> None:
    """Stands for a launcher module's C ``launch`` function (never called here)."""


class CudaLauncher:
    """A launcher shaped like Triton 3.5/3.6's (the class name is what the declaration checks)."""

    def __init__(self, global_scratch: int = 0, profile_scratch: int = 0) -> None:
        self.launch = c_entry
        self.global_scratch_size = global_scratch
        self.profile_scratch_size = profile_scratch
        self.launch_cooperative_grid = False
        self.launch_pdl = False


class HipLauncher(CudaLauncher):
    """Another backend's launcher: same attributes, another entry layout."""


@pytest.mark.parametrize("version", ["3.5.1", "3.6.0", "3.6.1+git1234"])
def test_declared_release_gets_the_c_entry(version: str) -> None:
    assert direct_entry(CudaLauncher(), version) is c_entry


@pytest.mark.parametrize("version", ["3.4.0", "3.7.0", "3.9.0", "2.3.1"])
def test_undeclared_release_takes_the_launcher(version: str) -> None:
    assert direct_entry(CudaLauncher(), version) is None


def test_declared_releases_are_major_minor() -> None:
    assert DIRECT_ENTRY_RELEASES and all(release.count(".") == 1 for release in DIRECT_ENTRY_RELEASES)


@pytest.mark.parametrize("scratch", [{"global_scratch": 64}, {"profile_scratch": 128}])
def test_kernel_needing_scratch_takes_the_launcher(scratch: dict[str, int]) -> None:
    assert direct_entry(CudaLauncher(**scratch), "3.6.0") is None


def test_other_backend_launcher_takes_the_launcher() -> None:
    assert direct_entry(HipLauncher(), "3.6.0") is None


def test_launcher_missing_an_attribute_takes_the_launcher() -> None:
    launcher = CudaLauncher()
    del launcher.launch_pdl
    assert direct_entry(launcher, "3.6.0") is None


@pytest.fixture
def launcher_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the compiled launchers' ``__call__`` (the path the direct entry skips)."""
    from triton.backends.nvidia.driver import CudaLauncher as RealLauncher

    calls: list[int] = []
    shipped = RealLauncher.__call__

    def counted(self: Any, *args: Any) -> Any:
        calls.append(1)
        return shipped(self, *args)

    monkeypatch.setattr(RealLauncher, "__call__", counted)
    return calls


def run_pair(binding: Any, cache: Any, reference: Any, device: torch.device, seed: int) -> None:
    """One flagged gather and one FP32-finals scatter on the plan and on the naive twin; compare every byte."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(10, generator=generator)[:4].to(device=device, dtype=torch.int32)
    flags = (torch.rand(4, generator=generator) > 0.3).to(device)
    finals = torch.randn((4, *cache.state.shape[1:]), generator=generator).to(device)
    packed = binding.gather(cache.state, indices, flags)
    binding.scatter(cache.state, finals, indices)
    torch.cuda.synchronize()
    assert torch.equal(bits(packed), bits(naive.gather_states(reference.state, indices, flags)))
    naive.scatter_states(reference.state, finals, indices)
    assert torch.equal(bits(cache.backing), bits(reference.backing))


@pytest.mark.gpu
def test_direct_entry_skips_the_launcher_and_copies_exactly(make_cache, device, launcher_calls, no_compiler):
    import triton

    from kda_patches.state_copy.plan import initialize

    cache = make_cache(dtype=torch.bfloat16, num_rows=10, inner=(2, 8, 32), gap=24, offset=3)
    reference = cache.clone()
    binding = initialize({"layer": cache.state}, 4)["layer"]
    declared = ".".join(triton.__version__.split(".")[:2]) in DIRECT_ENTRY_RELEASES
    assert binding.plan.describe()["launch_entry"] == ("direct" if declared else "launcher")
    launcher_calls.clear()
    no_compiler.arm()
    run_pair(binding, cache, reference, device, seed=3)
    assert len(launcher_calls) == (0 if declared else 2)
    assert cache.gaps_untouched() and no_compiler.entries == []


@pytest.mark.gpu
def test_launch_hook_sends_launches_through_the_launcher(make_cache, device, launcher_calls, no_compiler):
    from triton import knobs

    from kda_patches.state_copy.plan import initialize

    cache = make_cache(dtype=torch.float32, num_rows=10, inner=(2, 8, 32), gap=24, offset=1)
    reference = cache.clone()
    binding = initialize({"layer": cache.state}, 4)["layer"]
    seen: list[Any] = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher_calls.clear()
        no_compiler.arm()
        run_pair(binding, cache, reference, device, seed=4)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(launcher_calls) == 2 and len(seen) == 2
    assert cache.gaps_untouched() and no_compiler.entries == []


def test_ledger_fact_names_the_launch_entry(make_cache, device):
    import triton

    from kda_patches.ledger import get_ledger
    from kda_patches.state_copy.plan import initialize
    from kda_patches.state_copy.worker import LEDGER_SECTION

    cache = make_cache(dtype=torch.float32, num_rows=6, inner=(2, 8, 32), gap=8, offset=2)
    initialize({"entry-fact-layer": cache.state}, 4)
    fact = get_ledger().snapshot()["facts"][LEDGER_SECTION]["entry-fact-layer"]
    declared = ".".join(triton.__version__.split(".")[:2]) in DIRECT_ENTRY_RELEASES
    expected = "interpreter" if device.type == "cpu" else ("direct" if declared else "launcher")
    assert fact["launch_entry"] == expected
    assert fact["scatter_evict_first"] is (device.type == "cuda")  # the fused plan's startup decision
