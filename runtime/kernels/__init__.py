"""GPU kernels of the vToken layer (Triton) and their torch references.

    repack_triton       executes a copy engine plan (K/V rows, stats, positions) in place
    attn_stats_triton   per-slot attention statistics (attn_sum/last/window, low_attn_count)
    attn_stats_ref      the torch reference of those statistics (dense, via paged_attention)

Importing this package does not import triton; the Triton modules do (set ``TRITON_INTERPRET=1``
before importing them to run on CPU tensors).
"""
