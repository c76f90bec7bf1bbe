"""Our own on-policy sampler: the decode loop and its kernels."""
