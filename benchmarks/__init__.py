"""GPU benchmarks of every mm3lab kernel against baselines measured in the same run.

Run on a CUDA machine from the repository root::

    python3 -m benchmarks            # every suite, writes benchmarks/results/<gpu>.json
    python3 -m benchmarks --quick    # one shape per suite
    python3 -m benchmarks --only attention_decode block_table
"""
