"""Triton kernels, one family per file, each with a torch fallback of the same algorithm."""
