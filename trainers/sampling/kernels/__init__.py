"""Triton kernels of one decode step: the 4-bit + LoRA linear, RMSNorm with the residual add."""
