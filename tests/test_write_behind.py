"""Write-behind: cached blocks reach the disk tier while serving, parents first, newest conversation first,
within their byte budget; a written block spills for free, is skipped by the shutdown flush, and a server
killed with SIGKILL restarts with every conversation it had finished. Hybrid models: each block's state
checkpoints follow it, from the same budget, and move, spill and give way for room with its file."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from scheduler.cache.block_mover import RecordingMover
from scheduler.cache.persistence import flush_to_disk
from scheduler.cache.checkpoint_store import CheckpointStore
from scheduler.cache.checkpoints import Checkpoints
from scheduler.cache.prefix_cache import PrefixCache
from scheduler.cache.write_behind import WriteBehind
from tests.support.cache_requests import serve_request


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


def _digests(cache, tokens):
    match = cache.match(tokens)
    return [b.digest for b in match.shared]


def test_released_blocks_are_queued_and_written_parents_first_newest_conversation_first():
    cache, mover = _cache()
    older, newer = [1] * 8, [2] * 8
    serve_request(cache, older)
    serve_request(cache, newer)
    assert len(cache.unsaved) == 4
    wb = WriteBehind(cache, block_bytes=1024, mib_per_s=1)
    assert wb.tick(now=wb.last_tick + 1.0) == 4  # 1 MiB/s for 1 s: room for all four
    assert mover.saved == _digests(cache, newer) + _digests(cache, older)
    assert not cache.unsaved and len(cache.tiers.blocks("copies")) == 4 and cache.disk_free == 4
    cache.check_integrity()


def test_a_tick_writes_only_its_byte_budget_and_at_least_one_block():
    cache, mover = _cache()
    serve_request(cache, [3] * 16)
    wb = WriteBehind(cache, block_bytes=2**20, mib_per_s=2)
    assert wb.tick(now=wb.last_tick + 1.0) == 2
    assert wb.tick(now=wb.last_tick + 0.01) == 1  # under one block's worth of time: still one block
    assert len(cache.unsaved) == 1 and mover.saved == _digests(cache, [3] * 16)[:3]
    cache.check_integrity()


def test_a_written_block_spills_without_a_second_write_and_the_flush_skips_it():
    cache, mover = _cache(num_blocks=2, host_blocks=1, disk_blocks=8)
    first = [1] * 8
    serve_request(cache, first)
    wb = WriteBehind(cache, block_bytes=1024, mib_per_s=1)
    wb.tick(now=wb.last_tick + 1.0)
    assert len(mover.saved) == 2
    for other in (2, 3):  # push the first conversation down to the disk tier
        serve_request(cache, [other] * 8)
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
        serve_request(cache, [first] * 8)
    alloc = cache.allocate(cache.match([1] * 8, 7), 8)
    assert alloc.reused_by_tier["disk"] > 0
    loaded = [b for b in cache.match([1] * 8).shared if b.on_device]
    assert loaded and all(b.disk_copy for b in loaded) and not any(d in mover.deleted for d in
                                                                      (b.digest for b in loaded))
    cache.check_integrity()


def test_copies_give_way_when_spills_need_the_disk():
    cache, mover = _cache(num_blocks=2, host_blocks=1, disk_blocks=2)
    serve_request(cache, [1] * 8)
    wb = WriteBehind(cache, block_bytes=1024, mib_per_s=1)
    wb.tick(now=wb.last_tick + 1.0)
    assert cache.disk_free == 0 and not wb.has_work
    for other in (2, 3, 4):
        serve_request(cache, [other] * 8)
    assert cache.stats["spills"] >= 1
    assert len(cache.tiers.blocks("disk")) + len(cache.tiers.blocks("copies")) <= 2
    cache.check_integrity()


def test_a_dropped_block_takes_its_file_with_it():
    cache, mover = _cache(num_blocks=2, host_blocks=0, disk_blocks=2)
    serve_request(cache, [1] * 8)
    wb = WriteBehind(cache, block_bytes=1024, mib_per_s=1)
    wb.tick(now=wb.last_tick + 1.0)
    copies = list(cache.tiers.blocks("copies"))
    serve_request(cache, [2] * 8)  # no host tier: the first conversation's device blocks are dropped
    assert set(copies) <= set(mover.deleted) and not cache.tiers.blocks("copies").keys() & set(copies)
    cache.check_integrity()


SHAPE = (1, 1, 2)  # a checkpoint's state: 8 bytes


def _hybrid_cache(tmp_path, num_blocks=8, host_blocks=4, disk_blocks=12):
    """A hybrid model's cache: each checkpoint one slot of its tier, its files in tmp_path; every write
    (block or checkpoint) is logged in order in mover.saved."""
    store = CheckpointStore(SHAPE, tmp_path, b"k")
    cache = PrefixCache(num_blocks=num_blocks, block_size=4, host_blocks=host_blocks, disk_blocks=disk_blocks,
                        mover=SavingMover(), checkpoints=Checkpoints(1, every_blocks=0, store=store))
    write_file = store.write_file

    def logged_write(key, state, index=True):
        ok = write_file(key, state, index)
        if ok:
            cache.mover.saved.append(key)
        return ok

    store.write_file = logged_write
    return cache, cache.mover, store


def test_checkpoints_are_written_after_their_block_from_the_same_budget(tmp_path):
    cache, mover, store = _hybrid_cache(tmp_path)
    older, newer = [1] * 8, [2] * 6
    serve_request(cache, older, checkpoint=True)
    serve_request(cache, newer, checkpoint=True)
    tips = [cache.match(t).shared[-1] if len(t) % 4 == 0 else cache.match(t).cow_source for t in (older, newer)]
    assert len(cache.ckpt.unsaved) == 2 and cache.usage()["checkpoints_unsaved"] == 2
    wb = WriteBehind(cache, block_bytes=1000, mib_per_s=1)
    assert wb.tick(now=wb.last_tick + 2100 / 2**20) == 3  # 2100 bytes: two blocks and a state, not a third
    newest = cache.match(newer).shared[0]
    # the newest conversation first, parents first, its state (after the partial tip's 2 tokens) last
    assert mover.saved == [newest.digest, tips[1].digest, (tips[1].digest, 2)]
    assert wb.tick(now=wb.last_tick + 1.0) == 3
    assert mover.saved[3:] == _digests(cache, older) + [(tips[0].digest, 4)]
    assert store.copies == {(tips[1].digest, 2), (tips[0].digest, 4)} and not cache.ckpt.unsaved
    assert cache.disk_free == 12 - 4 - 2 and cache.usage()["checkpoints_disk_copies"] == 2
    assert wb.written_blocks == 4 and wb.written_checkpoints == 2 and not wb.has_work
    assert (tmp_path / f"{tips[0].digest.hex()}.4.state").exists()
    cache.check_integrity()


def test_a_checkpoint_taken_on_a_block_written_already_is_written_next(tmp_path):
    cache, mover, store = _hybrid_cache(tmp_path)
    tokens = [3] * 8
    serve_request(cache, tokens[:4] + [9], checkpoint=True)  # block [3]*4 written with no checkpoint of its own
    wb = WriteBehind(cache, block_bytes=1000, mib_per_s=1)
    wb.tick(now=wb.last_tick + 1.0)
    head = cache.tree.root("").children[tuple(tokens[:4])]
    assert head.disk_copy and not head.checkpoints
    match = cache.match(tokens, 4)
    assert match.num_tokens == 0  # no state after the head: computed again, it finds its block cached
    alloc = cache.apply(cache.plan_allocate(match, 4, checkpoints=1))
    cache.apply(cache.plan_release(tokens[:4], 4, alloc, final_state=np.zeros(SHAPE, np.float32)))
    assert head.checkpoints == {4} and list(cache.ckpt.unsaved.values()) == [head]
    saved = len(mover.saved)
    assert wb.tick(now=wb.last_tick + 1.0) == 1 and mover.saved[saved:] == [(head.digest, 4)]
    cache.check_integrity()


def test_a_written_checkpoint_spills_and_loads_without_a_write_and_its_file_stays_as_the_copy(tmp_path):
    cache, mover, store = _hybrid_cache(tmp_path, num_blocks=4, host_blocks=3)
    first = [1] * 8
    serve_request(cache, first, checkpoint=True)
    wb = WriteBehind(cache, block_bytes=1000, mib_per_s=1)
    wb.tick(now=wb.last_tick + 1.0)
    tip = cache.match(first).shared[-1]
    key = (tip.digest, 4)
    for other in (2, 3, 4):  # push the first conversation down to the disk tier
        serve_request(cache, [other] * 8, checkpoint=True)
    assert tip.on_disk and key in store.on_disk and mover.saved.count(key) == 1  # the spill wrote nothing
    match = cache.match(first + [5], 8)
    assert match.num_tokens == 8 and match.checkpoint == (tip, 4)
    cache.apply(cache.plan_allocate(match, 9))  # back to the device, with its state
    assert tip.on_device and tip.disk_copy and key in store.copies and key not in cache.ckpt.store.on_disk
    assert mover.saved.count(key) == 1 and (tmp_path / f"{tip.digest.hex()}.4.state").exists()
    cache.check_integrity()


def test_a_block_copy_deleted_for_room_takes_its_checkpoint_copies_and_both_are_queued_again(tmp_path):
    cache, mover, store = _hybrid_cache(tmp_path, num_blocks=4, host_blocks=3, disk_blocks=3)
    one, two = [1] * 8, [2] * 8
    serve_request(cache, one, checkpoint=True)
    serve_request(cache, two, checkpoint=True)  # the first conversation's tip (and its state) parked
    wb = WriteBehind(cache, block_bytes=1000, mib_per_s=1)
    wb.tick(now=wb.last_tick + 1.0)
    head, tip = cache.match(two).shared
    assert head.disk_copy and tip.disk_copy and (tip.digest, 4) in store.copies and cache.disk_free == 0
    # the first tip, never written, spills: the second's copies make room
    serve_request(cache, [3] * 8, checkpoint=True)
    assert cache.stats["spills"] == 1 and mover.deleted == [head.digest, tip.digest]
    assert tip.on_host and not tip.disk_copy and tip.checkpoints == {4} and not store.copies
    assert not (tmp_path / f"{tip.digest.hex()}.4.state").exists()
    assert id(tip) in cache.unsaved and id(tip) in cache.ckpt.unsaved  # both written again later
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
    # The `strata` script imports the installed package; PYTHONPATH makes it this checkout's code.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
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


OUTPUT_TEXT = "0123456789ABCDEF"  # tiny lfm2's replies: tokens whose text re-encodes to themselves


@pytest.fixture(params=["smollm2", "tiny-lfm2"])
def served_model(request, tmp_path):
    """The model file a SIGKILL test serves: the real SmolLM2 (K/V only) or a tiny hybrid lfm2 (K/V and
    recurrent-state checkpoints)."""
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_path")
    from tests.support.tiny_gguf import tiny_vocab
    from tests.support.tiny_lfm2 import write_tiny_lfm2

    tokens = tiny_vocab()[0]
    path = tmp_path / "tiny-lfm2.gguf"
    write_tiny_lfm2(path, seed=5, n_ctx=1024, output_ids=[tokens.index(c) for c in OUTPUT_TEXT])
    return path


def _all_written(url) -> bool:
    cache = httpx.get(url + "/cache", timeout=5).json()
    return cache.get("disk_unsaved", 1) == 0 and cache.get("checkpoints_unsaved", 0) == 0


@pytest.mark.slow
def test_after_sigkill_the_restarted_server_reuses_every_finished_conversation(served_model, tmp_path):
    """Hybrid models too: each finished turn's last checkpoint (its reply's end) was written behind with its
    blocks, so the next turn reuses all of it, not only up to a checkpoint that happened to be spilled."""
    conversations = [f"Conversation {name}: tell me one short fact about {topic}." for name, topic in
                     (("one", "lighthouses"), ("two", "glaciers"))]
    bodies = [{"model": served_model.stem, "messages": [{"role": "user", "content": text}], "max_tokens": 8,
               "temperature": 0} for text in conversations]
    process, url = _start(served_model, tmp_path / "cache", tmp_path / "server.log")
    try:
        replies = [httpx.post(url + "/v1/chat/completions", json=b, timeout=120).json() for b in bodies]
        assert all("choices" in r for r in replies), replies
        deadline = time.monotonic() + 30  # write-behind: a few ticks of 0.25 s
        while not _all_written(url) and time.monotonic() < deadline:
            time.sleep(0.25)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        process, url = _start(served_model, tmp_path / "cache", tmp_path / "server.log")
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
