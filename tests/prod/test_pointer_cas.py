"""Pointers on S3 (moto_server): a step writes back a pointer it fetched by a conditional PUT
(``If-Match`` its ETag, ``If-None-Match: *`` when there was none), so a step that lost a race
leaves the winner's pointer and raises ConflictError; its immutable files are uploaded."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from prod_servers import S3

from tokenmill.atomic import write_bytes
from tokenmill.errors import ConflictError
from tokenmill.storage import staging as s3_stage
from tokenmill.storage.s3 import shared_client
from tokenmill.storage.versions import read_pointer, version_hash, version_named, write_pointer

POINTER = "merged/docs/current.json"


def version_of(n: int) -> str:
    return version_hash({"inputs": n})


def stage(s3: S3, local: Path) -> s3_stage.S3Stage:
    return s3_stage.S3Stage(shared_client(s3.endpoint), s3.bucket, "root", local)


def build(s3: S3, local: Path, n: int) -> s3_stage.S3Stage:
    """A step: fetch the pointer, write version ``n``'s file and move the pointer (locally)."""
    st = stage(s3, local)
    st.fetch([POINTER])
    previous = read_pointer(local / POINTER)
    v = version_of(n)
    write_bytes(local / f"merged/docs/{v[:16]}/data.bin", str(n).encode())
    write_pointer(local / POINTER, v, f"{v[:16]}/data", expected=previous)
    return st


def remote_version(s3: S3) -> str:
    body = s3.client.get_object(Bucket=s3.bucket, Key=f"root/{POINTER}")["Body"].read()
    return version_named(body)


def test_moto_server_honours_conditional_puts(s3: S3) -> None:
    """The behaviour the CAS relies on, as real S3 documents it: 412 when the condition fails."""
    put = s3.client.put_object
    etag = put(Bucket=s3.bucket, Key="k", Body=b"1", IfNoneMatch="*")["ETag"]
    for condition in ({"IfNoneMatch": "*"}, {"IfMatch": '"0123"'}):
        with pytest.raises(ClientError) as err:
            put(Bucket=s3.bucket, Key="k", Body=b"2", **condition)
        assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert put(Bucket=s3.bucket, Key="k", Body=b"3", IfMatch=etag)["ETag"] != etag
    with pytest.raises(ClientError) as err:
        put(Bucket=s3.bucket, Key="absent", Body=b"1", IfMatch=etag)
    assert err.value.response["Error"]["Code"] == "NoSuchKey"


def test_the_step_that_read_an_older_pointer_loses(s3: S3, tmp_path: Path) -> None:
    build(s3, tmp_path / "first", 1).push()
    assert remote_version(s3) == version_of(1)
    slow = build(s3, tmp_path / "a", 2)  # both read version 1
    fast = build(s3, tmp_path / "b", 3)
    fast.push()
    with pytest.raises(ConflictError) as err:
        slow.push()
    assert err.value.path == f"s3://{s3.bucket}/root/{POINTER}"
    assert (err.value.expected, err.value.found, err.value.version) == (
        version_of(1),
        version_of(3),
        version_of(2),
    )
    assert remote_version(s3) == version_of(3)
    # the loser's immutable version went up before its pointer was refused
    assert f"root/merged/docs/{version_of(2)[:16]}/data.bin" in s3.keys("root/")
    # a step that reads the winner's pointer moves it on
    build(s3, tmp_path / "c", 2).push()
    assert remote_version(s3) == version_of(2)


def test_a_first_pointer_is_created_once(s3: S3, tmp_path: Path) -> None:
    one, two = build(s3, tmp_path / "a", 1), build(s3, tmp_path / "b", 2)  # both saw none
    one.push()
    with pytest.raises(ConflictError) as err:
        two.push()
    assert (err.value.expected, err.value.found) == (None, version_of(1))
    assert remote_version(s3) == version_of(1)


def test_a_loser_that_built_the_same_version_succeeds(s3: S3, tmp_path: Path) -> None:
    build(s3, tmp_path / "first", 1).push()
    one, two = build(s3, tmp_path / "a", 2), build(s3, tmp_path / "b", 2)
    one.push()
    assert POINTER in two.push()  # 412, but the pointer names this version: done
    assert remote_version(s3) == version_of(2)


def test_concurrent_steps_never_move_the_s3_pointer_back(s3: S3, tmp_path: Path) -> None:
    """Steps read the pointer, then the inputs (a generation counter), then push; a reader
    polling the object never sees the generation go down."""
    index = {version_of(n): n for n in range(200)}
    counter = {"n": 0}
    lock = threading.Lock()
    seen: list[int] = []
    stop = threading.Event()

    def step(worker: int) -> None:
        for round_ in range(12):
            st = stage(s3, tmp_path / f"w{worker}-{round_}")
            st.fetch([POINTER])
            previous = read_pointer(st.local / POINTER)
            with lock:
                counter["n"] += 1
                n = counter["n"]
            v = version_of(n)
            write_pointer(st.local / POINTER, v, f"{v[:16]}/data", expected=previous)
            with contextlib.suppress(ConflictError):  # superseded: the winner's stays
                st.push()

    def poll() -> None:
        while not stop.is_set():
            try:
                seen.append(index[remote_version(s3)])
            except ClientError:
                continue  # no pointer yet

    reader = threading.Thread(target=poll)
    workers = [threading.Thread(target=step, args=(w,)) for w in range(4)]
    reader.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    reader.join()
    assert seen and seen == sorted(seen)
    assert index[remote_version(s3)] in range(1, counter["n"] + 1)
