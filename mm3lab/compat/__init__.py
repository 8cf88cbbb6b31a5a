"""Compatibility layers with the names and shapes of upstream serving engines and kernels (vllm, msa)."""
