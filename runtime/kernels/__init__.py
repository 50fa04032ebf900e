"""GPU kernels of the vToken layer (Triton) and the test oracle of the statistics kernel.

    repack_triton       executes a copy engine plan (K/V rows, stats, positions) in place
    attn_stats_triton   per-slot attention statistics (attn_sum/last/window, low_attn_count)
    attn_stats_ref      test oracle of those statistics (dense, via paged_attention; not used at run time)

Importing this package does not import triton; the Triton modules do (set ``TRITON_INTERPRET=1``
before importing them to run on CPU tensors).
"""
