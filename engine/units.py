"""Units of memory, in one place: every module that turns bytes into MiB (log lines, flags given in MiB,
sizes of arenas and pools) imports them from here, so `2**20` is written once.

engine/ is the lowest layer (scheduler/ and api/ import it, never the other way), so the units live here
and every layer can reach them.
"""
from __future__ import annotations

MIB = 2**20  # bytes in a mebibyte: the unit of every --*-mib flag and every MiB figure in the logs
