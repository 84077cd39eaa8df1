"""What SM90's assembler makes of the fused scatters (cross-compiled here: Triton ships ptxas and cuobjdump).

The scatter issues its packed-row load before it knows whether the row's index is valid (kernels.py, "Scatter
loads"); with one vector per thread ptxas would sink that load below the early exit it makes of the guarded store,
unless the load is pinned (``TargetFacts.pinned_scatter_load``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from kda_patches.state_copy import sass

pytestmark = pytest.mark.slow  # each child process compiles 2-8 variants with ptxas


def compile_in_child(target: str, warps: str) -> dict[str, list[str]]:
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("sass_order_child.py")), target,
                           warps], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("warps", ["default", "8"])
def test_every_sm90_scatter_loads_its_packed_row_before_any_early_exit(warps):
    found = compile_in_child("declared", warps)
    # FP32 and BF16 caches, each with FP32 and BF16 finals; the FP32 bulk scatter unless the warps were given
    assert len(found) == (5 if warps == "default" else 4)
    assert found == {key: [] for key in found}, found


def test_unpinned_same_dtype_scatters_at_8_warps_are_what_the_pin_is_for():
    # ptxas's own choice, recorded so that a ptxas which stops sinking the load shows up here (the pin then has
    # nothing to fix): with one vector per thread the packed load moves below the exit
    found = compile_in_child("unpinned", "8")
    assert found["float32 <- float32 warps 8"] and found["bfloat16 <- bfloat16 warps 8"], found
    assert all(op.split()[-1].startswith("LDG.E.128") for op in found["float32 <- float32 warps 8"])


@pytest.mark.parametrize("warps", ["default", "8"])
def test_every_sm90_gather_moves_its_tile_in_16_byte_vectors(warps):
    # index and flag as scalars, then the tile as one 16-byte load per thread and vector (predicated on the row
    # being valid) and as many unpredicated 16-byte stores: what upstream 0.34's gather issues per 4 KiB, so the
    # graph-replay gap to it (issue 27) is not the width of the copy
    found = compile_in_child("gathers", warps)
    assert len(found) == 2, found
    for key, order in found.items():
        tile, threads = int(key.split()[-1]), 32 * int(key.split()[2])
        vectors = tile // (16 * threads)
        assert vectors >= 1, key
        predicated = [re.sub(r"^@!?P\d ", "@P ", op) for op in order]  # which predicate register is ptxas's choice
        assert predicated == ["LDG.E", "LDG.E.U8", *["@P LDG.E.128"] * vectors, *["STG.E.128"] * vectors, "EXIT"], \
            (key, order)


def test_loads_after_the_first_predicated_exit_are_the_ones_reported():
    order = ["LDG.E", "@P1 EXIT", "LDG.E.128", "STG.E.128", "EXIT"]
    assert sass.loads_after_early_exit(order) == ["LDG.E.128"]
    assert sass.loads_after_early_exit(["LDG.E", "LDG.E.128", "@P0 EXIT", "STG.E.128", "EXIT"]) == []
    assert sass.loads_after_early_exit(["LDG.E", "EXIT", "LDG.E.128"]) == []  # an unpredicated exit ends the code
