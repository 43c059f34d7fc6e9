"""Compiled and GPU kernels behind screener.fingerprint, each loaded on first use.

`cpu.py` loads the C kernel (fingerprint.c, built into the package at install time) with ctypes;
`triton_fp.py` holds the Triton kernel for CUDA tensors. Importing this package loads nothing.
"""
