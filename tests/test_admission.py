"""Memory admission at start-up: the machine's limit read the right way, the host tier clamped or refused."""
import logging
from types import SimpleNamespace

import psutil
import pytest

from engine.units import MIB
from scheduler.memory import sizing
from scheduler.memory.sizing import MachineMemory, create_admission, plan_memory, read_machine_memory


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_wins(tmp_path):
    _write(tmp_path, "sys/fs/cgroup/memory.max", str(6144 * MIB))
    _write(tmp_path, "sys/fs/cgroup/memory.current", str(5000 * MIB))
    machine = read_machine_memory(tmp_path)
    assert machine.source == "cgroup v2 memory.max" and machine.limit_bytes == 6144 * MIB
    assert machine.in_use_bytes <= 5000 * MIB  # this process's own pages are not counted as others'


def test_unlimited_cgroup_v2_falls_back_to_v1_then_available_memory(tmp_path, monkeypatch):
    _write(tmp_path, "sys/fs/cgroup/memory.max", "max")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(2**63 - 4096))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=24000 * MIB, available=20000 * MIB))
    monkeypatch.setattr(sizing, "_own_rss_bytes", lambda: 300 * MIB)
    machine = read_machine_memory(tmp_path)
    # this process's 300 MiB are not "used by others": available already left them out
    assert machine == MachineMemory(24000 * MIB, (24000 - 20000 - 300) * MIB, "available memory")


def test_available_memory_without_cgroup_files_as_on_windows(tmp_path):
    """No /sys/fs/cgroup at all (Windows, macOS): the OS's own figures, from psutil, and this process's RSS."""
    machine = read_machine_memory(tmp_path)
    memory = psutil.virtual_memory()
    assert machine.source == "available memory" and machine.limit_bytes == memory.total
    assert 0 <= machine.in_use_bytes <= memory.total - memory.available


def test_cgroup_v1_limit(tmp_path):
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(4096 * MIB))
    _write(tmp_path, "sys/fs/cgroup/memory/memory.usage_in_bytes", str(100 * MIB))
    machine = read_machine_memory(tmp_path)
    assert machine.source == "cgroup v1 memory.limit_in_bytes" and machine.limit_bytes == 4096 * MIB


def test_host_tier_that_fits_is_granted_whole():
    machine = MachineMemory(limit_bytes=24000 * MIB, in_use_bytes=1000 * MIB, source="test")
    plan = plan_memory(2000 * MIB, 8192, 1024, block_bytes=MIB, machine=machine)
    assert plan.host_blocks == 8192 and plan.clamped_from_mib is None


def test_container_smaller_than_the_cache_is_clamped_with_the_flag_and_value(caplog):
    machine = MachineMemory(limit_bytes=6144 * MIB, in_use_bytes=0, source="cgroup v2 memory.max")
    with caplog.at_level(logging.WARNING, logger="strata.admission"):
        plan = plan_memory(2000 * MIB, 8192, 1024, block_bytes=MIB, machine=machine)
    assert plan.host_blocks == 6144 - 2000 - 1024 and plan.clamped_from_mib == 8192
    assert "using --conversation-cache-mib 3120" in caplog.text


def test_engine_that_cannot_fit_is_refused_naming_the_flags():
    machine = MachineMemory(limit_bytes=2048 * MIB, in_use_bytes=0, source="test")
    with pytest.raises(ValueError, match="--kv-cache-mib.*--conversation-cache-min-free-mib"):
        plan_memory(1500 * MIB, 8192, 1024, block_bytes=MIB, machine=machine)


# -- the running admission: host RAM committed on demand, in segments ---------------------------------------
from scheduler.memory.admission import MemoryAdmission  # noqa: E402
from scheduler.cache.prefix_cache import PrefixCache  # noqa: E402


def _park_two_conversations(admission):
    cache = PrefixCache(num_blocks=2, block_size=4, host_blocks=4, admission=admission)
    for first in (1, 2, 3):  # each needs both device blocks: the previous conversation is parked
        tokens = [first] * 8
        cache.release(tokens, 8, cache.allocate(cache.match(tokens, 7), 8))
        cache.check_integrity()
    return cache


def test_host_tier_commits_a_segment_only_when_a_park_needs_it():
    admission = MemoryAdmission(4, block_bytes=MIB, host_committed_blocks=0, segment_blocks=2)
    cache = _park_two_conversations(admission)
    assert cache.mover.moves == [("grow_host", 2), ("park", 1, 0), ("park", 0, 1),
                                 ("grow_host", 4), ("park", 0, 2), ("park", 1, 3)]  # conv 2 ran in [1, 0]
    assert cache.usage()["host_committed_blocks"] == 4 and cache.usage()["host_used_blocks"] == 4
    assert cache.stats["dropped_blocks"] == 0


def test_refused_host_growth_treats_the_tier_as_full_and_loses_nothing_else():
    room = [3 * MIB]  # the machine has room for 3 blocks: the second segment (4 in all) is refused
    admission = MemoryAdmission(4, block_bytes=MIB, host_committed_blocks=0, segment_blocks=2,
                                machine_room_bytes=lambda: room[0])
    cache = _park_two_conversations(admission)
    snap = cache.usage()
    assert (snap["host_budget_blocks"], snap["host_committed_blocks"], snap["host_used_blocks"]) == (4, 2, 2)
    assert admission.refusals == 2 and cache.stats["dropped_blocks"] == 2  # conversation 1 made room
    assert {b.tokens[0] for b in cache.tiers.blocks("host").values()} == {2}
    assert {b.tokens[0] for b in cache.tiers.blocks("device").values()} == {3}


def test_start_up_plan_becomes_an_on_demand_or_committed_admission():
    machine = MachineMemory(limit_bytes=24000 * MIB, in_use_bytes=1000 * MIB, source="test")
    plan = plan_memory(2000 * MIB, 1024, 1024, block_bytes=MIB, machine=machine)
    on_demand, at_start = create_admission(plan, False, 1024), create_admission(plan, True, 1024)
    assert (on_demand.host_budget_blocks, on_demand.host_committed_blocks, on_demand.segment_blocks) == (1024, 0, 64)
    assert at_start.host_committed_blocks == 1024
