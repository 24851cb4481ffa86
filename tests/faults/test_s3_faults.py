"""S3 faults against a real moto_server behind a faulty loopback proxy (``s3faults.py``): 5xx
answers, dropped and cut connections, the server dying mid-transfer, and SIGKILL of the process
uploading or pulling. Transient faults are ridden out by retries; persistent ones fail cleanly
with the S3 URI in the message; no dataset manifest on S3 ever vouches for files that are not
there; the next run succeeds with the same bytes, and ``pull`` resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _helpers import Capture
from dagster import AssetKey, DagsterInstance
from pipeline_project import MakeRecipe
from prod_servers import S3
from s3faults import FaultProxy, files_under, materialize_shard, s3_tree, step_errors, unvouched

from tokenmill.cli import main
from tokenmill.errors import InputError
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.storage import layout
from tokenmill.storage import s3 as tm_s3
from tokenmill.storage import staging as s3_stage
from tokenmill.storage.pull import PullReport, pull
from tokenmill.storage.s3 import shared_client

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "blends/mix/manifest.json"
TRAIN_INDEX = r"blends/mix/versions/[0-9a-f]{16}/train-dataset_index\.npy$"
DOCS_BIN = r"merged/docs_text_document\.bin$"
BOTO_ATTEMPTS = 1 + tm_s3.MAX_ATTEMPTS  # per request: botocore's first try and its retries
RIDDEN_OUT = BOTO_ATTEMPTS - 1  # failures in a row botocore still rides out
PART = 5 << 20  # S3's smallest multipart part size
PART_2 = r"\.bin\?uploadId=[^&]+&partNumber=2$"  # UploadPart of the second part of a .bin
UPLOADER = """
import sys
from pathlib import Path
from tokenmill.storage import s3
from tokenmill.storage.staging import S3Stage
s3.MULTIPART_BYTES = 5 << 20
endpoint, bucket, prefix, local = sys.argv[1:]
S3Stage(s3.shared_client(endpoint), bucket, prefix, Path(local)).push()
"""

pytestmark = pytest.mark.usefixtures("fast_retries")


def expected_pull(src: Path) -> dict[str, bytes]:
    """What a pull of blend ``mix`` from ``src`` must produce: all but shards and locks."""
    return {
        k: v
        for k, v in files_under(src).items()
        if not k.startswith("tokens/") and not k.endswith(".lock")
    }


def run_in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    """Start ``fn()`` in a thread; the list receives what it raised."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, raised


def wait_for(rule_hit: threading.Event) -> None:
    """Block until the proxy reports the request a rule waits for."""
    assert rule_hit.wait(timeout=60), "the faulty request never came"


@pytest.fixture
def uri(s3: S3, storage_root: Path) -> str:
    """The URI of blend ``mix``'s manifest, ``storage_root`` uploaded under ``v1/``."""
    s3.upload_tree(storage_root, "v1")
    return f"s3://{s3.bucket}/v1/{MANIFEST}"


def pull_again(
    uri: str, dest: Path, proxy: FaultProxy, storage_root: Path, complete: list[str]
) -> PullReport:
    """A pull through ``proxy`` with its faults cleared: it skips the ``complete`` files and
    ends with every file of the blend; its report."""
    proxy.clear()
    report = pull(uri, dest, endpoint_url=proxy.endpoint)
    assert sorted(report.skipped) == complete
    assert files_under(dest) == expected_pull(storage_root)
    return report


# --- tokenmill pull --------------------------------------------------------------------------


def test_pull_rides_out_transient_faults(
    uri: str, storage_root: Path, tmp_path: Path, proxy: FaultProxy
) -> None:
    rules = [
        proxy.add("GET", r"/blends/mix/manifest\.json$", "500", times=3),
        # all but botocore's last attempt fail: its retries alone ride them out
        proxy.add("GET", DOCS_BIN, "503", times=RIDDEN_OUT),
        # a body cut mid-stream (botocore cannot retry it): pull fetches the file again
        proxy.add("GET", r"merged/code_text_document\.bin$", "cut", times=2, keep=100),
        proxy.add("GET", TRAIN_INDEX, "drop", times=RIDDEN_OUT),
    ]
    dest = tmp_path / "dest"
    assert main(["pull", uri, str(dest), "--endpoint-url", proxy.endpoint]) == 0
    assert [r.matched for r in rules] == [3, RIDDEN_OUT, 2, RIDDEN_OUT]
    assert files_under(dest) == expected_pull(storage_root)


