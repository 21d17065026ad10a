"""Drafter attention kernels: problem spec, input contract, KV caches, torch reference, registry.

Kept light on purpose: importing `kernels` pulls in no CUDA library; backends that need CuPy are
imported only when the registry is asked for them.
"""
