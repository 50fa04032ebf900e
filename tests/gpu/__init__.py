"""vtoken's GPU path, proved on one CUDA device (an H200: < 5 minutes), as pytest tests (marker ``gpu``).

    scripts/gpu_check.sh [--json out.json] [--wheels DIR] [pytest args]    # CUDA device
    scripts/gpu_check.sh --smoke [--json out.json]                         # CPU, Triton interpreter (CI)

Without CUDA (and without ``--smoke``) every test is SKIPPED with the reason: a check that did not run
never reads as passed. The set-up from a plain tree, the settings and the JSON report: ``conftest.py``.
Each test asserts correctness; performance goals are reported (``goals`` in the JSON, and the summary
printed at the end) and never fail the run.

Checks, one module each (the tests: ``test_gpu_path.py``):

1. ``copy_layouts``     the copy engine's Triton runner on vLLM's two layer-outermost layouts, byte-exact
2. ``async_steps``      100 random steps with asynchronous copies vs synchronous ones, bit-identical; on CUDA
                        the copy engine never synchronises the host
3. ``cuda_graph``       paged attention over the cache's persistent buffers, captured once in a CUDA graph
                        and replayed over 50 evict / reclaim steps
4. ``kernel_bandwidth`` the select, repack and statistics kernels against their torch references, with
                        bandwidth as a fraction of a device copy (goal >= 0.70)
5. ``decode_overhead``  a Llama-8B-shaped decode step with H2O eviction vs without (goal: overhead <= 5%)
"""
