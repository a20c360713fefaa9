"""Stored Responses API responses, for `previous_response_id`, GET/DELETE by id, the
listing of a response's input items, and `item_reference` input items (an item of a
stored response, input or output, by its id).

Each entry keeps the response as sent (for GET) and the whole conversation it ended
(for a follow-up, which then sends only its new input). The store is bounded by a count:
past `capacity`, the oldest entries go. In memory by default; in SQLite (the standard
library's embedded database, one file, no server) when a path is configured, so stored
responses survive a restart.

Calls block (SQLite writes to disk), so the routes run them in a worker thread; a lock
makes every call atomic.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as JSON
    conversation: list[dict[str, Any]]  # chat messages, the response's output included
    # The request's input as Response items, ids included (GET .../input_items); an entry
    # stored before these were kept has none.
    input_items: list[dict[str, Any]] = field(default_factory=list)

    def items(self) -> list[dict[str, Any]]:
        """Every item an `item_reference` may name: the input's, then the output's."""
        return [item for item in self.input_items + self.response.get("output", [])
                if isinstance(item.get("id"), str)]

    def item(self, item_id: str) -> dict[str, Any] | None:
        return next((item for item in reversed(self.items()) if item.get("id") == item_id),
                    None)


# Each entry keeps the whole conversation it ended, so an agent's session stores its
# history again at every turn (a thousand turns of a 300 kB conversation: 300 MB). The
# in-memory store also keeps its entries' JSON within this many characters, oldest out.
MEMORY_STORE_CHARS = 256 * 2**20


class MemoryStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, str] = OrderedDict()
        self._chars = 0  # of the entries' JSON
        self._holders: dict[str, str] = {}  # an item's id: the response that has it
        self._item_ids: dict[str, list[str]] = {}  # a response's items', for `_drop`
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        data = _dump(entry)
        item_ids = [item["id"] for item in entry.items()]
        with self._lock:
            self._chars += len(data) - len(self._entries.get(response_id, ""))
            self._entries[response_id] = data
            self._entries.move_to_end(response_id)
            self._holders.update((item_id, response_id) for item_id in item_ids)
            self._item_ids[response_id] = item_ids
            while len(self._entries) > 1 and (len(self._entries) > self.capacity
                                              or self._chars > MEMORY_STORE_CHARS):
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            data = self._entries.get(response_id)
        return None if data is None else _load(data)

    def item(self, item_id: str) -> dict[str, Any] | None:
        with self._lock:
            data = self._entries.get(self._holders.get(item_id, ""))
        return None if data is None else _load(data).item(item_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            if response_id not in self._entries:
                return False
            self._drop(response_id)
            return True

    def _drop(self, response_id: str) -> None:
        self._chars -= len(self._entries.pop(response_id))
        for item_id in self._item_ids.pop(response_id):
            if self._holders.get(item_id) == response_id:
                del self._holders[item_id]

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        pass


class SQLiteStore:
    def __init__(self, path: Path, capacity: int) -> None:
        self.capacity = capacity
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            # `seq` orders entries by insertion, so the oldest go first.
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses ("
                "seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, "
                "data TEXT NOT NULL)"
            )
            # An item's id: the response that has it (an earlier store has no such table:
            # its responses' items are not found by id, as before).
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS items (id TEXT PRIMARY KEY, response TEXT NOT NULL)")

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO responses (id, data) VALUES (?, ?)",
                (response_id, _dump(entry)),
            )
            self._db.executemany("INSERT OR REPLACE INTO items (id, response) VALUES (?, ?)",
                                 [(item["id"], response_id) for item in entry.items()])
            self._db.execute(
                "DELETE FROM responses WHERE seq NOT IN "
                "(SELECT seq FROM responses ORDER BY seq DESC LIMIT ?)", (self.capacity,),
            )
            self._drop_orphans()

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT data FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        return None if row is None else _load(row[0])

    def item(self, item_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT data FROM responses JOIN items ON items.response = responses.id "
                "WHERE items.id = ?", (item_id,)
            ).fetchone()
        return None if row is None else _load(row[0]).item(item_id)

    def delete(self, response_id: str) -> bool:
        with self._lock, self._db:
            self._db.execute("BEGIN")
            cursor = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            self._drop_orphans()
        return cursor.rowcount > 0

    def _drop_orphans(self) -> None:
        self._db.execute("DELETE FROM items WHERE response NOT IN (SELECT id FROM responses)")

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


ResponseStore = MemoryStore | SQLiteStore


def open_store(path: Path | None, capacity: int) -> ResponseStore:
    return MemoryStore(capacity) if path is None else SQLiteStore(path, capacity)


def _dump(entry: StoredResponse) -> str:
    return json.dumps(asdict(entry))


def _load(data: str) -> StoredResponse:
    return StoredResponse(**json.loads(data))
