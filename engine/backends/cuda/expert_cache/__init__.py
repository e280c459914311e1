"""The expert cache of the CUDA backend (`--expert-cache-mib N|auto`): MoE experts in pinned host memory, the
hot ones in device slots (cache.py; the slot policy in slots.py, the slot memory in memory.py, the budget
granted by the memory admission in budget.py)."""
