"""Write-behind: cached blocks reach the disk tier while serving, parents first, newest conversation first,
within their byte budget; a written block spills for free, is skipped by the shutdown flush, and a server
killed with SIGKILL restarts with every conversation it had finished."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from scheduler.block_mover import RecordingMover
from scheduler.cache_persistence import flush_to_disk
from scheduler.prefix_cache import PrefixCache
from scheduler.write_behind import WriteBehind


class SavingMover(RecordingMover):
    """RecordingMover that remembers the order of saves and deletions (digests)."""

    def __init__(self):
        super().__init__()
        self.saved, self.deleted = [], []

    def save(self, node):
        ok = super().save(node)
        if ok:
            self.saved.append(node.digest)
        return ok

    def delete_disk(self, node):
        self.deleted.append(node.digest)
        super().delete_disk(node)


def _cache(num_blocks=8, host_blocks=4, disk_blocks=8):
    mover = SavingMover()
    return PrefixCache(num_blocks=num_blocks, block_size=4, host_blocks=host_blocks, disk_blocks=disk_blocks,
                       mover=mover), mover


def _serve(cache, tokens):
    cache.release(tokens, len(tokens), cache.allocate(cache.match(tokens, len(tokens) - 1), len(tokens)))
    cache.check_integrity()


def _digests(cache, tokens):
    match = cache.match(tokens)
    return [b.digest for b in match.shared]


def test_released_blocks_are_queued_and_written_parents_first_newest_conversation_first():
    cache, mover = _cache()
    older, newer = [1] * 8, [2] * 8
    _serve(cache, older)
    _serve(cache, newer)
    assert len(cache.unsaved) == 4
    wb = WriteBehind(cache, block_bytes=1024, mib_per_s=1)
    assert wb.tick(now=wb.last_tick + 1.0) == 4  # 1 MiB/s for 1 s: room for all four
    assert mover.saved == _digests(cache, newer) + _digests(cache, older)
    assert not cache.unsaved and len(cache._disk_copies) == 4 and cache.disk_free == 4
    cache.check_integrity()


def test_a_tick_writes_only_its_byte_budget_and_at_least_one_block():
    cache, mover = _cache()
    _serve(cache, [3] * 16)
    wb = WriteBehind(cache, block_bytes=2**20, mib_per_s=2)
    assert wb.tick(now=wb.last_tick + 1.0) == 2
    assert wb.tick(now=wb.last_tick + 0.01) == 1  # under one block's worth of time: still one block
    assert len(cache.unsaved) == 1 and mover.saved == _digests(cache, [3] * 16)[:3]
    cache.check_integrity()


def test_a_written_block_spills_without_a_second_write_and_the_flush_skips_it():
    cache, mover = _cache(num_blocks=2, host_blocks=1, disk_blocks=8)
    first = [1] * 8
    _serve(cache, first)
    wb = WriteBehind(cache, block_bytes=1024, mib_per_s=1)
    wb.tick(now=wb.last_tick + 1.0)
    assert len(mover.saved) == 2
    for other in (2, 3):  # push the first conversation down to the disk tier
        _serve(cache, [other] * 8)
    first_blocks = cache.match(first).shared
    assert all(b.on_disk for b in first_blocks)
    assert mover.saved.count(first_blocks[0].digest) == 1  # the spill wrote nothing again
    saved_before = len(mover.saved)
    written = flush_to_disk(cache)
    assert written == len(mover.saved) - saved_before == len(cache.unsaved)
    cache.check_integrity()


def test_a_block_loaded_from_disk_keeps_its_file_as_its_copy():
    cache, mover = _cache(num_blocks=2, host_blocks=1, disk_blocks=8)
    for first in (1, 2, 3):
        _serve(cache, [first] * 8)
    alloc = cache.allocate(cache.match([1] * 8, 7), 8)
    assert alloc.reused_by_tier["disk"] > 0
    loaded = [b for b in cache.match([1] * 8).shared if b.on_device]
    assert loaded and all(b.disk_copy for b in loaded) and not any(d in mover.deleted for d in
                                                                      (b.digest for b in loaded))
    cache.check_integrity()


def test_copies_give_way_when_spills_need_the_disk():
    cache, mover = _cache(num_blocks=2, host_blocks=1, disk_blocks=2)
    _serve(cache, [1] * 8)
    wb = WriteBehind(cache, block_bytes=1024, mib_per_s=1)
    wb.tick(now=wb.last_tick + 1.0)
    assert cache.disk_free == 0 and not wb.has_work
    for other in (2, 3, 4):
        _serve(cache, [other] * 8)
    assert cache.stats["spills"] >= 1
    assert len(cache._on_disk) + len(cache._disk_copies) <= 2
    cache.check_integrity()


def test_a_dropped_block_takes_its_file_with_it():
    cache, mover = _cache(num_blocks=2, host_blocks=0, disk_blocks=2)
    _serve(cache, [1] * 8)
    wb = WriteBehind(cache, block_bytes=1024, mib_per_s=1)
    wb.tick(now=wb.last_tick + 1.0)
    copies = list(cache._disk_copies)
    _serve(cache, [2] * 8)  # no host tier: the first conversation's device blocks are dropped
    assert set(copies) <= set(mover.deleted) and not cache._disk_copies.keys() & set(copies)
    cache.check_integrity()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(model_path: Path, cache_dir: Path, log_path: Path):
    port = _free_port()
    command = [str(Path(sys.executable).with_name("strata")), "serve", "--model", str(model_path), "--port",
               str(port), "--batch", "1", "--ctx-size", "512", "--conversation-cache-mib", "16",
               "--conversation-cache-dir", str(cache_dir), "--log-format", "json"]
    log = open(log_path, "ab")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert process.poll() is None, f"strata serve exited early:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, "no /health after 90 s"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@pytest.mark.slow
def test_after_sigkill_the_restarted_server_reuses_every_finished_conversation(smollm2_path, tmp_path):
    conversations = [f"Conversation {name}: tell me one short fact about {topic}." for name, topic in
                     (("one", "lighthouses"), ("two", "glaciers"))]
    bodies = [{"model": smollm2_path.stem, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
              for text in conversations]
    process, url = _start(smollm2_path, tmp_path / "cache", tmp_path / "server.log")
    try:
        replies = [httpx.post(url + "/v1/chat/completions", json=b, timeout=120).json() for b in bodies]
        assert all("choices" in r for r in replies), replies
        deadline = time.monotonic() + 30  # write-behind: a few ticks of 0.25 s
        while httpx.get(url + "/cache", timeout=5).json().get("disk_unsaved", 1) and time.monotonic() < deadline:
            time.sleep(0.25)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        process, url = _start(smollm2_path, tmp_path / "cache", tmp_path / "server.log")
        for body, reply in zip(bodies, replies):
            turn2 = dict(body, messages=body["messages"] + [reply["choices"][0]["message"],
                                                             {"role": "user", "content": "And another?"}])
            usage = httpx.post(url + "/v1/chat/completions", json=turn2, timeout=120).json()["usage"]
            first_turn = reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]
            # Everything of turn one but its reply's last token (never computed) comes back from disk.
            assert usage["prompt_tokens_details"]["cached_tokens"] == first_turn - 1, usage
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