def test_pull_persistent_5xx_fails_cleanly_then_resumes(
    uri: str, storage_root: Path, tmp_path: Path, proxy: FaultProxy, capsys: Capture
) -> None:
    rule = proxy.add("GET", DOCS_BIN, "503")
    dest = tmp_path / "dest"
    assert main(["pull", uri, str(dest), "--endpoint-url", proxy.endpoint]) == 1
    err = capsys.readouterr().err
    # botocore's backoff may pass the "waiting for S3" threshold on a loaded machine
    waiting, error = err.rsplit("tokenmill pull: error: ", 1)
    assert all(line.startswith("tokenmill: waiting for S3") for line in waiting.splitlines())
    assert ("tokenmill pull: error: " + error).startswith(
        f"tokenmill pull: error: {uri.removesuffix(MANIFEST)}merged/docs_text_document.bin "
        "(dataset 'docs' bin): An error occurred (ServiceUnavailable) when calling the "
        "GetObject operation (reached max retries: 8): injected by the fault proxy"
    )
    assert "Traceback" not in err
    assert rule.matched == BOTO_ATTEMPTS  # one retry layer: botocore's
    assert not (dest / MANIFEST).exists()
    assert not [p for p in dest.rglob("*") if ".tmp-" in p.name]
    complete = sorted(files_under(dest))
    assert "merged/docs_text_document.bin" not in complete

    # transfers not started were cancelled by the failure; complete ones stay
    report = pull_again(uri, dest, proxy, storage_root, complete)
    assert "merged/docs_text_document.bin" in report.fetched


def test_pull_against_a_dead_server_is_a_clean_error(
    uri: str, tmp_path: Path, proxy: FaultProxy, capsys: Capture
) -> None:
    def error() -> str:
        """The error line, after the "waiting for S3" lines a failed try may print (at most
        one per 10 s per process, so whether one shows depends on the tests before)."""
        waiting, found = capsys.readouterr().err.rsplit("tokenmill pull: error: ", 1)
        assert all(line.startswith("tokenmill: waiting for S3") for line in waiting.splitlines())
        return "tokenmill pull: error: " + found

    proxy.kill()
    assert main(["pull", uri, str(tmp_path / "dest"), "--endpoint-url", proxy.endpoint]) == 1
    assert error().startswith(
        f"tokenmill pull: error: reading {uri}: EndpointConnectionError: Could not connect to "
        f'the endpoint URL: "{proxy.endpoint}/{uri.removeprefix("s3://")}"'
    )
    proxy.add("GET", r"/blends/mix/manifest\.json$", "503")
    proxy.start()
    assert main(["pull", uri, str(tmp_path / "dest"), "--endpoint-url", proxy.endpoint]) == 1
    err = error()
    assert err.startswith(f"tokenmill pull: error: reading {uri}: ClientError: An error occurred ")
    assert "(ServiceUnavailable)" in err and "Traceback" not in err


def test_pull_survives_the_server_dying_mid_transfer(
    uri: str, storage_root: Path, tmp_path: Path, proxy: FaultProxy
) -> None:
    held = proxy.add("GET", DOCS_BIN, "stall", keep=1000)
    dest = tmp_path / "dest"
    thread, raised = run_in_thread(lambda: pull(uri, dest, endpoint_url=proxy.endpoint, jobs=2))
    wait_for(held.hit)
    proxy.kill()
    thread.join(timeout=60)
    assert len(raised) == 1 and isinstance(raised[0], InputError)
    # The last attempt meets either the dead port or the reset of a connection still open.
    assert re.match(
        rf"{re.escape(uri.removesuffix(MANIFEST))}merged/docs_text_document\.bin "
        r"\(dataset 'docs' bin\): "
        r"(Could not connect to the endpoint URL|.*(reset|Connection broken|aborted))",
        str(raised[0]),
    ), raised[0]
    assert not (dest / MANIFEST).exists()
    assert not [p for p in dest.rglob("*") if ".tmp-" in p.name]
    complete = sorted(files_under(dest))

    proxy.start()  # the server is back, same address
    report = pull_again(uri, dest, proxy, storage_root, complete)
    assert "merged/docs_text_document.bin" in report.fetched


