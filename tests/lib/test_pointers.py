"""Pointers only move forward, with one writer: compare-and-swap writes of ``current.json`` and
a blend's ``manifest.json`` (``tokenmill.storage.versions.swap_pointer``) under a ``flock`` that
is released on errors and dies with a killed holder."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_pairs import blend_values, random_dataset

from tokenmill.atomic import TMP_DIR, write_bytes
from tokenmill.errors import ConflictError
from tokenmill.formats.blend_manifest import read_blend_manifest
from tokenmill.indices.blend_build import build_blend
from tokenmill.storage import versions
from tokenmill.storage.versions import (
    pointer_lock,
    pointer_version,
    read_pointer,
    version_hash,
    write_pointer,
)

ROOT = Path(__file__).resolve().parents[2]


def version_of(n: int) -> str:
    """The version a build of inputs generation ``n`` writes."""
    return version_hash({"inputs": n})


def point(path: Path, n: int, expected: object = versions.UNCHECKED) -> dict:
    v = version_of(n)
    return write_pointer(path, v, f"{v[:16]}/docs_text_document", expected=expected)  # type: ignore[arg-type]


def lock_file(pointer: Path) -> Path:
    return pointer.parent / TMP_DIR / f"{pointer.name}.lock"


def test_a_pointer_moves_only_from_what_the_build_read(tmp_path: Path) -> None:
    pointer = tmp_path / "merged/docs/current.json"
    first = point(pointer, 1, expected=None)
    with pytest.raises(ConflictError) as err:
        point(pointer, 2, expected=None)  # "must not exist", but version 1 is there
    assert err.value.path == str(pointer)
    assert (err.value.expected, err.value.found, err.value.version) == (
        None,
        version_of(1),
        version_of(2),
    )
    assert f"found {version_of(1)}" in str(err.value)
    assert read_pointer(pointer) == first
    second = point(pointer, 2, expected=first)  # a record read at the start
    with pytest.raises(ConflictError):
        point(pointer, 3, expected=version_of(1))  # a version read at the start, now stale
    assert read_pointer(pointer) == second
    # the pointer already names this build's version (an equal build won): nothing to move
    before = pointer.stat().st_mtime_ns, pointer.stat().st_ino
    assert point(pointer, 2, expected=version_of(1)) == second
    assert (pointer.stat().st_mtime_ns, pointer.stat().st_ino) == before
    assert not lock_file(pointer).exists()  # the lock file goes with the lock


def test_a_damaged_pointer_read_as_such_may_be_replaced(tmp_path: Path) -> None:
    pointer = tmp_path / "current.json"
    write_bytes(pointer, b"{not json")
    assert pointer_version(pointer) == ""
    with pytest.raises(ConflictError):
        point(pointer, 1, expected=None)
    point(pointer, 1, expected="")
    assert pointer_version(pointer) == version_of(1)


def refresh(pointer: Path, inputs: Path, rounds: int, seed: int, built: set[str]) -> None:
    """A build, ``rounds`` times: read the pointer, then the inputs (a generation counter),
    "build" for a moment, then move the pointer from what it read."""
    rng = random.Random(seed)
    for _ in range(rounds):
        start = read_pointer(pointer)
        n = int(inputs.read_text())
        built.add(version_of(n))
        threading.Event().wait(rng.random() / 500)
        try:
            point(pointer, n, expected=start)
        except ConflictError as exc:  # superseded: the pointer stays at the winner's
            assert exc.found is not None and exc.found != exc.expected


def test_concurrent_refreshes_never_move_the_pointer_back(tmp_path: Path) -> None:
    pointer, inputs = tmp_path / "merged/docs/current.json", tmp_path / "inputs"
    generations = 400
    index = {version_of(n): n for n in range(generations + 1)}
    write_bytes(inputs, b"0")
    stop, seen, built = threading.Event(), [], set[str]()

    def feed() -> None:
        for n in range(1, generations + 1):
            write_bytes(inputs, str(n).encode())
            threading.Event().wait(0.0002)

    def poll() -> None:
        while not stop.is_set():
            found = pointer_version(pointer)
            if found is not None:
                seen.append(index[found])

    threads = [threading.Thread(target=feed), threading.Thread(target=poll)]
    threads += [
        threading.Thread(target=refresh, args=(pointer, inputs, 60, seed, built))
        for seed in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads[2:]:
        t.join()
    threads[0].join()
    stop.set()
    threads[1].join()
    final = pointer_version(pointer)
    assert final in built
    assert seen and seen == sorted(seen), "a reader saw the pointer go back"


def test_the_lock_is_released_when_the_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pointer = tmp_path / "current.json"
    point(pointer, 1, expected=None)

    def full_disk(path: object, data: bytes) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(versions, "write_bytes", full_disk)
    with pytest.raises(OSError, match="No space"):
        point(pointer, 2, expected=version_of(1))
    monkeypatch.undo()
    assert not lock_file(pointer).exists()
    assert pointer_version(pointer) == version_of(1)
    point(pointer, 2, expected=version_of(1))
    assert pointer_version(pointer) == version_of(2)


def test_a_killed_holder_leaves_a_lock_file_that_does_not_block(tmp_path: Path) -> None:
    pointer = tmp_path / "current.json"
    holder = (
        "import os, signal, sys\n"
        "from tokenmill.storage.versions import pointer_lock\n"
        "with pointer_lock(sys.argv[1]):\n"
        "    print('held', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", holder, str(pointer)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == -signal.SIGKILL and proc.stdout == "held\n"
    left = lock_file(pointer)
    assert left.exists()  # the killed holder could not unlink it
    fd = os.open(left, os.O_RDWR)
    try:  # nobody holds it: a non-blocking lock is granted at once
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    point(pointer, 1, expected=None)
    assert pointer_version(pointer) == version_of(1)
    assert not left.exists()


def test_the_lock_excludes_another_holder(tmp_path: Path) -> None:
    pointer = tmp_path / "current.json"
    with pointer_lock(pointer):
        fd = os.open(lock_file(pointer), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def blend(root: Path, seed: int, **kw: Any) -> dict:
    """The 70/30 blend of docs and code; ``kw``: ``build_blend``'s keywords (e.g. ``expected``)."""
    settings = blend_values(
        weights={"docs": 0.7, "code": 0.3},
        sequence_length=8,
        split_spec="80,10,10",
        seed=seed,
        train_samples=40,
    )
    sets = {"docs": root / "merged/docs_text_document", "code": root / "merged/code_text_document"}
    return build_blend("mix", sets, root / "blends/mix", root / "nanoset", settings, **kw)


@pytest.fixture
def blend_root(tmp_path: Path) -> Path:
    random_dataset(tmp_path / "merged" / "docs_text_document", 120, 1)
    random_dataset(tmp_path / "merged" / "code_text_document", 80, 2, np.int32)
    return tmp_path


def test_a_blend_build_that_lost_the_race_leaves_the_winner_current(blend_root: Path) -> None:
    mpath = blend_root / "blends/mix/manifest.json"
    first = blend(blend_root, 1)
    # This build read the pointer at version 1; meanwhile another build moved it to seed 2.
    winner = blend(blend_root, 2)
    with pytest.raises(ConflictError) as err:
        blend(blend_root, 3, expected=first["version"])
    assert (err.value.expected, err.value.found) == (first["version"], winner["version"])
    assert read_blend_manifest(mpath) == winner
    loser = err.value.version
    assert (blend_root / "blends/mix/versions" / loser[:16] / "manifest.json").is_file()
    # A build that read the winner moves it forward (its version is complete: reused).
    assert blend(blend_root, 3, expected=winner["version"])["version"] == loser
    assert pointer_version(mpath) == loser
