"""Triton kernels, one family per file, launch tables in _tuning.py. Which of them a call runs
(and whether the torch versions run instead) is decided in grpo_lce/_dispatch.py."""
