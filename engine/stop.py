"""Stop strings over streamed text: cut at the earliest match, hold back what could still become one."""
from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas; get back the text that is safe to emit and whether a stop string was hit.

    Text that ends with a prefix of some stop string is held back until the next delta decides it, so a
    streamed reply never shows the first half of a stop string.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """Add a text delta; returns the text that can be emitted now (empty once stopped)."""
        if self.stopped:
            return ""
        text = self._pending + delta
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        hold = self._longest_stop_prefix_suffix(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """At the end of generation, release whatever was held back."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
