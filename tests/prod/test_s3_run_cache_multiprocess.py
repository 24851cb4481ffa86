"""The run cache under Dagster's multiprocess executor: step processes of one run share it (an
object staged by two steps is downloaded once) and leave it when they end; it is removed by age
when a later run starts on the host."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
from dagster import DagsterInstance, execute_job, reconstructable
from prod_servers import S3

from tokenmill.storage.run_cache import RUN_CACHE_PREFIX

ROOT = Path(__file__).resolve().parents[2]


def test_step_processes_of_a_run_share_its_cache(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3.client.put_object(Bucket=s3.bucket, Key="root/x.txt", Body=b"shared")
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("TM_MP_ROOT", f"s3://{s3.bucket}/root")
    monkeypatch.setenv("TM_MP_WORK", str(work))
    monkeypatch.setenv("TM_MP_OUT", str(out))
    monkeypatch.chdir(ROOT)  # step processes import the job from the repo root
    job = importlib.import_module("tests.prod.run_cache_job").both_job
    stale = work / f"{RUN_CACHE_PREFIX}old-run"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))  # a run that died long ago
    (tmp_path / "home").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        result = execute_job(reconstructable(job), instance=instance)
        assert result.success
        run_id = result.run_id
    (pid1, cache1, ino1), (pid2, cache2, ino2) = (
        (out / name).read_text().split() for name in ("first", "second")
    )
    assert pid1 != pid2 and pid1 != str(os.getpid())  # two step processes
    assert cache1 == cache2 == str(work / f"{RUN_CACHE_PREFIX}{run_id}")
    assert ino1 == ino2  # the second step linked what the first downloaded
    assert not stale.exists()  # removed by age when the run started
    assert Path(cache1).is_dir()  # step processes leave the run's cache to the next run
