# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench moe-weight-prep``: NVFP4 MoE weight preparation, legacy vs bounded.

For every MoE layer of a model preset or a checkpoint, one layer at a time::

    synthetic NVFP4 layer (random codes and scales of the exact shapes)
    or a checkpoint's layer (``sources``)
      -> --quant-mode w4a4 (``w4a4_layers``):
           legacy  preparation: reorder (split+cat), swizzle (padded + permuted
                   copies), fold (float32 whole-tensor products)
           bounded preparation: FusedMoE's own process_weights_after_loading
                   for the b12x backends (fold, reorder, swizzle, finalize)
      -> --quant-mode w4a16 (``w4a16_layers``): FlashInfer's W4A16 paths
           (``baselines``) beside the bounded one
      -> check: every variant gives the same bytes (``checks``)

Each variant runs twice on fresh copies of the layer: once timed, once under
:func:`vllm.utils.mem_utils.measure_peak_memory` (the CPU meter uses the
profiler, which slows code down). A step's *peak transient* is its metered
peak minus the growth of the resident parameters it leaves behind (a padded
swizzle result replaces a smaller source): the free memory the step needs
above the weights resident before and after it.

Modules, each one job: ``cli`` (the command line), ``run`` (the job, either
quant mode), ``ranks`` (the processes of ``--tp N``), ``shard`` (one rank's
part of a layer), ``sources`` (a checkpoint as the layer source),
``presets`` and ``synthetic_weights`` (model shapes and random layers of
them), ``layer`` (the FusedMoE layer a run prepares, either mode),
``w4a4_layers`` / ``w4a16_layers`` (one rank's layers measured),
``baselines`` (the preparations measured against), ``checks``,
``precision``, ``report``, ``plot``, ``output_files``, ``memory_limit``,
``busy_cores``.
"""
