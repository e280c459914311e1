"""The CUDA backend: every Backend op (engine/backends/base.py) as launches of the kernels of
docs/CUDA_KERNELS.md (compiled by cuda_kernels/), over cuda-python's driver API.

backend.py is the Backend and composes the rest: device.py (context, arena), launch.py / abi.py (kernel
modules and argument packing), memory.py, streams.py, kv*.py, graphs.py, ops.py / linear.py / moe.py.
expert_cache/ holds MoE experts in pinned host memory with a device cache of slots.
"""
