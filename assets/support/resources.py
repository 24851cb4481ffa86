"""Resources: where artifacts live (``StorageResource``) and the tokenizer (``TokenizerResource``).

Assets resolve every path through ``StorageResource``, which spells keys only through
``tokenmill.storage.layout`` (the one place the storage layout is written down). Steps work inside
``with storage.workspace(inputs) as ws:`` and resolve paths through ``ws.storage``: for a local
root that is the root itself; for an ``s3://bucket/prefix`` root it is a fresh local work
directory with the same layout, filled with the inputs before the step and uploaded (in
``tokenmill.storage.publish`` commit order) after it succeeds, and removed on exit, also on failure.

Inputs are exact: ``dir/`` is a folder (recursively), any other path is that file and its
``path.*`` siblings, so ``P`` stages a dataset's ``.bin`` and ``.idx``,
``layout.dataset_files(P)`` adds its manifest from ``manifests/``, and ``P.idx`` plus
``layout.dataset_manifest(P)`` stage just the index and manifest (a check that reads no
tokens never downloads a ``.bin``).

Within one run an object is downloaded at most once per host: the resource learns the run id
when Dagster sets it up (``setup_for_execution``) and every workspace of the run fetches
through ``<work_dir>/tokenmill-run-<run id>/`` (``tokenmill.storage.staging.RunCache``: entries
keyed by ETag and size, hard-linked into work directories). The in-process executor removes the
cache when the run ends (``teardown_after_execution``); step processes of the multiprocess executor
share it and leave it, and any run cache unused for ``run_cache_hours`` is removed by the next
run that starts on the host.
"""

from __future__ import annotations

import contextlib
import contextvars
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dagster import ConfigurableResource, InitResourceContext
from pydantic import PrivateAttr

from assets.support.partitions import check_partition_key
from assets.support.sources import ShardFile
from tokenmill.errors import ConfigError
from tokenmill.storage import layout
from tokenmill.storage.run_cache import RunCache
from tokenmill.storage.s3 import shared_client
from tokenmill.storage.staging import S3Stage, fetch_shard
from tokenmill.storage.store import Store, open_store
from tokenmill.storage.versions import read_pointer
from tokenmill.tokenize.tokenizer import TokenizerInfo, inspect_tokenizer

# Work directories of the steps running now and the S3 root each stands for (for metadata).
_STAGED: contextvars.ContextVar[tuple[tuple[Path, str], ...]] = contextvars.ContextVar(
    "tokenmill_staged", default=()
)


def display_path(path: str | os.PathLike[str]) -> str:
    """Where an artifact really lives: a path in a work directory as its ``s3://`` URI, any
    other path absolute."""
    resolved = Path(path).resolve()
    for local, uri in _STAGED.get():
        if resolved == local or local in resolved.parents:
            return f"{uri}/{resolved.relative_to(local).as_posix()}".rstrip("/")
    return str(resolved)


@dataclass(frozen=True)
class Workspace:
    """What a step works with: ``storage`` (paths to read and write) and its source shards."""

    storage: StorageResource
    stage: S3Stage | None  # None for a local root
    scratch: Path  # the step's own directory, removed with the workspace

    def shard(self, shard: ShardFile) -> ShardFile:
        """The shard as a local file: an S3 shard is downloaded into the work directory."""
        if shard.path is not None:
            return shard
        client = self.stage.client if self.stage else shared_client(self.storage.s3_endpoint_url)
        path = self.scratch / "sources" / shard.uri.rsplit("/", 1)[-1]
        cache = self.stage.cache if self.stage else None
        fetch_shard(client, cache, shard.uri, shard.fingerprint, path)
        return ShardFile(shard.key, path, shard.fingerprint, shard.uri)

    def fetch_index_entry(self, paths: Mapping[str, Path]) -> bool:
        """The ``fetch`` hook of ``tokenmill.indices.nanoset.build_or_load`` (and of builders that
        pass it on): bring an index-cache entry's files (``paths``, its ``cache_paths`` in this
        workspace) from S3 (``S3Stage.fetch_entry``); True if it did. Nothing for a local root
        (the cache is the root's)."""
        if self.stage is None:
            return False
        return self.stage.fetch_entry({name: self.stage.rel(p) for name, p in paths.items()})

    def stored_index_entry(
        self, paths: Mapping[str, Path], key: dict[str, Any], digest: str
    ) -> dict[str, Any] | None:
        """The description of an index-cache entry stored on S3 (``paths``: its ``cache_paths``
        in this workspace; ``key``, ``digest``: ``tokenmill.indices.nanoset.entry_key``) when it
        is complete (``S3Stage.stored_entry``); always None for a local root."""
        if self.stage is None:
            return None
        rels = {name: self.stage.rel(p) for name, p in paths.items()}
        return self.stage.stored_entry(rels, key, digest)

    def fetch(self, inputs: Sequence[str]) -> None:
        """Stage more inputs once the step knows it needs them (same forms as ``workspace``);
        nothing to do for a local root."""
        if self.stage is not None:
            self.stage.fetch(list(inputs))

    def fetch_paths(self, paths: Sequence[Path]) -> None:
        """:meth:`fetch` by local paths in the stage (the library's ``fetch`` hooks)."""
        if self.stage is not None:
            self.stage.fetch([self.stage.rel(p) for p in paths])

    def fetch_index(self, rel: str) -> None:
        """Stage what reading a dataset's sequence lengths needs (``S3Stage.fetch_index``);
        nothing to do for a local root."""
        if self.stage is not None:
            self.stage.fetch_index(rel)

    def blend_manifest(self, blend: str) -> Path:
        """A blend's local ``manifest.json``: on S3, pulled with every file it names (verified)."""
        local = self.storage.blend_dir(blend) / "manifest.json"
        if self.stage is None:
            return local
        from tokenmill.storage.pull import pull

        uri = self.stage.uri(layout.blend_manifest(blend))
        return pull(uri, self.stage.local, endpoint_url=self.storage.s3_endpoint_url).manifest


