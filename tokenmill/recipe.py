"""Recipes: the YAML file that says which datasets and blends exist and how to build them.

A recipe (``recipes/*.yaml``, chosen by ``TOKENMILL_RECIPE``) is loaded into frozen dataclasses;
the Dagster code location turns each dataset and blend into assets, partitions, sensors and
schedules named after it. Every bad field raises ``ConfigError`` naming the file, the field, the
value found and what is allowed. Relative paths are resolved against ``base_dir`` (itself relative
to the recipe file, default: the recipe's folder), so a recipe means the same from any cwd.

```yaml
base_dir: ..                                   # optional
storage: {root: data, s3_endpoint_url: null}
tokenizer: {path: .tokenizers/gpt2, append_eod: true, workers: 1}
datasets:
  docs: {source: data/sources/docs, glob: "*.jsonl*", text_key: text, on_bad_record: quarantine}
  wiki: {source: data/hf/wiki/data, format: hf}  # an HF dataset on disk: .parquet/.arrow shards
nanoset: {semantics: megatron, sequence_length: 2048, split: "949,50,1", seed: 1234,
          train_samples: 100000, valid_samples: null, test_samples: null,
          add_extra_token: true, drop_last_partial_validation: true}   # Megatron's flags
blends:
  mix: {weights: {docs: 1.0}}                  # or {temperature: 2.0, datasets: [docs]}
schedules: {reprocess: "0 2 * * 0", refresh: "0 3 * * *"}   # null = no such schedule
```
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from tokenmill.errors import ConfigError
from tokenmill.paths import name_problem

DEFAULT_RECIPE = "recipes/demo.yaml"
RECIPE_ENV = "TOKENMILL_RECIPE"
SEMANTICS = ("megatron", "nanotron")
ON_BAD_RECORD = ("fail", "quarantine")
# A dataset's source format and the file suffixes that make a shard in it. ``hf``: Parquet or
# Arrow files of a Hugging Face dataset on disk (its ``data/`` folder, or ``save_to_disk``
# output), which enter the pipeline at ``<ds>/hf_dataset`` (there is no raw_jsonl stage).
SHARD_SUFFIXES = {"jsonl": (".jsonl", ".jsonl.gz", ".jsonl.zst"), "hf": (".parquet", ".arrow")}
DEFAULT_GLOB = {"jsonl": "*.jsonl*", "hf": "*"}
# Dataset and blend names become Dagster asset-key parts, job and partition-set names.
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_CRON_FIELD = re.compile(r"^[0-9A-Za-z*/,\-?]+$")
_RESERVED_NAMES = ("blend",)


@dataclass(frozen=True)
class StorageConfig:
    """Where artifacts go: a local directory (absolute after loading) or ``s3://bucket/prefix``."""

    root: str
    s3_endpoint_url: str | None = None

    @property
    def is_s3(self) -> bool:
        """True for an ``s3://`` root."""
        return self.root.startswith("s3://")


@dataclass(frozen=True)
class TokenizerConfig:
    """A local tokenizer directory or ``tokenizer.json`` (nothing is downloaded)."""

    path: str
    append_eod: bool = True
    workers: int = 1


@dataclass(frozen=True)
class DatasetConfig:
    """One dataset: every file matching ``glob`` and a suffix of ``format`` directly in
    ``source`` is one shard."""

    name: str
    source: str
    text_key: str = "text"
    on_bad_record: str = "quarantine"
    glob: str = "*.jsonl*"
    format: str = "jsonl"

    @property
    def has_raw_stage(self) -> bool:
        """True for JSONL sources, validated by ``<ds>/raw_jsonl``; an ``hf`` dataset is
        validated by ``<ds>/hf_dataset``, where it enters the pipeline."""
        return self.format == "jsonl"

    @property
    def shard_suffixes(self) -> tuple[str, ...]:
        """The file suffixes a shard of this dataset has."""
        return SHARD_SUFFIXES[self.format]

    @property
    def is_s3(self) -> bool:
        """True for an ``s3://`` source prefix."""
        return self.source.startswith("s3://")


@dataclass(frozen=True)
class NanosetConfig:
    """Index settings shared by every dataset and blend of the recipe."""

    semantics: str = "megatron"
    sequence_length: int = 2048
    split: str = "949,50,1"
    seed: int = 1234
    train_samples: int | None = None
    valid_samples: int | None = None
    test_samples: int | None = None
    # Megatron's add_extra_token_to_sequence and drop_last_partial_validation_sequence (the
    # latter for the valid split only; train and test always drop). nanotron: both true.
    add_extra_token: bool = True
    drop_last_partial_validation: bool = True


@dataclass(frozen=True)
class BlendConfig:
    """A blend: explicit ``{dataset: weight}`` or a temperature over ``datasets`` (token counts)."""

    name: str
    datasets: tuple[str, ...]
    weights: tuple[float, ...] | None = None
    temperature: float | None = None

    def weight_map(self) -> dict[str, float] | None:
        """``{dataset: weight}`` as configured, or None for a temperature blend."""
        return None if self.weights is None else dict(zip(self.datasets, self.weights, strict=True))


@dataclass(frozen=True)
class ScheduleConfig:
    """Cron strings (None = no schedule): re-tokenize every shard, rebuild indices and blends."""

    reprocess: str | None = "0 2 * * 0"
    refresh: str | None = "0 3 * * *"


@dataclass(frozen=True)
class Recipe:
    """A whole recipe, validated, with absolute local paths."""

    path: Path
    base_dir: Path
    storage: StorageConfig
    tokenizer: TokenizerConfig
    datasets: tuple[DatasetConfig, ...]
    nanoset: NanosetConfig
    blends: tuple[BlendConfig, ...]
    schedules: ScheduleConfig

    def dataset(self, name: str) -> DatasetConfig:
        """The dataset called ``name``; ConfigError naming the recipe if there is none."""
        for ds in self.datasets:
            if ds.name == name:
                return ds
        raise ConfigError(f"{self.path}: datasets.{name}: no such dataset")


class _Fields:
    """Reads one mapping of the YAML, turning every problem into a ConfigError with context."""

    def __init__(self, path: Path, where: str, raw: object, allowed: tuple[str, ...]) -> None:
        self.path, self.where = path, where
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            self.fail("", raw, "a mapping of fields")
        self.raw: Mapping[str, Any] = raw
        for key in raw:
            if key not in allowed:
                known = f"one of {', '.join(allowed)}"
                self.fail(str(key), raw[key], known, "unknown field, value")

    def fail(self, field: str, value: object, allowed: str, what: str = "bad value") -> NoReturn:
        name = f"{self.where}.{field}" if field and self.where else (field or self.where)
        raise ConfigError(f"{self.path}: {name}: {what} {value!r}; expected {allowed}")

    def get(self, field: str, default: Any = None) -> Any:
        return self.raw.get(field, default)

    def string(
        self, field: str, default: str | None = None, *, choices: tuple[str, ...] = ()
    ) -> str:
        value = self.raw.get(field, default)
        if not isinstance(value, str) or not value:
            self.fail(field, value, "a non-empty string")
        if "\0" in value:
            self.fail(field, value, "a string without NUL characters")
        if choices and value not in choices:
            self.fail(field, value, f"one of {', '.join(choices)}")
        return value

    def optional_string(self, field: str) -> str | None:
        value = self.raw.get(field)
        return None if value is None else self.string(field)

    def integer(
        self, field: str, default: int | None, *, minimum: int, optional: bool = False
    ) -> Any:
        value = self.raw.get(field, default)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(field, value, f"an integer >= {minimum}" + (" or null" if optional else ""))
        return value

    def boolean(self, field: str, default: bool) -> bool:
        value = self.raw.get(field, default)
        if not isinstance(value, bool):
            self.fail(field, value, "true or false")
        return value


def _check_name(path: Path, where: str, name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name in _RESERVED_NAMES:
        where = where.encode("unicode_escape").decode("ascii")  # no raw control characters
        raise ConfigError(
            f"{path}: {where}: bad name {name!r}; expected lower-case letters, digits and '_', "
            f"starting with a letter, at most 63 characters, not {', '.join(_RESERVED_NAMES)}"
        )
    return name


def _local(base: Path, value: str) -> str:
    """Absolute form of a local path (S3 URIs pass through)."""
    if value.startswith("s3://"):
        return value
    return str((base / os.path.expanduser(value)).resolve())


def _storage(path: Path, base: Path, raw: object) -> StorageConfig:
    f = _Fields(path, "storage", raw, ("root", "s3_endpoint_url"))
    root = f.string("root", "data")
    if root.startswith("s3://") and len(root) <= len("s3://"):
        f.fail("root", root, "s3://bucket[/prefix] or a local directory")
    return StorageConfig(
        root=_local(base, root), s3_endpoint_url=f.optional_string("s3_endpoint_url")
    )


def _tokenizer(path: Path, base: Path, raw: object) -> TokenizerConfig:
    f = _Fields(path, "tokenizer", raw, ("path", "append_eod", "workers"))
    return TokenizerConfig(
        path=_local(base, f.string("path")),
        append_eod=f.boolean("append_eod", True),
        workers=f.integer("workers", 1, minimum=1),
    )


def _dataset(path: Path, base: Path, name: object, raw: object) -> DatasetConfig:
    name = _check_name(path, f"datasets.{name}", name)
    allowed = ("source", "format", "text_key", "on_bad_record", "glob")
    f = _Fields(path, f"datasets.{name}", raw, allowed)
    form = f.string("format", "jsonl", choices=tuple(SHARD_SUFFIXES))
    glob = f.string("glob", DEFAULT_GLOB[form])
    if "/" in glob or "\\" in glob:
        f.fail("glob", glob, "a file-name pattern without slashes (shards sit directly in source)")
    text_key = f.string("text_key", "text")
    problem = name_problem(text_key)  # it names the files <prefix>_<text_key>_document.*
    if problem:
        f.fail("text_key", text_key, f"a key usable in a file name (this one {problem})")
    return DatasetConfig(
        name=name,
        source=_local(base, f.string("source")),
        text_key=text_key,
        on_bad_record=f.string("on_bad_record", "quarantine", choices=ON_BAD_RECORD),
        glob=glob,
        format=form,
    )


def _check_source_apart(path: Path, ds: DatasetConfig, storage: StorageConfig) -> None:
    """A source must not be a folder tokenmill writes to (its files would become shards)."""
    if ds.is_s3 or storage.is_s3:
        return
    source, root = Path(ds.source), Path(storage.root)
    for stage in ("raw", "hf", "tokens", "merged", "nanoset", "blends"):
        written = root / stage
        if source == written or written in source.parents:
            raise ConfigError(
                f"{path}: datasets.{ds.name}.source: {ds.source} is inside {written}, where "
                f"tokenmill writes artifacts; keep raw shards outside the storage stages "
                f"(e.g. {root / 'sources' / ds.name})"
            )


def _split(f: _Fields) -> str:
    value = f.get("split", "949,50,1")
    parts = str(value).replace("/", ",").split(",") if isinstance(value, str) else []
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) != 3 or any(n < 0 for n in numbers) or sum(numbers) <= 0:
        f.fail("split", value, 'three non-negative numbers "train,valid,test" with a positive sum')
    return str(value)


def _nanoset(path: Path, raw: object) -> NanosetConfig:
    fields = ("semantics", "sequence_length", "split", "seed", "train_samples")
    flags = ("add_extra_token", "drop_last_partial_validation")
    f = _Fields(path, "nanoset", raw, (*fields, "valid_samples", "test_samples", *flags))
    semantics = f.string("semantics", "megatron", choices=SEMANTICS)
    chosen = {flag: f.boolean(flag, True) for flag in flags}
    for flag, value in chosen.items():
        if semantics == "nanotron" and not value:
            f.fail(flag, value, "true with semantics nanotron (nanotron always uses it)")
    return NanosetConfig(
        semantics=semantics,
        sequence_length=f.integer("sequence_length", 2048, minimum=2),
        split=_split(f),
        seed=f.integer("seed", 1234, minimum=0),
        train_samples=f.integer("train_samples", None, minimum=1, optional=True),
        valid_samples=f.integer("valid_samples", None, minimum=1, optional=True),
        test_samples=f.integer("test_samples", None, minimum=1, optional=True),
        **chosen,
    )


def _number(f: _Fields, field: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        f.fail(field, value, "a number")
    if value < 0 or (positive and value == 0) or value == float("inf"):
        f.fail(field, value, "a finite number > 0" if positive else "a finite number >= 0")
    return float(value)


def _weights(f: _Fields, raw: object) -> tuple[tuple[str, ...], tuple[float, ...]]:
    if not isinstance(raw, Mapping) or not raw:
        f.fail("weights", raw, "a non-empty mapping {dataset: weight}")
    names = tuple(str(n) for n in raw)
    wf = _Fields(f.path, f"{f.where}.weights", raw, names)
    weights = tuple(_number(wf, n, raw[n], positive=False) for n in names)
    if sum(weights) <= 0:
        f.fail("weights", dict(raw), "weights with a positive sum")
    return names, weights


def _blend(path: Path, name: object, raw: object, known: tuple[str, ...]) -> BlendConfig:
    name = _check_name(path, f"blends.{name}", name)
    f = _Fields(path, f"blends.{name}", raw, ("weights", "temperature", "datasets"))
    weights: tuple[float, ...] | None = None
    temperature: float | None = None
    if (f.get("weights") is None) == (f.get("temperature") is None):
        f.fail("", dict(f.raw), "exactly one of 'weights' or 'temperature'")
    if f.get("weights") is not None:
        if f.get("datasets") is not None:
            f.fail("datasets", f.get("datasets"), "no 'datasets' beside 'weights' (they name them)")
        names, weights = _weights(f, f.get("weights"))
        field = "weights"
    else:
        temperature = _number(f, "temperature", f.get("temperature"), positive=True)
        listed = f.get("datasets", list(known))
        if not isinstance(listed, list) or not listed or len(set(map(str, listed))) != len(listed):
            f.fail("datasets", listed, "a non-empty list of distinct dataset names")
        names, field = tuple(str(n) for n in listed), "datasets"
    for n in names:
        if n not in known:
            f.fail(field, n, f"a dataset of this recipe ({', '.join(known)})", "unknown dataset")
    return BlendConfig(name=name, datasets=names, weights=weights, temperature=temperature)


def _cron(f: _Fields, field: str, default: str) -> str | None:
    if field in f.raw and f.raw[field] is None:
        return None
    value = f.string(field, default)
    fields = value.split()
    if len(fields) != 5 or not all(_CRON_FIELD.match(x) for x in fields):
        f.fail(field, value, 'a 5-field cron string such as "0 3 * * *"')
    return value


def parse_recipe(data: object, path: str | os.PathLike[str]) -> Recipe:
    """Validate already-parsed YAML ``data`` for the recipe file at ``path``."""
    p = Path(path).resolve()
    top = ("base_dir", "storage", "tokenizer", "datasets", "nanoset", "blends", "schedules")
    f = _Fields(p, "", data, top)
    base = (p.parent / f.string("base_dir", ".")).resolve()
    raw_datasets = f.get("datasets")
    if not isinstance(raw_datasets, Mapping) or not raw_datasets:
        f.fail("datasets", raw_datasets, "a mapping {name: {source: ...}} with at least one entry")
    datasets = tuple(_dataset(p, base, n, v) for n, v in raw_datasets.items())
    storage = _storage(p, base, f.get("storage"))
    for ds in datasets:
        _check_source_apart(p, ds, storage)
    names = tuple(ds.name for ds in datasets)
    raw_blends = f.get("blends") or {}
    if not isinstance(raw_blends, Mapping):
        f.fail("blends", raw_blends, "a mapping {name: {weights: ...}}")
    sf = _Fields(p, "schedules", f.get("schedules"), ("reprocess", "refresh"))
    nanoset = _nanoset(p, f.get("nanoset"))
    if raw_blends and nanoset.train_samples is None:
        f.fail("nanoset.train_samples", None, "an integer >= 1 (a blend needs a train size)")
    return Recipe(
        path=p,
        base_dir=base,
        storage=storage,
        tokenizer=_tokenizer(p, base, f.get("tokenizer")),
        datasets=datasets,
        nanoset=nanoset,
        blends=tuple(_blend(p, n, v, names) for n, v in raw_blends.items()),
        schedules=ScheduleConfig(
            reprocess=_cron(sf, "reprocess", "0 2 * * 0"), refresh=_cron(sf, "refresh", "0 3 * * *")
        ),
    )


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate a recipe file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the recipe: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text ({exc})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    return parse_recipe(data, p)


def recipe_path(
    explicit: str | os.PathLike[str] | None = None, *, root: Path | None = None
) -> Path:
    """The recipe to use: ``explicit``, else ``$TOKENMILL_RECIPE``, else ``recipes/demo.yaml``.

    Relative paths are taken from ``root`` (default: the current directory).
    """
    chosen = explicit or os.environ.get(RECIPE_ENV) or DEFAULT_RECIPE
    p = Path(chosen).expanduser()
    return p if p.is_absolute() else (root or Path.cwd()) / p
