"""Tokenize inputs into one Megatron pair plus manifest; over 400 lines: one run's serial and
parallel paths and its engine fallback share one ``_Run``.

The bytes equal Megatron-LM ``tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer``:
ids are ``tokenizer(text).input_ids``, with ``append_eod`` the eos id ends every non-empty
document, and an empty document adds no sequence but repeats its boundary. A forked checker
compares the engine with the reference on each input's first documents; on a disagreement the
run is redone with the next engine. With ``workers`` > 1, forked workers encode byte ranges into
part files (``tokenmill.tokenize.parallel``) that this process hashes and stitches in input order
as they arrive; with one, reader, encoder and writer threads overlap. Either way each document is
encoded whole, so the bytes are the same for any workers, split and engine. Up-to-date outputs
are kept; others are staged and renamed into place, manifest last (``tokenmill.tokenize.outputs``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import BadRecordError, ConfigError, InputError, TokenmillError
from tokenmill.formats.dataset_manifest import (
    input_sha256,
    write_dataset_manifest,
)
from tokenmill.formats.indexed import IndexedDatasetWriter, data_file_path
from tokenmill.formats.shard_records import IngestStats
from tokenmill.ingest.records import ON_BAD_RECORD, Quarantine
from tokenmill.ingest.sources import read_input_batches
from tokenmill.paths import document_stem
from tokenmill.tokenize.engines import Encoder, load_encoder
from tokenmill.tokenize.outputs import COUNTS, Outputs, byte_settings, facts_settings, input_bytes
from tokenmill.tokenize.parallel import (
    Job,
    RangeResult,
    RangeWorkers,
    part_paths,
    plan_ranges,
    schedule,
    splittable,
)
from tokenmill.tokenize.procs import (
    SAMPLE_CHARS,
    SAMPLE_DOCS,
    Background,
    Checker,
    EngineMismatch,
)
from tokenmill.tokenize.tokenizer import (
    _cached_record,
    _library_versions,
    inspect_tokenizer,
    record_mismatch,
    verification_summary,
)
from tokenmill.tokenize.tokenizer_info import TokenizerInfo

log = logging.getLogger(__name__)
CHECKED_ENGINES = ("gigatoken", "tiktoken")
HASH_THREADS = 8  # inputs hashed at once (sha256 of a file from the page cache: ~1.3 GB/s here)
Texts = tuple[Path | None, list[str]]  # (the input, on its first batch; the batch's texts)


@dataclass
class TokenizeResult:
    """What one tokenization run wrote and how."""

    prefix: Path
    engine: str
    fallbacks: list[str]
    documents: int
    sequences: int
    tokens: int
    quarantined: int
    blank: int
    lines: int
    empty_documents: int
    bytes_read: int
    seconds: float
    quarantine_path: Path | None
    manifest: dict[str, Any]
    reused: bool = False  # the prefix already held these outputs: nothing was written there


def dataset_prefix(output_prefix: str | os.PathLike[str], text_key: str = "text") -> Path:
    """Megatron's output name: ``{output_prefix}_{text_key}_document``."""
    return Path(document_stem(os.fspath(output_prefix), text_key))