def test_sigkilled_pull_reruns_to_identical_bytes(
    uri: str, storage_root: Path, tmp_path: Path, proxy: FaultProxy
) -> None:
    held = proxy.add("GET", DOCS_BIN, "stall", keep=1000)
    dest = tmp_path / "dest"
    command = [sys.executable, "-m", "tokenmill.cli", "pull", uri, str(dest)]
    proc = subprocess.Popen([*command, "--endpoint-url", proxy.endpoint], cwd=ROOT)
    try:
        wait_for(held.hit)
        deadline = time.monotonic() + 30
        while not list(dest.rglob("docs_text_document.bin.partial")):  # mid-write
            assert time.monotonic() < deadline, "the killed pull never opened its temp file"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (dest / MANIFEST).exists()
    complete = sorted(k for k in files_under(dest) if ".tmp-" not in k)
    pull_again(uri, dest, proxy, storage_root, complete)  # the temp file is gone too


# --- the pipeline's uploads ------------------------------------------------------------------


def test_pipeline_run_on_s3_rides_out_transient_faults_and_fails_cleanly_on_persistent_ones(
    s3: S3, make_recipe: MakeRecipe, tmp_path: Path, proxy: FaultProxy
) -> None:
    recipe = make_recipe(
        storage={"root": f"s3://{s3.bucket}/root", "s3_endpoint_url": proxy.endpoint}
    )
    work = tmp_path / "work"
    transient = [
        proxy.add("GET", r"list-type=2&prefix=root%2Fhf", "500", times=RIDDEN_OUT),
        proxy.add("PUT", r"raw/docs/part-00000\.stats\.json$", "drop", times=RIDDEN_OUT),
        # a download cut mid-stream: s3transfer's own retry fetches it again
        proxy.add("GET", r"hf/docs/data/part-00000\.parquet$", "cut", times=2, keep=200),
        proxy.add("PUT", r"tokens/docs/.*\.bin$", "503", times=RIDDEN_OUT),
    ]
    tokens = "root/tokens/docs/part-00000_text_document"
    with DagsterInstance.ephemeral() as instance:
        first = materialize_shard(recipe, instance, endpoint=proxy.endpoint, work=work)
        assert first.success, step_errors(first)
        assert [r.matched for r in transient] == [RIDDEN_OUT, RIDDEN_OUT, 2, RIDDEN_OUT]
        clean = s3_tree(s3, "root/")
        assert layout.dataset_manifest(tokens) in clean and unvouched(clean) == []

        proxy.clear()
        persistent = proxy.add("PUT", r"tokens/docs/.*\.idx$", "503")
        failed = materialize_shard(
            recipe, instance, endpoint=proxy.endpoint, work=work, stages=("tokens",)
        )
        assert not failed.success
        [error] = step_errors(failed)
        assert error.startswith(
            f"tokenmill.errors.InputError: uploading part-00000_text_document.idx to "
            f"s3://{s3.bucket}/{tokens}.idx: S3UploadFailedError: Failed to upload "
        )
        assert re.search(
            r"An error occurred \(ServiceUnavailable\) when calling the PutObject operation"
            r"( \(reached max retries: 8\))?: injected by the fault proxy$",
            error,
        )
        # botocore's retry quota is shared by the process's cached client and may run dry
        # after the faults above; there is no retry layer above botocore's
        assert 1 <= persistent.matched <= BOTO_ATTEMPTS
        after_failure = s3_tree(s3, "root/")
        # the rerun wrote the very bytes S3 holds, so the stored manifest stays (two runs of one
        # shard never take it away) and still tells the truth about the pair beside it
        manifest = layout.dataset_manifest(tokens)
        assert after_failure[manifest] == clean[manifest]
        assert unvouched(after_failure) == []
        assert list(work.iterdir()) == []

        proxy.clear()
        again = materialize_shard(
            recipe, instance, endpoint=proxy.endpoint, work=work, stages=("tokens",)
        )
        assert again.success
        key = AssetKey(["docs", "tokens"])
        assert instance.get_latest_materialization_event(key).run_id == again.run_id
    rerun = s3_tree(s3, "root/")
    assert rerun.keys() == clean.keys() and unvouched(rerun) == []
    for name, data in rerun.items():
        if name.endswith(".manifest.json"):  # inputs name the run's work directory
            old, new = json.loads(clean[name]), json.loads(data)
            assert {**old, "inputs": None} == {**new, "inputs": None}
        else:
            assert data == clean[name], name


