"""``open_blend("s3://...")`` through a faulty S3 endpoint: 5xx answers, dropped and cut
connections mid-epoch give either the exact samples or an error naming
the object; never a wrong sample."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
from prod_servers import S3
from s3faults import FaultProxy
from servers import build_stream_root

import tokenmill.formats.dataset_manifest as dataset_manifest
from tokenmill.errors import InputError
from tokenmill.loader import BatchSampler, BlendedDataset, _s3, open_blend

pytestmark = pytest.mark.usefixtures("fast_retries")
CODE_BIN = r"/v1/merged/code\.bin"


@pytest.fixture
def train(
    s3: S3, tmp_path: Path, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> tuple[BlendedDataset, BlendedDataset]:
    """(local, streamed) train split of blend ``mix`` with 512-byte blocks; the stream reads
    through the proxy (``AWS_ENDPOINT_URL``)."""
    monkeypatch.setattr(dataset_manifest, "BLOCK_BYTES", 512)
    monkeypatch.setattr(_s3, "_CACHES", {})
    local = build_stream_root(tmp_path / "src", "megatron")
    s3.upload_tree(tmp_path / "src", "v1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    uri = f"s3://{s3.bucket}/v1/blends/mix/manifest.json"
    return open_blend(local, "train"), open_blend(uri, "train", cache_dir=tmp_path / "cache")


def test_transient_faults_mid_read_are_ridden_out(
    train: tuple[BlendedDataset, BlendedDataset], proxy: FaultProxy
) -> None:
    local, remote = train
    rules = [
        proxy.add("GET", CODE_BIN, "503", times=2),  # botocore's retries
        proxy.add("GET", CODE_BIN, "drop", times=2),  # connection reset: botocore's retries
        proxy.add("GET", CODE_BIN, "cut", times=1, keep=100),  # body cut: read again
    ]
    for indices in BatchSampler(len(local), global_batch_size=16):
        np.testing.assert_array_equal(remote.get_batch(indices), local.get_batch(indices))
    assert [r.matched for r in rules] == [2, 2, 1]


def test_persistent_5xx_names_the_object_and_the_job_carries_on_once_it_ends(
    train: tuple[BlendedDataset, BlendedDataset], proxy: FaultProxy
) -> None:
    local, remote = train
    batches = list(BatchSampler(len(local), global_batch_size=16))
    np.testing.assert_array_equal(remote.get_batch(batches[0]), local.get_batch(batches[0]))
    proxy.add("GET", r"\.bin$", "500")  # every attempt answered 500: botocore gives up
    with pytest.raises(InputError, match=r"reading block \d+ .* of s3://.*\.bin"):
        remote.get_batch(np.arange(len(remote)))
    proxy.clear()  # back to normal: the same job reads on, every sample exact
    for indices in batches:
        np.testing.assert_array_equal(remote.get_batch(indices), local.get_batch(indices))


def test_a_server_restart_mid_epoch_stops_the_read_naming_the_object_then_reads_on(
    train: tuple[BlendedDataset, BlendedDataset], proxy: FaultProxy
) -> None:
    """The S3 server dies while a block's body is being read (open connections reset, the
    port refusing): that read fails naming the object, never with a wrong sample; once the
    server is back on its port the same job reads every sample exactly."""
    local, remote = train
    batches = list(BatchSampler(len(local), global_batch_size=16))
    np.testing.assert_array_equal(remote.get_batch(batches[0]), local.get_batch(batches[0]))
    stall = proxy.add("GET", CODE_BIN, "stall", keep=100)
    failed: list[BaseException] = []

    def read_everything() -> None:
        try:
            remote.get_batch(np.arange(len(remote)))
        except BaseException as exc:  # handed to the test thread
            failed.append(exc)

    reader = threading.Thread(target=read_everything)
    reader.start()
    assert stall.hit.wait(60)  # a block's body half sent
    proxy.kill()
    reader.join(120)
    assert not reader.is_alive()
    assert len(failed) == 1 and isinstance(failed[0], InputError), failed
    assert re.search(r"of s3://\S+/v1/merged/code\.bin", str(failed[0])), failed[0]
    proxy.clear()
    proxy.start()
    for indices in batches:
        np.testing.assert_array_equal(remote.get_batch(indices), local.get_batch(indices))