def tokenize_files(
    inputs: list[Path],
    output_prefix: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Encoder,
    *,
    text_key: str = "text",
    append_eod: bool = False,
    workers: int = 1,
    on_bad_record: str = "fail",
    progress: bool | None = None,
    input_uri: Callable[[Path], str] | None = None,
    session: TokenizeSession | None = None,
) -> TokenizeResult:
    """Tokenize ``inputs`` in order into ``{output_prefix}_{text_key}_document.{bin,idx}``.

    ``tokenizer`` is a local tokenizer directory/file or an already loaded ``Encoder``.
    Bad records raise ``BadRecordError`` (``fail``: nothing is left at the prefix) or go to
    ``{output_prefix}.quarantine.jsonl``. ``progress=None`` shows a bar when stderr is a TTY.
    The manifest names each input by ``input_uri(path)`` (default: its absolute path), e.g.
    the object's URI when the input is a local copy, and records its size and sha256.
    ``workers`` > 1 processes share the inputs by byte ranges; the bytes are the same for any.
    A ``session`` keeps the engine and the reference checker loaded for the next call.
    Outputs that already record these inputs and settings are kept as they are (``reused``).
    """
    start = time.perf_counter()
    if not inputs:
        raise ConfigError("tokenize: no input files given")
    if on_bad_record not in ON_BAD_RECORD:
        raise ConfigError(f"on_bad_record={on_bad_record!r}: expected one of {ON_BAD_RECORD}")
    if workers < 1:
        raise ConfigError(f"workers={workers}: expected a positive number of processes")
    given = tokenizer if isinstance(tokenizer, Encoder) else None
    prefix = dataset_prefix(output_prefix, text_key)
    out = Outputs(prefix, Path(f"{os.fspath(output_prefix)}.quarantine.jsonl"))
    paths = [Path(p) for p in inputs]
    uris = [str(p.resolve()) if input_uri is None else input_uri(p) for p in paths]
    settings = None
    if not isinstance(tokenizer, Encoder):
        settings = _recorded_settings(out, tokenizer, text_key, append_eod)
    if settings is not None:  # up to date outputs need no verification of the tokenizer
        with out.locked():
            manifest = out.up_to_date(paths, uris, settings, on_bad_record)
        if manifest is not None:
            return _reused(out, manifest, start)
    info = tokenizer.info if isinstance(tokenizer, Encoder) else inspect_tokenizer(tokenizer)
    if append_eod and info.eod_id is None:
        raise ConfigError(f"append_eod: tokenizer {info.source} has no eos token to use as EOD")
    if info.max_id > np.iinfo(info.dtype).max:
        raise TokenmillError(
            f"tokenizer {info.source}: id {info.max_id} does not fit {info.dtype.name}, the dtype "
            f"Megatron picks for len(tokenizer) = {info.vocab_size}"
        )
    verified = byte_settings(info, text_key, append_eod)
    with out.locked():
        found = out.manifest_bytes()
        # the same settings were found not up to date before the verification: not checked
        # (hashing the pair and inputs) twice
        manifest = (
            None if verified == settings else out.up_to_date(paths, uris, verified, on_bad_record)
        )
    if manifest is not None:
        return _reused(out, manifest, start)
    staged = out.stage()
    try:
        run = _Run(
            inputs=paths,
            uris=uris,
            prefix=staged.prefix,
            qpath=staged.qpath if on_bad_record == "quarantine" else None,
            text_key=text_key,
            eod=info.eod_id if append_eod else None,
            workers=workers,
            on_bad_record=on_bad_record,
            progress=sys.stderr.isatty() if progress is None else progress,
            start=start,
        )
        result = _attempts(run, info, given, session)
        with out.locked():
            wrote = out.commit(staged, result.manifest)
    except BaseException:
        with out.locked():  # the pair found stale at the start goes; another run's stays
            if out.manifest_bytes() == found:
                out.clear()
        raise
    finally:
        shutil.rmtree(staged.prefix.parent, ignore_errors=True)  # else swept as a dead temp
    kept = out.qpath if result.quarantine_path is not None else None
    return dataclasses.replace(result, prefix=prefix, quarantine_path=kept, reused=not wrote)


class TokenizeSession:
    """The engine and the reference checker kept from one ``tokenize_files`` call to the next
    (``session=``), so a step over many small shards loads them once. Each call still sends its
    own sample and waits for its verdict: its outputs and manifest are those of a lone call. A
    checker that found a mismatch or saw a failed call is replaced. Use it as a context manager:
    leaving it stops the checker."""

    def __init__(self) -> None:
        self._encoders: dict[tuple[str, str], Encoder] = {}
        self._checker: tuple[tuple[str, str | None], Checker] | None = None

    def encoder(self, info: TokenizerInfo, engine: str) -> Encoder:
        """``load_encoder(info, engine)``, loaded once per tokenizer and engine."""
        key = (info.fingerprint, engine)
        if key not in self._encoders:
            self._encoders[key] = load_encoder(info, engine)
        return self._encoders[key]

    def checker(self, info: TokenizerInfo) -> Checker:
        """The idle checker for this tokenizer and reference, or a new one (forked now)."""
        if self._checker is not None and self._checker[0] == _checker_key(info):
            checker = self._checker[1]
            self._checker = None
            return checker
        self.close()
        return Checker(info)

    def release(self, info: TokenizerInfo, checker: Checker, *, keep: bool) -> None:
        """Keep ``checker`` for the next call when its run passed, else stop it."""
        if keep and checker.reuse():
            self.close()
            self._checker = (_checker_key(info), checker)
            return
        checker.close()

    def close(self) -> None:
        """Stop the idle checker, if any."""
        if self._checker is not None:
            self._checker[1].close()
            self._checker = None

    def __enter__(self) -> TokenizeSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checker_key(info: TokenizerInfo) -> tuple[str, str | None]:
    """What a checker's reference depends on: the tokenizer and whether ``hf`` is verified."""
    return info.fingerprint, info.verdicts.get("hf")


