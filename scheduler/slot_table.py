"""The engine's rows and its wait queue: which request runs in which slot and batch group, and who waits.

    slots    [r3][  ][r1][r5]        a request's slot_id is its row; None is a free row
    waiting  r7 r8 r9                FIFO; a preempted request goes back to the head
    by_id    every request not finished yet, running or waiting (abort looks them up here)

Changed only on the event loop, between a group's steps.
"""
from __future__ import annotations

from collections import deque

from scheduler.request import Request


class SlotTable:
    """Slots (rows) of --batch, the wait queue, and the batch group of each running request."""

    def __init__(self, num_slots: int, num_groups: int):
        self.slots: list[Request | None] = [None] * num_slots
        self.waiting: deque[Request] = deque()
        self.by_id: dict[str, Request] = {}
        self.num_groups = num_groups

    @property
    def has_free_slot(self) -> bool:
        return None in self.slots

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def members(self, group: int) -> list[Request]:
        """The group's row map: its running requests, in slot order."""
        return [r for r in self.slots if r is not None and r.group == group]

    def place(self, request: Request) -> None:
        """Give the request the first free row, in the group with the fewest members (so the groups stay
        balanced and every pipeline stage has work). A free row must exist."""
        request.slot_id = self.slots.index(None)
        request.group = min(range(self.num_groups), key=lambda g: (len(self.members(g)), g))
        self.slots[request.slot_id] = request

    def vacate(self, request: Request) -> None:
        """Free the request's row (it stays in by_id until it finishes)."""
        self.slots[request.slot_id] = None
        request.slot_id = None