class StorageResource(ConfigurableResource):
    """The storage root (local directory or ``s3://bucket/prefix``) and the artifact layout.

    ``work_dir`` is where S3 steps make their local work directories and the run's download
    cache (default: the system's temporary directory); ``run_cache_hours`` is how long an
    abandoned run cache may stay there (0: no run cache, every step downloads its inputs).
    Credentials never appear here, they come from the environment.
    """

    root: str
    s3_endpoint_url: str | None = None
    work_dir: str | None = None
    run_cache_hours: float = 6.0
    _run_cache: RunCache | None = PrivateAttr(default=None)
    _owns_run_cache: bool = PrivateAttr(default=False)

    def setup_for_execution(self, context: InitResourceContext) -> None:
        """Open the run's download cache (S3 roots): Dagster calls this once per process of
        the run, with the run id."""
        run = context.run  # None when the resource is built outside a run
        if self.is_s3 and run is not None and self.run_cache_hours > 0:
            base = Path(self.work_dir or tempfile.gettempdir())
            self._run_cache = RunCache.open(base, run.run_id, self.run_cache_hours)
            # A step process of the multiprocess executor is a child: the run goes on after it.
            self._owns_run_cache = multiprocessing.parent_process() is None

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        """Remove the run cache when this process ran the whole run (in-process executor)."""
        if self._run_cache is not None and self._owns_run_cache:
            self._run_cache.remove()
        self._run_cache = None

    @property
    def is_s3(self) -> bool:
        """True for an ``s3://`` root."""
        return self.root.startswith("s3://")

    def local_root(self) -> Path:
        """The root as a local directory; ConfigError for an S3 root (use ``workspace``)."""
        if self.is_s3:
            raise ConfigError(
                f"storage.root {self.root}: an S3 root has no local directory; steps reach it "
                "through StorageResource.workspace()"
            )
        return Path(self.root)

    @contextlib.contextmanager
    def workspace(self, inputs: Sequence[str] = (), *, upload: bool = True) -> Iterator[Workspace]:
        """A step's view of storage. ``inputs`` are paths relative to the root (``dir/`` for a
        folder, a dataset prefix for its files) fetched first for an S3 root; with ``upload``,
        what the step wrote is uploaded when it succeeds. The work directory is always removed.
        """
        if self.work_dir is not None:
            Path(self.work_dir).mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="tokenmill-work-", dir=self.work_dir))
        try:
            if not self.is_s3:
                yield Workspace(self, None, scratch)
                return
            local = scratch / "root"
            local.mkdir()
            cache = self._run_cache
            if cache is not None:
                cache.touch()
            stage = S3Stage.open(self.root, self.s3_endpoint_url, local, cache)
            stage.fetch(list(inputs))
            token = _STAGED.set((*_STAGED.get(), (local.resolve(), stage.uri("").rstrip("/"))))
            try:
                yield Workspace(
                    StorageResource(root=str(local), s3_endpoint_url=self.s3_endpoint_url),
                    stage,
                    scratch,
                )
                if upload:
                    stage.push()
            finally:
                _STAGED.reset(token)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def list_keys(self, folders: Sequence[str]) -> list[str]:
        """Every file under the ``folders``, as keys relative to the root, by listing names
        only (``tokenmill.storage.store``, as ``tokenmill gc`` lists): nothing is read."""
        store = self._store()
        return sorted(f.key for folder in folders for f in store.files(folder.rstrip("/")))

    def exists(self, key: str) -> bool:
        """True when the file ``key`` (relative to the root) is there now; on S3 one HEAD."""
        return self._store().exists(key)

    def delete_keys(self, keys: Sequence[str]) -> None:
        """Remove files by key (absent ones are fine), locally or on S3."""
        self._store().delete(keys)

    def _store(self) -> Store:
        """The root as a ``tokenmill.storage.store`` view (on S3 through the process's client,
        as every other S3 call of the pipeline)."""
        return open_store(self.root, self.s3_endpoint_url)

    def path(self, key: str) -> Path:
        """A layout key (``tokenmill.storage.layout``) under the local root."""
        return self.local_root() / key

    def raw_stats_path(self, dataset: str, shard: str) -> Path:
        """``raw/<ds>/<shard>.stats.json``: validation counts of one shard."""
        return self.path(layout.raw_stats(dataset, shard))

    def quarantine_path(self, dataset: str, shard: str) -> Path:
        """``raw/<ds>/<shard>.quarantine.jsonl``: the shard's bad lines with line numbers."""
        return self.path(layout.quarantine(dataset, shard))

    def hf_dir(self, dataset: str) -> Path:
        """``hf/<ds>``: the HF Parquet layout (``data/<shard>.parquet`` + ``dataset_info.json``)."""
        return self.path(layout.hf_dir(dataset))

    def parquet_path(self, dataset: str, shard: str) -> Path:
        """``hf/<ds>/data/<shard>.parquet``."""
        return self.path(layout.parquet(dataset, shard))

    def export_record_path(self, dataset: str, shard: str) -> Path:
        """``hf/<ds>/shards/<shard>.json``: one shard's export record."""
        return self.path(layout.export_record(dataset, shard))

    def tokens_output_prefix(self, dataset: str, shard: str) -> Path:
        """``tokens/<ds>/<shard>``; the files are ``<that>_<text_key>_document.{bin,idx}``."""
        return self.path(layout.tokens_dir(dataset)) / check_partition_key(shard)

    def tokens_prefix(self, dataset: str, shard: str, text_key: str) -> Path:
        """``tokens/<ds>/<shard>_<text_key>_document``: one shard's ``.bin``/``.idx`` prefix."""
        return self.path(layout.tokens_prefix(dataset, shard, text_key))

    def merged_pointer_path(self, dataset: str) -> Path:
        """``merged/<ds>/current.json``: names the dataset's current merged version."""
        return self.path(layout.merged_pointer(dataset))

    def merged_key(self, dataset: str, text_key: str) -> str:
        """The layout key of the current merged version's prefix, read from the pointer
        (ConfigError naming the pointer when the dataset was never merged)."""
        layout.document_name(dataset, text_key)  # a bad name fails before any read
        pointer = read_pointer(self.merged_pointer_path(dataset))
        if pointer is None:
            raise ConfigError(
                f"{display_path(self.merged_pointer_path(dataset))}: missing; "
                f"materialize {dataset}/merged first"
            )
        return layout.merged_prefix(dataset, text_key, str(pointer["version"]))

    def merged_prefix(self, dataset: str, text_key: str) -> Path:
        """``merged/<ds>/<version>/<ds>_<text_key>_document``: the current merged version."""
        return self.path(self.merged_key(dataset, text_key))

    def nanoset_dir(self) -> Path:
        """``nanoset/``: the content-addressed index cache shared by datasets and blends."""
        return self.path(layout.nanoset_dir())

    def blend_dir(self, blend: str) -> Path:
        """``blends/<name>``: a blend's ``manifest.json`` and index arrays."""
        return self.path(layout.blend_dir(blend))


class TokenizerResource(ConfigurableResource):
    """A local tokenizer directory or ``tokenizer.json`` and how to run it."""

    path: str
    append_eod: bool = True
    workers: int = 1

    def info(self) -> TokenizerInfo:
        """Facts about the tokenizer (fingerprint, vocab, dtype); verified once, then cached."""
        return inspect_tokenizer(self.path)
