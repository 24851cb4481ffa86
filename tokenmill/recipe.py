"""Recipes (one module past 400 lines: models, field rules and error lines change together).

A recipe (``recipes/*.yaml``, chosen by ``TOKENMILL_RECIPE``; fields in docs/user-guide.md §3)
says which datasets and blends exist and how to build them; it is validated into the frozen
pydantic models below. Every bad field raises one ``ConfigError`` line naming the file, the
field, the value found and what is allowed (``file: field: bad value V; expected …``, made by
``_problem``). Relative paths resolve against ``base_dir`` (relative to the recipe file, default
its folder), so a recipe means the same from any cwd. Needs the ``pipeline`` extra (pydantic,
PyYAML); the loader never imports this module.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from itertools import product
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError

from tokenmill.errors import ConfigError
from tokenmill.indices.growing import ERA_SAMPLES
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.ingest.records import JSONL_SUFFIXES, TABLE_SUFFIXES
from tokenmill.paths import name_problem

DEFAULT_RECIPE = "recipes/demo.yaml"
RECIPE_ENV = "TOKENMILL_RECIPE"
# A dataset's source format and the file suffixes that make a shard in it. ``hf``: Parquet or
# Arrow files of a Hugging Face dataset on disk (its ``data/`` folder, or ``save_to_disk``
# output), which enter the pipeline at ``<ds>/hf_dataset`` (there is no raw_jsonl stage).
SHARD_SUFFIXES = {"jsonl": JSONL_SUFFIXES, "hf": TABLE_SUFFIXES}
DEFAULT_GLOB = {"jsonl": "*.jsonl*", "hf": "*"}
_ROOT = "s3://bucket[/prefix] or a local directory"
_GLOB = "a file-name pattern without slashes (shards sit directly in source)"
_DISTINCT = "a non-empty list of distinct dataset names"
_SPLIT = 'three non-negative numbers "train,valid,test" with a positive sum'
_CRON = r"^\s*[0-9A-Za-z*/,\-?]+(\s+[0-9A-Za-z*/,\-?]+){4}\s*$"  # five fields


def _expected(expected: str, *, kind: str = "bad value", **ctx: Any) -> PydanticCustomError:
    """An error saying what was ``expected``; ``at`` (in ``ctx``) names fields below the
    error's location, ``value`` replaces the input in the message."""
    return PydanticCustomError("recipe", "{expected}", {"expected": expected, "kind": kind, **ctx})


def _rule(ok: Callable[[Any], object], expected: str = "", *, before: bool = False) -> Any:
    """A check pydantic has no keyword for: ``ok(value)``, else an error saying ``expected``
    (default: the field's description); ``before``: on the raw YAML value."""

    def check(value: Any) -> Any:
        if not ok(value):
            raise _expected(expected) if expected else ValueError(value)
        return value

    return BeforeValidator(check) if before else AfterValidator(check)


def _resolve(value: str, info: ValidationInfo) -> str:
    """Absolute form of a local path against the recipe's base_dir (S3 URIs pass through)."""
    base = (info.context or {}).get("base")
    if base is None or value.startswith("s3://"):
        return value
    return str((base / os.path.expanduser(value)).resolve())


def _file_name_part(key: str) -> str:
    """A text key names files (``<prefix>_<text_key>_document.*``): one file-name part."""
    problem = name_problem(key)
    if problem:
        raise _expected(f"a key usable in a file name (this one {problem})")
    return key


def _shares(split: str) -> list[float]:
    """The numbers of a ``split`` string (``,`` or ``/`` between); ValueError if one is not."""
    return [float(part) for part in split.replace("/", ",").split(",")]


def _split_ok(split: str) -> bool:
    """True for three non-negative numbers with a positive sum."""
    try:
        numbers = _shares(split)
    except ValueError:
        return False
    return len(numbers) == 3 and min(numbers) >= 0 and sum(numbers) > 0


def _distinct(names: Any) -> bool:
    """True for a non-empty YAML list without repeats."""
    return isinstance(names, list) and bool(names) and len(set(map(str, names))) == len(names)


