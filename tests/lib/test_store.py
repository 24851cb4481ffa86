"""``tokenmill.storage.store``: the one listing/reading/deleting view of a storage root, the same
on a local folder and on ``s3://bucket/prefix`` (used by ``tokenmill gc`` and the pipeline's
``pruned`` step through ``StorageResource.list_keys``/``delete_keys``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenmill.errors import ConfigError
from tokenmill.storage.store import LocalStore, S3Store, open_store

FILES = {
    "tokens/ds/s1_text_document.bin": b"a" * 7,
    "tokens/ds/manifests/s1_text_document.manifest.json": b"{}",
    "tokens/ds2/x.bin": b"b",
    "raw/ds/s1.stats.json": b"{}",
}


def fill(root: Path) -> None:
    for key, data in FILES.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)


def check(store: LocalStore | S3Store) -> None:
    """Listing names a folder's files recursively with sizes and no sibling folder's (``ds`` is
    no prefix match for ``ds2``); delete removes exactly the keys, absent ones are fine."""
    listed = {f.key: f.size for f in store.files("tokens/ds")}
    assert listed == {k: len(v) for k, v in FILES.items() if k.startswith("tokens/ds/")}
    assert list(store.files("nothing/here")) == []
    assert store.read("raw/ds/s1.stats.json") == b"{}"
    assert store.read("raw/ds/missing.json") is None
    store.delete(["tokens/ds/s1_text_document.bin", "tokens/ds/never-there.bin"])
    assert [f.key for f in store.files("tokens/ds")] == [
        "tokens/ds/manifests/s1_text_document.manifest.json"
    ]
    assert [f.key for f in store.files("tokens/ds2")] == ["tokens/ds2/x.bin"]


def test_local_store(tmp_path: Path) -> None:
    fill(tmp_path)
    store = open_store(tmp_path)
    assert isinstance(store, LocalStore)
    check(store)
    store.delete(["tokens/ds/manifests/s1_text_document.manifest.json"])
    assert not (tmp_path / "tokens" / "ds").exists()  # emptied folders go, the root stays
    assert (tmp_path / "tokens" / "ds2").is_dir() and tmp_path.is_dir()


def test_local_root_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        open_store(tmp_path / "missing")


def test_s3_store(s3: Any, tmp_path: Path) -> None:
    fill(tmp_path)
    s3.upload_tree(tmp_path, "root")
    store = open_store(f"s3://{s3.bucket}/root", s3.endpoint)
    assert isinstance(store, S3Store)
    check(store)
    assert s3.keys("root/") == sorted(
        f"root/{k}" for k in FILES if k != "tokens/ds/s1_text_document.bin"
    )