def _attempts(
    run: _Run, info: TokenizerInfo, given: Encoder | None, session: TokenizeSession | None
) -> TokenizeResult:
    """Execute ``run`` with the first usable engine (or the one given), redoing it with the
    next engine while the reference checker disagrees."""
    fallbacks: list[str] = []
    reuse = session if session is not None else TokenizeSession()
    while True:
        engine = given.name if given is not None else info.usable_engines()[0]
        # Forked before the engine loads, so the reference loads on another core meanwhile.
        checker = reuse.checker(info) if engine in CHECKED_ENGINES else None
        passed = False
        try:
            encoder = given if given is not None else reuse.encoder(info, engine)
            result = run.execute(encoder, checker, fallbacks)
            passed = True
            return result
        except EngineMismatch as exc:
            record_mismatch(info, engine, str(exc))
            fallbacks.append(f"{engine}: {exc}")
            log.warning("engine %s disagrees with the reference (%s); redoing", engine, exc)
            given = None
        finally:
            if checker is not None:
                reuse.release(info, checker, keep=passed and session is not None)


def _recorded_settings(
    out: Outputs, tokenizer: str | os.PathLike[str], text_key: str, append_eod: bool
) -> dict[str, Any] | None:
    """``byte_settings`` from the manifest at ``out``, unverified, when it names this tokenizer's
    fingerprint and the installed library versions and its facts hold together; None otherwise,
    or when the tokenizer's record is cached (a verified run compares its facts then)."""
    try:
        config = json.loads(out.manifest_bytes() or b"null")["config"]
        recorded = config["verification"]["libraries"]
    except (ValueError, RecursionError, TypeError, KeyError):  # the run will say what is wrong
        return None
    _, _, fingerprint, _, cached = _cached_record(tokenizer)
    if cached is not None:
        return None
    if config.get("tokenizer_fingerprint") != fingerprint or recorded != _library_versions():
        return None
    vocab, eod = config.get("vocab_size"), config.get("eod_id")
    if type(vocab) is not int or vocab < 1:
        return None
    if not ((type(eod) is int and 0 <= eod < vocab) or (eod is None and not append_eod)):
        return None
    settings = facts_settings(fingerprint, vocab, eod, text_key, append_eod)
    return settings if config.get("dtype") == settings["dtype"] else None


def _reused(out: Outputs, manifest: dict[str, Any], start: float) -> TokenizeResult:
    """The result of a run whose outputs were already up to date, from their manifest."""
    counts = manifest["counts"]
    return TokenizeResult(
        prefix=out.prefix,
        engine=str(manifest["config"].get("engine")),
        fallbacks=[],
        bytes_read=0,
        seconds=time.perf_counter() - start,
        quarantine_path=out.qpath if counts.get("quarantined") else None,
        manifest=manifest,
        reused=True,
        **{key: int(counts[key]) for key in COUNTS},
    )


