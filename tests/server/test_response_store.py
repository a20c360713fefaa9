"""The Responses API's store: bounded, oldest first out, and in SQLite across restarts."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from server.responses.store import MemoryStore, SQLiteStore, StoredResponse


def _entry(n: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}", "output": []},
                          [{"role": "user", "content": f"question {n}"}])


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path):
    def make(capacity: int):
        if request.param == "memory":
            return MemoryStore(capacity)
        return SQLiteStore(tmp_path / "store" / "responses.db", capacity)

    return make


def test_keeps_the_newest_up_to_capacity(make_store) -> None:
    store = make_store(3)
    for n in range(5):
        store.put(f"resp_{n}", _entry(n))
    assert len(store) == 3
    assert store.get("resp_0") is None and store.get("resp_1") is None
    assert store.get("resp_4") == _entry(4)
    store.put("resp_2", _entry(2))  # stored again: now the newest
    store.put("resp_5", _entry(5))
    assert store.get("resp_2") == _entry(2) and store.get("resp_3") is None


def test_delete_frees_a_slot(make_store) -> None:
    store = make_store(2)
    store.put("resp_0", _entry(0))
    store.put("resp_1", _entry(1))
    assert store.delete("resp_0") and not store.delete("resp_0")
    store.put("resp_2", _entry(2))
    assert store.get("resp_1") == _entry(1) and store.get("resp_2") == _entry(2)


def test_sqlite_store_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "responses.db"
    store = SQLiteStore(path, 10)
    store.put("resp_0", _entry(0))
    store.close()
    reopened = SQLiteStore(path, 10)
    assert reopened.get("resp_0") == _entry(0)
    reopened.close()


def test_an_entry_stored_before_input_items_were_kept_still_loads(tmp_path: Path) -> None:
    """A database written by an earlier version (no input items in its entries) keeps
    serving them after an upgrade: their input items list is empty."""
    path = tmp_path / "responses.db"
    SQLiteStore(path, 10).close()  # the table
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("INSERT INTO responses (id, data) VALUES (?, ?)", (
            "resp_old", '{"response": {"id": "resp_old"}, "conversation": []}'))
    reopened = SQLiteStore(path, 10)
    assert reopened.get("resp_old") == StoredResponse({"id": "resp_old"}, [], [])
    reopened.put("resp_new", StoredResponse({"id": "resp_new"}, [], [{"id": "msg_1"}]))
    assert reopened.get("resp_new").input_items == [{"id": "msg_1"}]
    reopened.close()


def _with_items(n: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}", "output": [{"id": f"msg_out_{n}", "n": n}]},
                          [], [{"id": f"msg_in_{n}", "n": n}, {"id": "msg_shared", "n": n}])


def test_items_are_found_by_id_while_their_response_is_stored(make_store) -> None:
    """`item_reference`: an input or output item of any stored response, by its id; an id
    two responses share is the newest's; evicted or deleted responses' items are gone."""
    store = make_store(2)
    for n in range(3):
        store.put(f"resp_{n}", _with_items(n))
    assert store.item("msg_in_0") is None and store.item("msg_out_0") is None
    assert store.item("msg_in_1") == {"id": "msg_in_1", "n": 1}
    assert store.item("msg_out_2") == {"id": "msg_out_2", "n": 2}
    assert store.item("msg_shared") == {"id": "msg_shared", "n": 2}
    store.delete("resp_2")
    assert store.item("msg_out_2") is None and store.item("msg_shared") is None
    assert store.item("msg_out_1") == {"id": "msg_out_1", "n": 1}


def test_memory_keeps_its_entries_within_a_budget_of_their_json(monkeypatch) -> None:
    """An agent's session stores its whole history again at every turn: the in-memory
    store keeps its entries' JSON within MEMORY_STORE_CHARS, oldest out, the newest
    always."""
    monkeypatch.setattr("server.responses.store.MEMORY_STORE_CHARS", 500)
    store = MemoryStore(1000)

    def turn(n: int) -> StoredResponse:
        return StoredResponse({"id": f"resp_{n}", "output": []},
                              [{"role": "user", "content": "x" * 100}] * (n + 1))

    for n in range(4):
        store.put(f"resp_{n}", turn(n))
    assert [store.get(f"resp_{n}") is not None for n in range(4)] == [False, False, False, True]
    store.put("resp_3", turn(0))  # stored again, smaller: room for one more
    store.put("resp_4", turn(0))
    assert store.get("resp_3") == turn(0) and store.get("resp_4") == turn(0)
