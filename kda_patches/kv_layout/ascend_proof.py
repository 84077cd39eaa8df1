"""vllm-ascend 0.26-0.30's (and vLLM 0.34's) own KV-cache layouts of real models, executed on the CPU and proven.

For every release of the fork, every model of :mod:`kda_patches.kv_layout.ascend_models` and tensor-parallel size
1, 2, 4 and 8, this module runs the released code path that decides and builds the KV cache, on the ``meta``
device (shapes, strides and storage offsets exactly as torch computes them; no bytes), then hands every view the
model would use to :func:`kda_patches.kv_layout.checker.check_footprints`, storage by storage: bytes addressed by
two different block ids never overlap, two layers (or states) of one group never share a block's bytes, nothing
lies outside its storage.

What is executed from the release cache (:mod:`kda_patches.kv_layout.release_exec`; each definition compiled from
the release file, nothing copied):

1. the model's config hook (vLLM's ``MODELS_CONFIG_MAP`` entry, e.g. Qwen3.5's ``mamba_ssm_dtype``), the fork's
   ``patch_mamba_config.verify_and_update_config`` (which replaces vLLM's hybrid hook: block size and Mamba page
   padding), vLLM's ``MambaModelConfig.verify_and_update_config``, the fork's ``refresh_block_size``, and on
   releases whose platform chains to vLLM's (0.30) ``Platform.update_block_size_for_backend`` /
   ``_align_hybrid_block_size`` through the fork's overrides; the model class's
   ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` and vLLM's state calculators;
2. the fork's ``NPUModelRunner.get_kv_cache_spec`` over the layers, with vLLM's ``Attention`` /
   ``MLAAttention`` / ``MambaBase.get_kv_cache_spec`` and spec classes;
3. vLLM's planner ``get_kv_cache_configs`` with the fork's ``patch_kv_cache_utils`` installed the way the fork
   installs it (its module-level assignments), and on 0.30 vLLM's ``resolve_kv_cache_layout``;
4. the fork's ``NPUModelRunner._allocate_kv_cache_tensors`` and ``_reshape_kv_cache_tensors`` (and the helpers
   they call), with the fork's attention backends' ``get_kv_cache_shape``.

What is stood in (:data:`kda_patches.kv_layout.ascend_engine.STOOD_IN`): the engine objects those functions read
(``vllm_config`` and its parts as plain namespaces with the engine's defaults, the runner's plain attributes, the
layers' constructor-set attributes), the device (``meta``), the model registry lookup, and vLLM's logger. A release
whose code cannot run this way for a model gets the verdict ``not checkable`` with what stopped it.

vLLM 0.34 (:func:`run_upstream`): the same models and TPs on vLLM's own extensible KV cache, the views bound at
``initialize_kv_cache`` and those ``extend_kv_cache`` rebinds after warmup, each proven
(:mod:`kda_patches.kv_layout.upstream034_stack` runs the release code, :mod:`kda_patches.kv_layout.upstream034_proof`
proves it); the README gives them a section of their own.

Run ``python -m kda_patches.kv_layout.ascend_proof --write docs/results/ascend-kv-layout/README.md`` to
regenerate the committed table; ``--check`` compares instead of writing.
``--check`` with no path compares the committed table (``docs/results/ascend-kv-layout/README.md``).

The pieces, one concern each: :mod:`~kda_patches.kv_layout.ascend_engine` (the stood-in engine objects),
:mod:`~kda_patches.kv_layout.ascend_sources` (facts read from the release text),
:mod:`~kda_patches.kv_layout.ascend_stack` (the release code executed), :mod:`~kda_patches.kv_layout.ascend_verdict`
(views to footprints to a verdict), :mod:`~kda_patches.kv_layout.ascend_table` (the README); this module runs
every case and is the command line.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import logging
import pathlib
import sys
from typing import Any

from kda_patches.kv_layout import ascend_models
from kda_patches.kv_layout.ascend_engine import engine_environment
from kda_patches.kv_layout.ascend_stack import AscendStack
from kda_patches.kv_layout.ascend_table import Row, render, same_but_date
from kda_patches.kv_layout.ascend_verdict import run_case
from kda_patches.releases.matrix import PAIRED_VLLM

# (vllm-ascend, vLLM) pairs run: each release with the vLLM release its sdist names (Dockerfile ``ARG VLLM_TAG``,
# ``.github/vllm-release-tag.commit``), the conformance pairing kda_patches.releases.matrix.PAIRED_VLLM.
ASCEND_RELEASES = ("0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2")
RELEASES = tuple((fork, PAIRED_VLLM[fork]) for fork in ASCEND_RELEASES)
TENSOR_PARALLEL = (1, 2, 4, 8)
UPSTREAM_RELEASES = ("0.34.0",)  # vLLM releases whose extensible KV cache is proven before and after the rebind
README = pathlib.Path("docs/results/ascend-kv-layout/README.md")  # the committed table, from the repository root


def run_all(releases: tuple[tuple[str, str], ...] = RELEASES) -> tuple[list[Row],
                                                                        dict[tuple[str, str], dict[str, list[str]]]]:
    """Every release x model x TP (logging up to WARNING silenced, no engine variables set).

    Args:
        releases: the (vllm-ascend, vLLM) pairings to run.

    Returns:
        ``(rows, what each release's tree resolved, by kind)``.
    """
    rows, bound = [], {}
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with engine_environment():
            for fork, vllm in releases:
                stack = AscendStack(fork, vllm)
                for model_name in ascend_models.MODELS:
                    for tp in TENSOR_PARALLEL:
                        rows.append((fork, vllm, model_name, tp, run_case(stack, model_name, tp)))
                bound[(fork, vllm)] = stack.tree.report()
    finally:
        logging.disable(previous)
    return rows, bound


def run_upstream(releases: tuple[str, ...] = UPSTREAM_RELEASES) -> tuple[list[Any], dict[str, dict[str, list[str]]]]:
    """Every vLLM release x model x TP of the extensible KV cache (:mod:`~kda_patches.kv_layout.upstream034_proof`).

    Returns:
        ``(rows, what each release's tree resolved, by kind)``; a row is ``(vLLM, model, TP, RebindResult)``.
    """
    from kda_patches.kv_layout.upstream034_proof import run_case as run_rebind_case
    from kda_patches.kv_layout.upstream034_stack import Upstream034Stack

    rows, bound = [], {}
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with engine_environment():
            for vllm in releases:
                stack = Upstream034Stack(vllm)
                try:
                    for model_name in ascend_models.MODELS:
                        for tp in TENSOR_PARALLEL:
                            rows.append((vllm, model_name, tp, run_rebind_case(stack, model_name, tp)))
                finally:
                    stack.close()
                bound[vllm] = stack.tree.report()
    finally:
        logging.disable(previous)
    return rows, bound


def main(argv: list[str] | None = None) -> int:
    """The command line: print the README, ``--write`` it, or ``--check`` a committed one.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 1 when ``--check`` finds a difference (printed as a diff), else 0.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=pathlib.Path, help="write the results README here")
    parser.add_argument("--check", type=pathlib.Path, nargs="?", const=README,
                        help=f"fail if this README (default {README}) differs from a fresh run (dates aside)")
    args = parser.parse_args(argv)
    rows, bound = run_all()
    text = render(rows, bound, datetime.date.today().isoformat(), run_upstream())
    if args.check is not None:
        committed = args.check.read_text(encoding="utf-8")
        if not same_but_date(committed, text):
            sys.stdout.writelines(difflib.unified_diff(committed.splitlines(True), text.splitlines(True),
                                                       str(args.check), "fresh run"))
            return 1
        print(f"{args.check}: matches a fresh run")
        return 0
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text, encoding="utf-8")
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