@dataclass
class _Run:
    inputs: list[Path]
    uris: list[str]
    prefix: Path
    qpath: Path | None
    text_key: str
    eod: int | None
    workers: int
    on_bad_record: str
    progress: bool
    start: float

    def execute(
        self, encoder: Encoder, checker: Checker | None, fallbacks: list[str]
    ) -> TokenizeResult:
        """One attempt with one engine; raises EngineMismatch when the checker objects."""
        encoder.routed.clear()  # this run's documents only (a session reuses the encoder)
        ranges = plan_ranges(self.inputs, self.workers) if self.workers > 1 else []
        workers = None
        if len(ranges) > 1:
            job = Job(
                ranges=ranges,
                order=schedule(ranges),
                parts=part_paths(data_file_path(self.prefix), len(ranges)),
                text_key=self.text_key,
                on_bad_record=self.on_bad_record,
                eod=self.eod,
                dtype=encoder.info.dtype,
            )
            conns = [checker.conn] if checker is not None else []
            workers = RangeWorkers(job, encoder, min(self.workers, len(ranges)), conns)
        # The inputs' sha256 on threads started after every fork (the checker's, the workers'),
        # and ended before the next: a fork never copies a thread of ours holding a lock. A file
        # hashes serially, so several inputs hash at once (hashlib releases the GIL), on up to
        # the run's workers (HASH_THREADS at most).
        threads = max(1, min(self.workers, len(self.inputs), HASH_THREADS))
        hasher = ThreadPoolExecutor(threads, thread_name_prefix="tokenmill-input-sha256")
        digests = [hasher.submit(input_sha256, path) for path in self.inputs]
        quarantine = Quarantine(self.qpath) if self.qpath is not None else None
        stats = [IngestStats(path=uri) for uri in self.uris]
        bar = _progress_bar(self.inputs) if self.progress else None
        try:
            with IndexedDatasetWriter(self.prefix, encoder.info.dtype) as writer:
                if workers is None:
                    tokens = self._serial(writer, encoder, checker, stats, quarantine, bar)
                else:
                    tokens = self._stitch(writer, encoder, checker, stats, quarantine, bar, workers)
                if checker is not None:
                    checker.verdict(wait=True)
            if quarantine is not None:
                quarantine.commit()
        except BaseException:
            if quarantine is not None:
                quarantine.discard()
            raise
        finally:
            if workers is not None:
                workers.close()
            hasher.shutdown(wait=True, cancel_futures=True)
            if bar is not None:
                bar.close()
        hashes = [digest.result() for digest in digests]
        return self._finish(encoder, fallbacks, stats, hashes, writer, tokens)

    def _serial(
        self,
        writer: IndexedDatasetWriter,
        encoder: Encoder,
        checker: Checker | None,
        stats: list[IngestStats],
        quarantine: Quarantine | None,
        bar: Any,
    ) -> int:
        """Read, encode and write on three threads of this process; the tokens written."""
        tokens = 0
        texts = Background(self._texts(stats, quarantine, bar))
        encoded = Background(self._encoded(encoder, texts, checker))
        try:
            for flat, lengths in encoded:
                writer.add_documents(flat, lengths)
                tokens += flat.size
                if checker is not None:
                    checker.verdict(wait=False)
        finally:
            encoded.close()
            texts.close()
        return tokens

    def _stitch(
        self,
        writer: IndexedDatasetWriter,
        encoder: Encoder,
        checker: Checker | None,
        stats: list[IngestStats],
        quarantine: Quarantine | None,
        bar: Any,
        workers: RangeWorkers,
    ) -> int:
        """The worker processes' parts stitched in input order as they come; the tokens written."""
        lines_before = [0] * len(self.inputs)  # lines of each input already stitched
        tokens = 0
        for result in workers.results():
            rng, offset = result.range, lines_before[result.range.index]
            if result.error is not None or result.part is None:
                raise _worker_error(result, offset)
            if checker is not None and result.sample is not None:
                checker.submit(rng.path, result.sample, encoder)
                checker.verdict(wait=False)
            try:
                writer.add_part(result.part, result.lengths)
            finally:
                result.part.unlink(missing_ok=True)
            tokens += int(result.lengths.sum())
            for line, reason, raw in result.bad:
                if quarantine is not None:
                    quarantine.add(os.fspath(rng.path), offset + line, reason, raw)
            _add_stats(stats[rng.index], result.stats)
            lines_before[rng.index] += int(result.stats["lines"])
            encoder.routed.update(result.routed)
            if bar is not None:
                bar.update(int(result.stats["bytes_read"]))
        return tokens

    def _encoded(
        self, encoder: Encoder, texts: Iterable[Texts], checker: Checker | None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The encoder thread: samples for the checker, then output-ready ids per batch."""
        for first, batch in texts:
            if checker is not None and first is not None:
                checker.submit(first, batch[:SAMPLE_DOCS], encoder)
            yield encoder.pack(batch, self.eod, encoder.info.dtype)

    def _texts(
        self, stats: list[IngestStats], quarantine: Quarantine | None, bar: Any
    ) -> Iterator[Texts]:
        """The reader thread: each input's batches of texts, its path on its first batch."""
        for path, st in zip(self.inputs, stats, strict=True):
            batches = read_input_batches(
                path,
                text_key=self.text_key,
                on_bad_record=self.on_bad_record,
                quarantine=quarantine,
                stats=st,
            )
            seen = st.bytes_read
            for n, batch in enumerate(batches):
                if bar is not None:
                    bar.update(st.bytes_read - seen)
                    seen = st.bytes_read
                yield (path if n == 0 else None), batch.texts
            if bar is not None:
                bar.update(st.bytes_read - seen)

    def _finish(
        self,
        encoder: Encoder,
        fallbacks: list[str],
        stats: list[IngestStats],
        hashes: list[str],
        writer: IndexedDatasetWriter,
        tokens: int,
    ) -> TokenizeResult:
        info = encoder.info
        counts = {
            key: sum(getattr(s, key) for s in stats)
            for key in ("documents", "quarantined", "blank", "lines", "empty_documents")
        }
        counts.update(sequences=writer.num_sequences, tokens=tokens)
        config: dict[str, Any] = {
            "tokenizer": str(info.source),
            "engine": encoder.name,
            **byte_settings(info, self.text_key, self.eod is not None),
        }
        config["verification"] = verification_summary(
            encoder,
            sample_documents=SAMPLE_DOCS,
            sample_chars=SAMPLE_CHARS,
            sampled=encoder.name in CHECKED_ENGINES,
        )
        inputs = [
            {"uri": uri, "bytes": input_bytes(path), "sha256": sha256, "stats": st.to_dict()}
            for uri, path, sha256, st in zip(self.uris, self.inputs, hashes, stats, strict=True)
        ]
        manifest = write_dataset_manifest(
            self.prefix,
            kind="tokens",
            inputs=inputs,
            config=config,
            counts=counts,
            digests=writer.file_digests,
        )
        return TokenizeResult(
            prefix=self.prefix,
            engine=encoder.name,
            fallbacks=list(fallbacks),
            bytes_read=sum(s.bytes_read for s in stats),
            seconds=time.perf_counter() - self.start,
            quarantine_path=self.qpath if self.qpath and self.qpath.is_file() else None,
            manifest=manifest,
            **counts,
        )


def _progress_bar(inputs: list[Path]) -> Any:
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in inputs) if all(map(splittable, inputs)) else None
    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", file=sys.stderr)


def _add_stats(total: IngestStats, part: dict[str, Any]) -> None:
    """Add a range's counts to its input's (flags: any range that has them)."""
    for key, value in part.items():
        if key == "path":
            continue
        if isinstance(value, bool):
            setattr(total, key, getattr(total, key) or value)
        else:
            setattr(total, key, getattr(total, key) + int(value))


def _worker_error(result: RangeResult, lines_before: int) -> TokenmillError:
    """The error a worker reported, as this process raises it: a bad record at its line in the
    whole input, the tokenmill error it was, or a TokenmillError naming the input."""
    error = result.error or {"kind": "TokenmillError", "message": "no part was written"}
    if error["kind"] == "bad_record":
        return BadRecordError(error["path"], lines_before + int(error["line"]), error["reason"])
    known: dict[str, type[TokenmillError]] = {"InputError": InputError, "ConfigError": ConfigError}
    if error["kind"] in known:
        return known[error["kind"]](error["message"])
    return TokenmillError(
        f"tokenize: {result.range.path}: worker failed: {error['kind']}: {error['message']}"
    )
