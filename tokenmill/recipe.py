"""Recipes: the YAML file that says which datasets and blends exist and how to build them.

A recipe (``recipes/*.yaml``, chosen by ``TOKENMILL_RECIPE``) is loaded into frozen dataclasses;
the Dagster code location turns each dataset and blend into assets, partitions, sensors and
schedules named after it. The YAML's shape is checked by pydantic models (``_RecipeModel``); every
bad field raises ``ConfigError`` naming the file, the field, the value found and what is allowed
(``file: field: bad value V; expected …``), one line per problem. Relative paths are resolved
against ``base_dir`` (itself relative to the recipe file, default: the recipe's folder), so a
recipe means the same from any cwd. Library code for the Dagster side: pydantic and PyYAML come
with the ``pipeline`` extra; the loader never imports this module.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

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


# --- the YAML's shape: pydantic models whose every check says what it expected -------------------


def _expected(expected: str, *, kind: str = "bad value", **ctx: Any) -> PydanticCustomError:
    """A validation error whose message says what was ``expected``; ``field`` (in ``ctx``) names
    a field below the error's location, ``value`` replaces the input in the message."""
    return PydanticCustomError(
        "tokenmill", "{expected}", {"expected": expected, "kind": kind, **ctx}
    )


def _rule(expected: str, ok: Callable[[Any], bool]) -> BeforeValidator:
    """A check of the raw YAML value: ``ok(value)`` or a ConfigError saying ``expected``."""

    def check(value: Any) -> Any:
        if not ok(value):
            raise _expected(expected)
        return value

    return BeforeValidator(check)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _expected("a non-empty string")
    if "\0" in value:
        raise _expected("a string without NUL characters")
    return value


def _integer(minimum: int, *, optional: bool = False) -> BeforeValidator:
    expected = f"an integer >= {minimum}" + (" or null" if optional else "")
    return _rule(expected, lambda v: (v is None and optional) or (type(v) is int and v >= minimum))


def _number(*, positive: bool, optional: bool = False) -> BeforeValidator:
    def check(value: Any) -> float | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise _expected("a number")
        if value < 0 or (positive and value == 0) or value == float("inf"):
            raise _expected("a finite number > 0" if positive else "a finite number >= 0")
        return float(value)

    return BeforeValidator(check)


def _choice(*choices: str) -> BeforeValidator:
    return _rule(f"one of {', '.join(choices)}", lambda v: isinstance(v, str) and v in choices)


def _name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value) or value in _RESERVED_NAMES:
        raise _expected(
            "lower-case letters, digits and '_', starting with a letter, at most 63 characters, "
            f"not {', '.join(_RESERVED_NAMES)}",
            kind="bad name",
        )
    return value


def _split(value: Any) -> str:
    parts = value.replace("/", ",").split(",") if isinstance(value, str) else []
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) != 3 or any(n < 0 for n in numbers) or sum(numbers) <= 0:
        raise _expected('three non-negative numbers "train,valid,test" with a positive sum')
    return str(value)


def _cron(value: Any) -> str | None:
    if value is None:
        return None
    fields = _text(value).split()
    if len(fields) != 5 or not all(_CRON_FIELD.match(x) for x in fields):
        raise _expected('a 5-field cron string such as "0 3 * * *"')
    return str(value)


def _glob(value: Any) -> str | None:
    if value is not None and ("/" in _text(value) or "\\" in value):
        raise _expected("a file-name pattern without slashes (shards sit directly in source)")
    return value


def _text_key(value: str) -> str:
    problem = name_problem(value)  # it names the files <prefix>_<text_key>_document.*
    if problem:
        raise _expected(f"a key usable in a file name (this one {problem})")
    return value


def _entries(expected: str, *, empty: bool) -> BeforeValidator:
    """A mapping of named entries (None: none at all, where ``empty`` is allowed)."""

    def check(value: Any) -> Any:
        value = {} if value is None and empty else value
        if not isinstance(value, Mapping) or not (value or empty):
            raise _expected(expected)
        return value

    return BeforeValidator(check)


Text = Annotated[str, BeforeValidator(_text)]
Flag = Annotated[bool, _rule("true or false", lambda v: isinstance(v, bool))]
Name = Annotated[str, BeforeValidator(_name)]
Cron = Annotated[str | None, BeforeValidator(_cron)]
Weight = Annotated[float, _number(positive=False)]


class _Section(BaseModel):
    """One mapping of the YAML: unknown fields and non-mappings are refused, naming the fields
    the section has; a missing section is its defaults."""

    model_config = ConfigDict(frozen=True, validate_default=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, raw: Any) -> Any:
        raw = {} if raw is None else raw
        if not isinstance(raw, Mapping):
            raise _expected("a mapping of fields")
        allowed = f"one of {', '.join(cls.model_fields)}"
        for key, value in raw.items():
            if key not in cls.model_fields:
                raise _expected(allowed, kind="unknown field, value", field=str(key), value=value)
        cls._check_raw(raw)
        return raw

    @classmethod
    def _check_raw(cls, raw: Mapping[str, Any]) -> None:
        """Rules across the raw fields of one section (none by default)."""


class _StorageModel(_Section):
    root: Text = "data"
    s3_endpoint_url: Annotated[
        str | None, BeforeValidator(lambda v: v if v is None else _text(v))
    ] = None

    @classmethod
    def _check_raw(cls, raw: Mapping[str, Any]) -> None:
        if raw.get("root") == "s3://":
            raise _expected(
                "s3://bucket[/prefix] or a local directory", field="root", value="s3://"
            )


class _TokenizerModel(_Section):
    path: Text = None  # type: ignore[assignment]  # required: None is refused, naming the field
    append_eod: Flag = True
    workers: Annotated[int, _integer(1)] = 1


class _DatasetModel(_Section):
    source: Text = None  # type: ignore[assignment]
    format: Annotated[Literal["jsonl", "hf"], _choice(*SHARD_SUFFIXES)] = "jsonl"
    text_key: Annotated[str, BeforeValidator(_text), AfterValidator(_text_key)] = "text"
    on_bad_record: Annotated[Literal["fail", "quarantine"], _choice(*ON_BAD_RECORD)] = "quarantine"
    glob: Annotated[str | None, BeforeValidator(_glob)] = None


class _NanosetModel(_Section):
    semantics: Annotated[Literal["megatron", "nanotron"], _choice(*SEMANTICS)] = "megatron"
    sequence_length: Annotated[int, _integer(2)] = 2048
    split: Annotated[str, BeforeValidator(_split)] = "949,50,1"
    seed: Annotated[int, _integer(0)] = 1234
    train_samples: Annotated[int | None, _integer(1, optional=True)] = None
    valid_samples: Annotated[int | None, _integer(1, optional=True)] = None
    test_samples: Annotated[int | None, _integer(1, optional=True)] = None
    add_extra_token: Flag = True
    drop_last_partial_validation: Flag = True

    @model_validator(mode="after")
    def _nanotron_flags(self) -> _NanosetModel:
        for flag in ("add_extra_token", "drop_last_partial_validation"):
            if self.semantics == "nanotron" and not getattr(self, flag):
                raise _expected(
                    "true with semantics nanotron (nanotron always uses it)",
                    field=flag,
                    value=False,
                )
        return self


def _weights(value: Any, handler: ValidatorFunctionWrapHandler) -> dict[str, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise _expected("a non-empty mapping {dataset: weight}")
    weights: dict[str, float] = handler(value)
    if sum(weights.values()) <= 0:
        raise _expected("weights with a positive sum", value=dict(value))
    return weights


class _BlendModel(_Section):
    weights: Annotated[dict[str, Weight] | None, WrapValidator(_weights)] = None
    temperature: Annotated[float | None, _number(positive=True, optional=True)] = None
    datasets: list[str] | None = None

    @classmethod
    def _check_raw(cls, raw: Mapping[str, Any]) -> None:
        if (raw.get("weights") is None) == (raw.get("temperature") is None):
            raise _expected("exactly one of 'weights' or 'temperature'", value=dict(raw))
        if raw.get("weights") is not None and raw.get("datasets") is not None:
            raise _expected(
                "no 'datasets' beside 'weights' (they name them)",
                field="datasets",
                value=raw["datasets"],
            )
        listed = raw.get("datasets")
        if listed is not None and (
            not isinstance(listed, list) or not listed or len(set(map(str, listed))) != len(listed)
        ):
            raise _expected(
                "a non-empty list of distinct dataset names", field="datasets", value=listed
            )


class _ScheduleModel(_Section):
    reprocess: Cron = "0 2 * * 0"
    refresh: Cron = "0 3 * * *"


class _RecipeModel(_Section):
    base_dir: Text = "."
    storage: _StorageModel = None  # type: ignore[assignment]  # None: the section's defaults
    tokenizer: _TokenizerModel = None  # type: ignore[assignment]
    datasets: Annotated[
        dict[Name, _DatasetModel],
        _entries("a mapping {name: {source: ...}} with at least one entry", empty=False),
    ] = None  # type: ignore[assignment]
    nanoset: _NanosetModel = None  # type: ignore[assignment]
    blends: Annotated[
        dict[Name, _BlendModel], _entries("a mapping {name: {weights: ...}}", empty=True)
    ] = None  # type: ignore[assignment]
    schedules: _ScheduleModel = None  # type: ignore[assignment]


def _problem(path: Path, error: Mapping[str, Any]) -> str:
    """One pydantic error as ``file: field: bad value V; expected …`` (loc joined with dots,
    without pydantic's ``[key]`` marks; control characters escaped)."""
    ctx = error.get("ctx") or {}
    loc = [str(part) for part in error["loc"] if part != "[key]"]
    if "field" in ctx:
        loc.append(ctx["field"])
    where = ".".join(loc).encode("unicode_escape").decode("ascii") or "recipe"
    value = ctx.get("value", error.get("input"))
    expected = ctx.get("expected", str(error["msg"]).removeprefix("Input should be "))
    return f"{path}: {where}: {ctx.get('kind', 'bad value')} {value!r}; expected {expected}"


def _config_error(
    path: Path, where: str, value: object, expected: str, kind: str = "bad value"
) -> ConfigError:
    """A ConfigError for a rule across sections, in the models' format."""
    return ConfigError(f"{path}: {where}: {kind} {value!r}; expected {expected}")


def _local(base: Path, value: str) -> str:
    """Absolute form of a local path (S3 URIs pass through)."""
    if value.startswith("s3://"):
        return value
    return str((base / os.path.expanduser(value)).resolve())


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


def _blend(path: Path, name: str, model: _BlendModel, known: tuple[str, ...]) -> BlendConfig:
    """A validated blend whose datasets all exist (a temperature blend: all by default)."""
    if model.weights is not None:
        names, field = tuple(model.weights), "weights"
    else:
        names, field = tuple(model.datasets or known), "datasets"
    for n in names:
        if n not in known:
            expected = f"a dataset of this recipe ({', '.join(known)})"
            raise _config_error(path, f"blends.{name}.{field}", n, expected, "unknown dataset")
    weights = None if model.weights is None else tuple(model.weights.values())
    return BlendConfig(name=name, datasets=names, weights=weights, temperature=model.temperature)


def parse_recipe(data: object, path: str | os.PathLike[str]) -> Recipe:
    """Validate already-parsed YAML ``data`` for the recipe file at ``path``."""
    p = Path(path).resolve()
    try:
        model = _RecipeModel.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(_problem(p, e) for e in exc.errors())) from None
    base = (p.parent / model.base_dir).resolve()
    storage = StorageConfig(
        root=_local(base, model.storage.root), s3_endpoint_url=model.storage.s3_endpoint_url
    )
    datasets = tuple(
        DatasetConfig(
            name=name,
            source=_local(base, ds.source),
            text_key=ds.text_key,
            on_bad_record=ds.on_bad_record,
            glob=ds.glob or DEFAULT_GLOB[ds.format],
            format=ds.format,
        )
        for name, ds in model.datasets.items()
    )
    for ds in datasets:
        _check_source_apart(p, ds, storage)
    if model.blends and model.nanoset.train_samples is None:
        expected = "an integer >= 1 (a blend needs a train size)"
        raise _config_error(p, "nanoset.train_samples", None, expected)
    names = tuple(ds.name for ds in datasets)
    return Recipe(
        path=p,
        base_dir=base,
        storage=storage,
        tokenizer=TokenizerConfig(
            path=_local(base, model.tokenizer.path),
            append_eod=model.tokenizer.append_eod,
            workers=model.tokenizer.workers,
        ),
        datasets=datasets,
        nanoset=NanosetConfig(**model.nanoset.model_dump()),
        blends=tuple(_blend(p, n, b, names) for n, b in model.blends.items()),
        schedules=ScheduleConfig(**model.schedules.model_dump()),
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