def _named(expected: str, *, empty: bool) -> BeforeValidator:
    """``{name: {field: …}}`` → its entries in order, each carrying its key as ``name``."""

    def entries(value: Any) -> Any:
        if not isinstance(value, Mapping) or not (value or empty):
            raise _expected(expected)
        for key, entry in value.items():
            if isinstance(entry, Mapping) and "name" in entry:  # the key is the name
                raise _expected("", kind="unknown field", at=(key, "name"), value=entry["name"])
        return [{**e, "name": k} if isinstance(e, Mapping) else e for k, e in value.items()]

    return BeforeValidator(entries)


def _int(minimum: int, *, null: bool = False) -> Any:
    """An integer field ``>= minimum`` (true, false and 2.0 refused)."""
    wanted = f"an integer >= {minimum}" + (" or null" if null else "")
    return Field(strict=True, ge=minimum, description=wanted)


# A field's description is what the error message expects of a bad value at it (or at one of its
# scalar items) when the error does not say so itself.
_TEXT = Field(strict=True, min_length=1, description="a non-empty string")
Text = Annotated[str, _TEXT, _rule(lambda v: "\0" not in v, "a string without NUL characters")]
Local = Annotated[Text, AfterValidator(_resolve)]
Flag = Annotated[bool, Field(strict=True, description="true or false")]
_NAME = (
    "lower-case letters, digits and '_', starting with a letter, at most 63 characters, not blend"
)
# Dataset and blend names become Dagster asset-key parts and job names; "blend" is a key prefix.
Name = Annotated[
    str,
    Field(strict=True, pattern=r"^[a-z][a-z0-9_]{0,62}$", description=_NAME),
    _rule(lambda v: v != "blend"),
]
_CRON_TEXT = 'a 5-field cron string such as "0 3 * * *"'
Cron = Annotated[str | None, Field(strict=True, pattern=_CRON, description=_CRON_TEXT)]
Weight = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
_BASE = Field(description="a folder, relative to the recipe file")
_POSITIVE = Field(strict=True, gt=0, allow_inf_nan=False, description="a finite number > 0")
_FRACTION = Field(ge=0, le=1, allow_inf_nan=False, description="a number from 0 to 1")
SEED_MAX = 2**32 - 1  # numpy's RandomState seed range, which the index builders use


class _Config(BaseModel):
    """One mapping of the recipe: frozen, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    _implied: ClassVar[str] = ""  # a field filled from the file or entry key, not in the YAML


class StorageConfig(_Config):
    """Where artifacts go: a local directory (absolute after loading) or ``s3://bucket/prefix``."""

    model_config = ConfigDict(validate_default=True)  # the default root is resolved too
    root: Annotated[Local, _rule(lambda v: v != "s3://", _ROOT)] = "data"
    s3_endpoint_url: Annotated[Text | None, Field(description="a non-empty string")] = None

    @property
    def is_s3(self) -> bool:
        """True for an ``s3://`` root."""
        return self.root.startswith("s3://")


class TokenizerConfig(_Config):
    """A local tokenizer directory or ``tokenizer.json`` (nothing is downloaded)."""

    path: Local
    append_eod: Flag = True
    workers: Annotated[int, _int(1)] = 1


class DatasetConfig(_Config):
    """One dataset: every file matching ``glob`` and a suffix of ``format`` directly in
    ``source`` is one shard."""

    _implied = "name"
    name: Name
    source: Local
    text_key: Annotated[Text, AfterValidator(_file_name_part)] = "text"
    on_bad_record: Literal["fail", "quarantine"] = "quarantine"
    glob: Annotated[Text, _rule(lambda v: "/" not in v and "\\" not in v, _GLOB)] = "*.jsonl*"
    format: Literal["jsonl", "hf"] = "jsonl"
    # The share of a dataset's records that may be quarantined before its merge fails (a
    # systematic problem such as a wrong text_key, not a few bad lines).
    max_quarantine_fraction: Annotated[float, _FRACTION] = 0.01

    @model_validator(mode="before")
    @classmethod
    def _default_glob(cls, raw: Any) -> Any:
        """A missing or null ``glob`` is the default of the dataset's format."""
        if isinstance(raw, Mapping) and raw.get("glob") is None:
            return {**raw, "glob": DEFAULT_GLOB["hf" if raw.get("format") == "hf" else "jsonl"]}
        return raw

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


class NanosetConfig(_Config):
    """Index settings shared by every dataset and blend of the recipe."""

    semantics: Literal["megatron", "nanotron", "growing"] = "megatron"
    sequence_length: Annotated[int, _int(2)] = 2048
    split: Annotated[str, Field(strict=True, description=_SPLIT), _rule(_split_ok)] = "949,50,1"
    seed: Annotated[int, _int(0)] = 1234
    train_samples: Annotated[int | None, _int(1, null=True)] = None
    valid_samples: Annotated[int | None, _int(1, null=True)] = None
    test_samples: Annotated[int | None, _int(1, null=True)] = None
    # Megatron's add_extra_token_to_sequence and drop_last_partial_validation_sequence (the
    # latter for the valid split only; train and test always drop). nanotron: both true.
    add_extra_token: Flag = True
    drop_last_partial_validation: Flag = True
    # growing semantics: samples per shuffled era (tokenmill.indices.growing; other semantics
    # ignore it)
    era_samples: Annotated[int, _int(1)] = ERA_SAMPLES

    @model_validator(mode="after")
    def _consistent(self) -> NanosetConfig:
        """The seed fits numpy's RandomState (the index builders'); a split the ``split`` shares
        give nothing has no sample count; nanotron always adds the extra token and drops the
        last partial valid sample, growing semantics drops it too."""
        if self.seed > SEED_MAX:
            raise _expected(f"an integer from 0 to {SEED_MAX}", at=("seed",), value=self.seed)
        for name, share in zip(("valid", "test"), _shares(self.split)[1:], strict=True):
            wanted = getattr(self, f"{name}_samples")  # train: Recipe's rule
            if share == 0 and wanted is not None:
                expected = f"null (split {self.split!r} gives the {name} split no share)"
                raise _expected(expected, at=(f"{name}_samples",), value=wanted)
        for flag in ("add_extra_token", "drop_last_partial_validation"):
            if self.semantics == "nanotron" and not getattr(self, flag):
                wanted = "true with semantics nanotron (nanotron always uses it)"
                raise _expected(wanted, at=(flag,), value=False)
        if self.semantics == "growing" and not self.drop_last_partial_validation:
            wanted = "true with semantics growing (a partial sample would change as data grows)"
            raise _expected(wanted, at=("drop_last_partial_validation",), value=False)
        return self

    def settings(self) -> NanosetSettings:
        """The library's value of these settings (what the index and blend builders take)."""
        same = {name: getattr(self, name) for name in type(self).model_fields if name != "split"}
        return NanosetSettings(split_spec=self.split, **same)

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The settings; ``era_samples`` only with growing semantics (the others ignore it, so
        it must not change their data versions)."""
        data: dict[str, Any] = handler(self)
        if self.semantics != "growing":
            data.pop("era_samples", None)
        return data


class BlendConfig(_Config):
    """A blend: explicit weights (given as ``{dataset: weight}``) or a temperature over
    ``datasets`` (token counts; none listed in a recipe: all of its datasets)."""

    _implied = "name"
    name: Name
    datasets: Annotated[tuple[str, ...], _rule(_distinct, _DISTINCT, before=True)] = ()
    weights: Annotated[tuple[Weight, ...] | None, Field(description="a finite number >= 0")] = None
    temperature: Annotated[float | None, _POSITIVE] = None
    # False: a weighted dataset that would get no sample in a configured split fails the blend.
    # Left out of model_dump (the data version): it changes no byte of a blend.
    allow_empty_splits: Annotated[Flag, Field(exclude=True)] = False

    @model_validator(mode="wrap")
    @classmethod
    def _weights(cls, raw: Any, handler: ModelWrapValidatorHandler[BlendConfig]) -> BlendConfig:
        """Exactly one of ``weights`` and ``temperature``; weights name their datasets and have
        a positive sum."""
        if not isinstance(raw, Mapping):
            return handler(raw)
        shown = {k: v for k, v in raw.items() if k != cls._implied}
        weights = raw.get("weights")
        if (weights is None) == (raw.get("temperature") is None):
            raise _expected("exactly one of 'weights' or 'temperature'", value=shown)
        if weights is not None:
            if not isinstance(weights, Mapping) or not weights:
                wanted = "a non-empty mapping {dataset: weight}"
                raise _expected(wanted, at=("weights",), value=weights)
            if raw.get("datasets") is not None:
                wanted = "no 'datasets' beside 'weights' (they name them)"
                raise _expected(wanted, at=("datasets",), value=raw["datasets"])
            raw = {**raw, "datasets": list(weights), "weights": list(weights.values())}
        blend = handler(raw)
        if blend.weights is not None and sum(blend.weights) <= 0:
            raise _expected("weights with a positive sum", at=("weights",), value=shown["weights"])
        return blend

    def weight_map(self) -> dict[str, float] | None:
        """``{dataset: weight}`` as configured, or None for a temperature blend."""
        return None if self.weights is None else dict(zip(self.datasets, self.weights, strict=True))

    def settings(self, nanoset: NanosetSettings) -> BlendSettings:
        """The library's value of this blend's settings over the recipe's index settings
        (what ``build_blend`` and ``prepare_blend`` take)."""
        return BlendSettings(nanoset, weights=self.weight_map(), temperature=self.temperature)


def _interval_ok(minutes: int) -> bool:
    """True for a whole number of minutes a cron can tick at evenly: a divisor of 60, or a
    whole number of hours dividing 24."""
    return 60 % minutes == 0 or (minutes % 60 == 0 and 1440 % minutes == 0)


_INTERVAL = "minutes dividing 60 (1, 2, 5, 10, 15, 30, ...) or hours dividing 24 (60, 120, ...)"


class ScheduleConfig(_Config):
    """Cron strings (None = no schedule): re-tokenize every shard, rebuild indices and blends;
    and the least time between two automatic refreshes of a downstream asset."""

    reprocess: Cron = "0 2 * * 0"
    refresh: Cron = "0 3 * * *"
    refresh_interval_minutes: Annotated[
        int, Field(strict=True, ge=1, le=1440, description=_INTERVAL), _rule(_interval_ok)
    ] = 5

    @property
    def refresh_interval_cron(self) -> str:
        """A cron ticking every ``refresh_interval_minutes``: automation refreshes a downstream
        asset at most once between two of its ticks."""
        minutes = self.refresh_interval_minutes
        if minutes < 60:
            return f"*/{minutes} * * * *"
        return "0 0 * * *" if minutes == 1440 else f"0 */{minutes // 60} * * *"


class TakedownConfig(_Config):
    """A takedown list the pipeline watches (``tokenmill.takedown``): a file of ``tokenmill
    find`` queries, one a line; when it changes, the documents it names are masked out of new
    merged and blend versions, with ``reason`` in the audit record. None: no list."""

    list: Local | None = None
    reason: Text = "the recipe's takedown list"


_STAGES = ("raw", "hf", "tokens", "merged", "nanoset", "blends")  # storage folders written
_SECTIONS = ("storage", "tokenizer", "nanoset", "blends", "schedules", "takedown")  # defaults
_DATASETS = "a mapping {name: {source: ...}} with at least one entry"


class Recipe(_Config):
    """A whole recipe, validated, with absolute local paths (see :func:`parse_recipe`)."""

    _implied = "path"
    path: Path
    base_dir: Annotated[Path, _rule(lambda v: isinstance(v, str) and v, before=True), _BASE]
    storage: StorageConfig
    tokenizer: TokenizerConfig
    datasets: Annotated[tuple[DatasetConfig, ...], _named(_DATASETS, empty=False)]
    nanoset: NanosetConfig
    blends: Annotated[
        tuple[BlendConfig, ...], _named("a mapping {name: {weights: ...}}", empty=True)
    ]
    schedules: ScheduleConfig
    # virtual: a merged version is a manifest of its shard pairs (nothing copied); physical:
    # Megatron's merged pair, a full copy per version (for Megatron's own tools)
    merge: Literal["virtual", "physical"] = "virtual"
    takedown: TakedownConfig

    @model_validator(mode="before")
    @classmethod
    def _from_file(cls, raw: Any, info: ValidationInfo) -> Any:
        """The file is the context's; an absent or null section is validated as ``{}``."""
        if not isinstance(raw, Mapping):
            return raw
        if "path" in raw:
            raise _expected("", kind="unknown field", at=("path",), value=raw["path"])
        sections: dict[str, Any] = {name: {} for name in _SECTIONS if raw.get(name) is None}
        file = (info.context or {})["recipe"]
        return {"base_dir": ".", "datasets": None, **raw, **sections, "path": file}

    @field_validator("base_dir")
    @classmethod
    def _resolve_base(cls, base_dir: Path, info: ValidationInfo) -> Path:
        """Absolute ``base_dir``; fields are validated in order, so every section below
        resolves its paths against it (through the context)."""
        context: dict[str, Any] = info.context or {}
        context["base"] = (info.data["path"].parent / base_dir).resolve()
        return Path(context["base"])

    @field_validator("datasets")
    @classmethod
    def _sources_apart(cls, datasets: tuple[DatasetConfig, ...], info: ValidationInfo) -> Any:
        """A source must not be a folder tokenmill writes to (its files would become shards)."""
        storage = info.data.get("storage")  # None: refused already
        local = storage is not None and not storage.is_s3
        stages = [Path(info.data["storage"].root) / s for s in _STAGES] if local else []
        for ds, stage in product(datasets, stages):
            if not ds.is_s3 and stage in (Path(ds.source), *Path(ds.source).parents):
                wanted = f"a folder outside {stage}, where tokenmill writes artifacts"
                example, at = stage.parent / "sources" / ds.name, (ds.name, "source")
                raise _expected(f"{wanted} (e.g. {example})", at=at, value=ds.source)
        return datasets

    @field_validator("blends")
    @classmethod
    def _blend_datasets(cls, blends: tuple[BlendConfig, ...], info: ValidationInfo) -> Any:
        """A temperature blend without datasets takes all; every dataset named must exist."""
        known = tuple(ds.name for ds in info.data.get("datasets", ()))  # none: already refused
        for blend in blends if known else ():
            for name in (n for n in blend.datasets if n not in known):
                at = (blend.name, "datasets" if blend.weights is None else "weights")
                wanted = f"a dataset of this recipe ({', '.join(known)})"
                raise _expected(wanted, kind="unknown dataset", at=at, value=name)
        return tuple(b.model_copy(update={"datasets": b.datasets or known}) for b in blends)

    @model_validator(mode="after")
    def _train_split(self) -> Recipe:
        """A blend is built from the train split and needs its size (growing semantics: None =
        every emitted sample); ``train_samples`` needs a train share too."""
        split, train = self.nanoset.split, self.nanoset.train_samples
        if _shares(split)[0] == 0 and self.blends:
            wanted = "a positive train share (a blend needs a train split)"
            raise _expected(wanted, at=("nanoset", "split"), value=split)
        if _shares(split)[0] == 0 and train is not None:
            expected = f"null (split {split!r} gives the train split no share)"
            raise _expected(expected, at=("nanoset", "train_samples"), value=train)
        if self.blends and train is None and self.nanoset.semantics != "growing":
            wanted = "an integer >= 1 (a blend needs a train size)"
            raise _expected(wanted, at=("nanoset", "train_samples"), value=None)
        return self

    @model_validator(mode="after")
    def _megatron_weights(self) -> Recipe:
        """Megatron's BlendedDataset refuses a weight of 0 (the blend step would fail)."""
        for blend in self.blends if self.nanoset.semantics == "megatron" else ():
            for name, weight in (blend.weight_map() or {}).items():
                if weight == 0:
                    expected = (
                        "a weight > 0 with nanoset.semantics megatron (Megatron refuses 0 "
                        "weights): leave the dataset out of the blend instead"
                    )
                    at = ("blends", blend.name, "weights", name)
                    raise _expected(expected, at=at, value=weight)
        return self

    def dataset(self, name: str) -> DatasetConfig:
        """The dataset called ``name``; ConfigError naming the recipe if there is none."""
        for ds in self.datasets:
            if ds.name == name:
                return ds
        raise ConfigError(f"{self.path}: datasets.{name}: no such dataset")


# --- one pydantic error → one ``file: field: bad value V; expected …`` line ----------------------
def _locate(data: Any, loc: Sequence[str | int]) -> tuple[str, type[_Config], FieldInfo | None]:
    """Where ``loc`` points in the YAML ``data``: its dotted name (an entry's position becomes
    its key, and an entry's name is that key), the section it is in and the field it is at (or
    at a scalar item of)."""
    parts: list[str] = []
    node: Any = data
    section: type[_Config] = Recipe
    field: FieldInfo | None = None
    configs = _Config.__subclasses__()
    for part in loc:
        if isinstance(part, int) and isinstance(node, Mapping) and part < len(node):
            part = list(node)[part]  # entries are validated in key order
            if field is not None and set(get_args(field.annotation)) & set(configs):
                field = None
        elif part == "name" and parts and isinstance(node, Mapping) and "name" not in node:
            field = section.model_fields["name"]  # the entry's key, already in ``parts``
            continue
        elif isinstance(part, str) and part in section.model_fields:
            field = section.model_fields[part]
            inner = [t for t in (field.annotation, *get_args(field.annotation)) if t in configs]
            section = inner[0] if inner else section
        parts.append(str(part))
        node = node.get(part) if isinstance(node, Mapping) else None
    return ".".join(parts).encode("unicode_escape").decode("ascii") or "recipe", section, field


def _problem(path: Path, data: Any, error: ErrorDetails) -> str:
    """One pydantic error as ``file: field: bad value V; expected …``: the error's own words
    (ours), else the field's description, else words for pydantic's error type."""
    kind, ctx = error["type"], error.get("ctx") or {}
    where, section, field = _locate(data, (*error["loc"], *ctx.get("at", ())))
    value = ctx.get("value", None if kind == "missing" else error["input"])
    named = field is not None and field is section.model_fields.get(section._implied)
    shown = "bad name" if named else "bad value"
    if kind == "extra_forbidden" or ctx.get("kind") == "unknown field":
        written = [name for name in section.model_fields if name != section._implied]
        shown, expected = "unknown field, value", f"one of {', '.join(written)}"
    elif kind == "recipe":
        shown, expected = ctx["kind"], ctx["expected"]
    elif isinstance(value, float) and math.isnan(value):
        expected = "a number"
    elif field is not None and field.description:
        expected = field.description
    elif kind == "literal_error":
        expected = "one of " + ", ".join(re.findall(r"'([^']*)'", ctx["expected"]))
    else:
        expected = "a mapping of fields" if kind == "model_type" else str(error["msg"])
        expected = expected.removeprefix("Input should be ")
    return f"{path}: {where}: {shown} {value!r}; expected {expected}"


def parse_recipe(data: object, path: str | os.PathLike[str]) -> Recipe:
    """Validate already-parsed YAML ``data`` for the recipe file at ``path``."""
    p = Path(path).resolve()
    try:
        return Recipe.model_validate(data, context={"recipe": p})
    except ValidationError as exc:
        raise ConfigError("\n".join(_problem(p, data, e) for e in exc.errors())) from None


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
    """The recipe to use: ``explicit``, else ``$TOKENMILL_RECIPE``, else ``recipes/demo.yaml``;
    a relative path is taken from ``root`` (default: the current directory)."""
    chosen = explicit or os.environ.get(RECIPE_ENV) or DEFAULT_RECIPE
    p = Path(chosen).expanduser()
    return p if p.is_absolute() else (root or Path.cwd()) / p
