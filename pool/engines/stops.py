"""Finding a request's stop strings in its output text as the text grows.

The cost per new character is set by how many distinct lengths the stop
strings have, not by how many there are: with one `str.find` per stop string
per token, a client that sent 400k of them made every token of its engine's
batch scan all 400k (138 s for 64 tokens, and the other model's requests on
that engine waited as long). The gateway bounds their number and length as
well; this keeps the engine's check linear in the text whatever reaches it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """A request's stop strings, grouped by length, with every proper prefix for the held-back tail."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.strings = tuple(stop)
        by_length: dict[int, set[str]] = {}
        prefixes: set[str] = set()
        for s in self.strings:
            by_length.setdefault(len(s), set()).add(s)
            prefixes.update(s[:n] for n in range(1, len(s)))
        self._by_length = sorted((n, frozenset(group)) for n, group in by_length.items())
        self._prefixes = frozenset(prefixes)
        self.longest = max(by_length, default=0)

    def find(self, text: str, start: int) -> int | None:
        """Where the earliest stop string ending after `start` begins in `text`, or None.

        Only the tail from `start - longest + 1` is looked at; each end position
        costs one set lookup per distinct length.
        """
        found: int | None = None
        for end in range(max(start + 1, 1), len(text) + 1):
            for n, group in self._by_length:
                if n > end:
                    break
                at = end - n
                if (found is None or at < found) and text[at:end] in group:
                    found = at
        return found

    def held_back(self, text: str, end: int) -> int:
        """Length of the longest tail of `text[:end]` that a stop string begins with (it may still grow into one)."""
        for n in range(min(self.longest - 1, end), 0, -1):
            if text[end - n : end] in self._prefixes:
                return n
        return 0
