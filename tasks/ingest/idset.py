"""A set of document ids kept on disk, so memory stays bounded however large the corpus.

A Python set of every id grows by ~100 bytes per document (1 GB at 10M documents); this set is a
keyed SQLite table in a temporary file, with a fixed page cache. Membership is exact (the ids
themselves are stored, not hashes), so no unique document is ever mistaken for a duplicate.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from collections.abc import Iterable
from pathlib import Path

CACHE_KIB = 32 * 1024
"""SQLite page cache (KiB): the memory the set may use, whatever its size."""


class IdSet:
    """Exact string-id set in a temporary SQLite file; close() (or ``with``) deletes it."""

    def __init__(self, directory: Path | None = None) -> None:
        fd, name = tempfile.mkstemp(prefix="ids-", suffix=".sqlite", dir=directory)
        os.close(fd)
        self.path = Path(name)
        self.db = sqlite3.connect(self.path, isolation_level=None)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", f"cache_size=-{CACHE_KIB}"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY) WITHOUT ROWID")
        self.db.execute("BEGIN")

    def add(self, key: str) -> bool:
        """Add ``key``; True when it was not in the set yet."""
        return self.db.execute("INSERT OR IGNORE INTO ids VALUES (?)", (key,)).rowcount == 1

    def update(self, keys: Iterable[str]) -> None:
        """Add many keys at once."""
        self.db.executemany("INSERT OR IGNORE INTO ids VALUES (?)", ((k,) for k in keys))

    def __contains__(self, key: object) -> bool:
        query = "SELECT 1 FROM ids WHERE id = ?"
        return self.db.execute(query, (key,)).fetchone() is not None

    def __len__(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM ids").fetchone()[0]

    def close(self) -> None:
        """Drop the file."""
        if self.db is not None:
            self.db.close()
            self.db = None
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> IdSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass
