"""The conversation cache: a tree of KV blocks over three tiers (device pool, host RAM, disk).

`prefix_cache.PrefixCache` is the front door (match / plan / apply / release / check_integrity); its parts
are the tree (tree.py), the tiers (tiers.py), the eviction order (eviction_index.py, eviction_sim.py), the
planner (planner.py, room.py, host_room.py, device_pool.py) with its typed plans (plans.py), the applier
(apply.py), the checkpoints of hybrid models (checkpoint*.py, hybrid_steps.py), the disk tier and the
write-behind (disk_tier.py, block_mover.py, write_behind.py, persistence.py). Nothing outside this package
reads a private attribute of these; import the modules themselves (this file re-exports nothing).
"""
