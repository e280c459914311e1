"""The reply memory's file beside the disk tier, so a restart keeps matching conversations through their replies.

The disk tier (--conversation-cache-dir) keeps a conversation's blocks across a restart, but the memory of
which ids the model generated for a reply (api/reply_memory.py) was RAM only: after a restart a prompt that
carried a reply whose text re-encodes differently matched only up to that reply. The journal is one file per
model in the same directory, `replies-<key>.jsonl` (key: the model file's identity, as the disk tier's
directory is keyed; ids of another model never load):

    {"k": prompt key, "s": salt digest, "m": message index, "t": text, "n": text tokens, "d": splits, "i": ids}

one JSON line per reply remembered, appended by a writer thread (write-behind: the event loop only queues the
line). The salt is kept as a digest (it names a tenant's API key). At start the file is read (a line cut by a
crash or otherwise unreadable is skipped and counted), the memory's bound applies as if the replies had
just been remembered in that order, and the file is rewritten with what the memory kept; while serving it is
rewritten the same way when it holds twice the memory's bound in ids.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
from array import array
from pathlib import Path

from api.reply_memory import GeneratedReply

log = logging.getLogger("strata.replies")


def journal_path(directory: str | Path, model_key: bytes) -> Path:
    return Path(directory) / f"replies-{model_key.hex()}.jsonl"


def _line(key: bytes, salt: bytes, reply: GeneratedReply) -> str:
    return json.dumps({"k": key.hex(), "s": salt.hex(), "m": reply.message_index, "t": reply.text,
                       "n": reply.text_tokens, "d": reply.splits_differently, "i": list(reply.token_ids)},
                      ensure_ascii=False) + "\n"


def _parse(line: str) -> tuple[bytes, bytes, GeneratedReply]:
    """One line; ValueError (KeyError, TypeError) on one that is not a whole record."""
    r = json.loads(line)
    ids = array("l", (int(i) for i in r["i"]))
    if not ids or not isinstance(r["t"], str) or not r["t"]:
        raise ValueError("an empty reply")
    return bytes.fromhex(r["k"]), bytes.fromhex(r["s"]), GeneratedReply(r["t"], ids, int(r["m"]), int(r["n"]),
                                                                        bool(r["d"]))


class ReplyJournal:
    """The file of one model's remembered replies (see the module docstring). `append` and `rewrite` are
    called on the event loop and only queue work; `close` writes what is queued and stops the writer."""

    def __init__(self, path: Path):
        self.path = path
        self.skipped = 0  # lines read at start that were not whole records
        self.ids_written = 0  # ids in the file since it was last rewritten
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None

    def read(self) -> list[tuple[bytes, bytes, GeneratedReply]]:
        """The records in the file, oldest first (none when there is no file)."""
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("reply memory: cannot read %s (%s); starting without it", self.path, exc)
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(_parse(line))
            except (ValueError, KeyError, TypeError):
                self.skipped += 1
        return out

    def append(self, key: bytes, salt: bytes, reply: GeneratedReply) -> None:
        self.ids_written += len(reply.token_ids)
        self._put(("append", _line(key, salt, reply)))

    def rewrite(self, records) -> None:
        """Replace the file by these (key, salt digest, reply) records."""
        lines = [_line(*r) for r in records]
        self.ids_written = sum(len(r[2].token_ids) for r in records)
        self._put(("rewrite", lines))

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def _put(self, item) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._run, name="reply-journal", daemon=True)
            self._writer.start()
        self._queue.put(item)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, payload = item
            try:
                if kind == "append":
                    with open(self.path, "a", encoding="utf-8") as f:
                        f.write(payload)
                else:
                    tmp = self.path.with_suffix(".tmp")
                    tmp.write_text("".join(payload), encoding="utf-8")
                    os.replace(tmp, self.path)
            except OSError as exc:  # the memory goes on in RAM; the next restart finds less
                log.warning("reply memory: cannot write %s (%s)", self.path, exc)