def big_dataset(prefix: Path, seed: int, tokens: int) -> None:
    """A uint16 dataset of about ``tokens`` tokens with its manifest."""
    rng = np.random.default_rng(seed)
    lengths = np.full(tokens // 10_000, 10_000)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_documents(rng.integers(0, 50000, int(lengths.sum())), lengths)
    write_dataset_manifest(prefix, kind="merged", inputs=[], config={}, counts={})


@pytest.fixture
def replacement(s3: S3, tmp_path: Path) -> Path:
    """A small old version of ``merged/big_text_document`` on S3 under ``root/``; a local root
    with the new version (a 6 MiB ``.bin``: multipart parts of 5 and 1 MiB) to upload."""
    big_dataset(tmp_path / "old" / "merged" / "big_text_document", seed=1, tokens=50_000)
    s3.upload_tree(tmp_path / "old", "root")
    local = tmp_path / "new"
    big_dataset(local / "merged" / "big_text_document", seed=2, tokens=(6 << 20) // 2)
    return local


def stage(s3: S3, endpoint: str, local: Path) -> s3_stage.S3Stage:
    """The pipeline's S3 stage for ``s3://bucket/root`` over ``local``."""
    return s3_stage.S3Stage(shared_client(endpoint), s3.bucket, "root", local)


def test_multipart_upload_retries_failed_parts(
    s3: S3, replacement: Path, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tm_s3, "MULTIPART_BYTES", PART)
    part = proxy.add("PUT", PART_2, "500", times=RIDDEN_OUT)
    done = proxy.add("POST", r"\.bin\?uploadId=", "503", times=2)
    stage(s3, proxy.endpoint, replacement).push()
    assert (part.matched, done.matched) == (RIDDEN_OUT, 2)
    uploaded = s3_tree(s3, "root/")
    assert uploaded == {f"root/{k}": v for k, v in files_under(replacement).items()}
    head = s3.client.head_object(Bucket=s3.bucket, Key="root/merged/big_text_document.bin")
    assert head["ETag"].strip('"').endswith("-2")  # two parts: a multipart upload


def test_server_dying_mid_multipart_upload(
    s3: S3, replacement: Path, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tm_s3, "MULTIPART_BYTES", PART)
    old = s3_tree(s3, "root/")
    held = proxy.add("PUT", PART_2, "hold")
    thread, raised = run_in_thread(stage(s3, proxy.endpoint, replacement).push)
    wait_for(held.hit)
    proxy.kill()
    thread.join(timeout=60)
    assert len(raised) == 1 and isinstance(raised[0], InputError)
    assert str(raised[0]).startswith(
        f"uploading big_text_document.bin to s3://{s3.bucket}/root/merged/big_text_document.bin: "
        f'EndpointConnectionError: Could not connect to the endpoint URL: "{proxy.endpoint}/'
    )
    after = s3_tree(s3, "root/")
    assert (
        "root/merged/manifests/big_text_document.manifest.json" not in after
        and unvouched(after) == []
    )
    assert after["root/merged/big_text_document.bin"] == old["root/merged/big_text_document.bin"]

    proxy.clear()
    proxy.start()
    stage(s3, proxy.endpoint, replacement).push()
    assert s3_tree(s3, "root/") == {f"root/{k}": v for k, v in files_under(replacement).items()}


@pytest.mark.parametrize(
    "kill_at",
    [PART_2, r"big_text_document\.idx$"],
    ids=["mid-multipart-bin", "between-bin-and-idx"],
)
def test_sigkilled_upload_leaves_no_lying_manifest(
    s3: S3, replacement: Path, proxy: FaultProxy, kill_at: str
) -> None:
    held = proxy.add("PUT", kill_at, "hold")
    args = [proxy.endpoint, s3.bucket, "root", str(replacement)]
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, *args], cwd=ROOT)
    try:
        wait_for(held.hit)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    after = s3_tree(s3, "root/")
    assert (
        "root/merged/manifests/big_text_document.manifest.json" not in after
        and unvouched(after) == []
    )

    proxy.clear()
    stage(s3, proxy.endpoint, replacement).push()
    assert s3_tree(s3, "root/") == {f"root/{k}": v for k, v in files_under(replacement).items()}
