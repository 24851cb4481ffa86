"""Hostile settings and names (issue 6 §2): recipe values, blend weights, sequence lengths, sample
counts, partition keys, S3 object names and pulled paths. Each is refused with an error naming the
setting (or file) and the value, before anything is written; nothing appears outside the storage
root or output directory (the parent directory is compared before and after).

Catalogue (cases already tested elsewhere are listed, not repeated):

- recipe errors: tests/pipeline/test_recipe.py::test_bad_fields_name_file_field_value_and_allowed
  (unknown fields, bad names, semantics, split, negative weights, zero temperature, cron, missing
  train size ...), ::test_unreadable_and_invalid_files, ::test_source_inside_the_storage_stages_is_
  refused; NaN/inf, sequence length 1, NUL characters: test_hostile_recipe_values_are_refused,
  non-UTF-8: test_non_utf8_recipe_is_refused (here); ``!!python`` tags: test_security.py.
- text keys (they name ``<prefix>_<text_key>_document``): climbing, '..', backslash, control
  characters in a recipe: test_hostile_recipe_values_are_refused; the storage layout:
  test_text_key_must_be_one_file_name_part (here); ``tokenize_files`` and ``tokenmill tokenize``:
  tests/lib/test_tokenize.py::test_text_key_must_be_one_file_name_part.
- weights negative, zero-sum, NaN, inf: tests/lib/test_blend.py::test_bad_weights,
  ::test_bad_temperatures, tests/lib/test_blend_manifest.py::test_bad_settings (zero sum); through
  build_blend and ``tokenmill blend``: test_hostile_weights_are_refused,
  test_hostile_temperatures_are_refused (here).
- sequence length <= 1: tests/lib/test_nanoset.py::test_rejected_inputs_name_the_setting; through
  build_blend, open_nanoset, ``tokenmill blend`` and ``tokenmill index``:
  test_sequence_length_below_two_is_refused (here).
- add_extra_token / drop_last_partial_validation not booleans, or off with nanotron semantics;
  a ``--dataset`` pointer whose target leaves its folder: test_non_boolean_sample_flags_are_
  refused, test_nanotron_refuses_turning_a_sample_flag_off, test_dataset_pointer_leaving_its_
  folder_is_refused (here); recipe: tests/pipeline/test_recipe.py.
- num_samples 0: tests/lib/test_blend_manifest.py::test_bad_settings (train_samples 0); the CLI and
  valid/test sizes: test_zero_samples_are_refused (here); the index API's Megatron meaning of 0:
  test_index_api_reads_zero_samples_as_megatron_does (here).
- partition keys: tests/pipeline/test_assets.py::test_unsafe_partition_keys_are_rejected (the key
  check and storage paths); source files and S3 object names: test_hostile_shard_names_never_
  become_partitions, test_hostile_s3_object_names_never_become_partitions; keys reaching the shard
  assets: test_hostile_partition_keys_write_nothing (here).
- S3 keys in the storage root copied to local folders (a step's work directory, the
  ``materialize`` mirror): test_hostile_s3_keys_never_reach_a_work_directory,
  test_hostile_s3_keys_never_reach_the_materialize_mirror, test_local_name_refuses_what_listing_
  cannot_reach (here).
- pulled manifest-relative keys: tests/prod/test_pull.py::test_paths_escaping_the_layout_are_refused
  (absolute, '..' after a folder, above the root); control characters:
  test_pull_refuses_control_characters (here).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from dagster import AssetKey, DagsterInstance, build_asset_context
from prod_servers import S3
from tiny_pairs import random_dataset

import assets.support.sources
from assets.factory import build_assets
from assets.support.partitions import partitions_name
from assets.support.resources import StorageResource
from assets.support.sources import list_shards
from pipelines.build import resources_for
from tokenmill.cli import main
from tokenmill.errors import ConfigError, FormatError, InputError, TokenmillError
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.nanoset import build_or_load
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.recipe import DatasetConfig, Recipe, load_recipe
from tokenmill.storage import layout
from tokenmill.storage.pull import pull
from tokenmill.storage.s3 import S3Object, shared_client
from tokenmill.storage.staging import S3Stage, local_name

NAN, INF = float("nan"), float("inf")


def snapshot(top: Path) -> dict[str, bytes | None]:
    """Every directory (None) and file (its bytes) under ``top``."""
    return {
        p.relative_to(top).as_posix(): p.read_bytes() if p.is_file() else None
        for p in sorted(top.rglob("*"))
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """``tmp_path/root/merged/{a,b}``: two datasets; ``tmp_path`` is the parent to watch."""
    random_dataset(tmp_path / "root" / "merged" / "a", 60, 1, vocab=50000)
    random_dataset(tmp_path / "root" / "merged" / "b", 60, 2, vocab=50000)
    return tmp_path / "root"


def blend_argv(root: Path, *extra: str) -> list[str]:
    """``tokenmill blend`` of a and b into ``root/blends/x``, then ``extra`` (later flags win)."""
    return [
        "blend", "--dataset", f"a={root / 'merged/a'}", "--dataset", f"b={root / 'merged/b'}",
        "--output", str(root / "blends/x"), "--sequence-length", "8", "--split", "80,10,10",
        "--train-samples", "20", *extra,
    ]  # fmt: skip


def index_argv(root: Path, *extra: str) -> list[str]:
    """``tokenmill index`` of dataset a into ``root/cache``, then ``extra``."""
    return [
        "index", "--dataset", str(root / "merged/a"), "--cache-dir", str(root / "cache"),
        "--sequence-length", "8", *extra,
    ]  # fmt: skip


def blend_api(root: Path, **settings: Any) -> None:
    """build_blend of a and b into ``root/blends/x`` with ``settings`` over good defaults."""
    kw: dict[str, Any] = {
        "weights": {"a": 0.5, "b": 0.5},
        "sequence_length": 8,
        "split_spec": "80,10,10",
        "train_samples": 20,
    } | settings
    weighting = {k: kw.pop(k, None) for k in ("weights", "temperature")}
    build_blend("x", {"a": root / "merged/a", "b": root / "merged/b"}, root / "blends/x",
                root / "cache", BlendSettings(NanosetSettings(**kw), **weighting))  # fmt: skip


def refused_cli(
    argv: list[str], capsys: pytest.CaptureFixture[str], watched: Path, message: str
) -> None:
    """The command exits 2 with ``message`` on stderr and leaves ``watched`` unchanged."""
    before = snapshot(watched)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert snapshot(watched) == before


def refused_api(call: Callable[[], object], watched: Path, message: str) -> None:
    """``call`` raises ConfigError with ``message`` and leaves ``watched`` unchanged."""
    before = snapshot(watched)
    with pytest.raises(ConfigError) as err:
        call()
    assert message in str(err.value)
    assert snapshot(watched) == before


# -- recipes --------------------------------------------------------------------------------------
GOOD: dict[str, Any] = {
    "storage": {"root": "out"},
    "tokenizer": {"path": "tok"},
    "datasets": {"web": {"source": "raw/web"}, "code": {"source": "raw/code"}},
    "nanoset": {"train_samples": 10},
    "blends": {"mix": {"weights": {"web": 3, "code": 1}}},
}
RECIPE_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "weight NaN": (
        {"blends": {"mix": {"weights": {"web": NAN, "code": 1}}}},
        "blends.mix.weights.web: bad value nan; expected a number",
    ),
    "weight inf": (
        {"blends": {"mix": {"weights": {"web": INF, "code": 1}}}},
        "blends.mix.weights.web: bad value inf; expected a finite number >= 0",
    ),
    "weights sum to zero": (
        {"blends": {"mix": {"weights": {"web": 0, "code": 0}}}},
        "blends.mix.weights: bad value {'web': 0, 'code': 0}; expected weights with a positive sum",
    ),
    "temperature NaN": (
        {"blends": {"hot": {"temperature": NAN}}},
        "blends.hot.temperature: bad value nan; expected a number",
    ),
    "temperature -inf": (
        {"blends": {"hot": {"temperature": -INF}}},
        "blends.hot.temperature: bad value -inf; expected a finite number > 0",
    ),
    "sequence length 1": (
        {"nanoset": {"train_samples": 10, "sequence_length": 1}},
        "nanoset.sequence_length: bad value 1; expected an integer >= 2",
    ),
    "valid_samples 0": (
        {"nanoset": {"train_samples": 10, "valid_samples": 0}},
        "nanoset.valid_samples: bad value 0; expected an integer >= 1 or null",
    ),
    "NUL in the storage root": (
        {"storage": {"root": "out\0/x"}},
        "storage.root: bad value 'out\\x00/x'; expected a string without NUL characters",
    ),
    "NUL in a source": (
        {"datasets": {"web": {"source": "raw\0"}}},
        "datasets.web.source: bad value 'raw\\x00'; expected a string without NUL characters",
    ),
    "blend name climbing": (
        {"blends": {"../up": {"weights": {"web": 1, "code": 1}}}},
        "blends.../up: bad name '../up'",
    ),
    "dataset name with a control character": (
        {"datasets": {"we\x1bb": {"source": "raw"}}},
        "datasets.we\\x1bb: bad name 'we\\x1bb'",
    ),
    "text_key climbing": (
        {"datasets": {"web": {"source": "raw", "text_key": "x/../../../../evil"}}},
        "datasets.web.text_key: bad value 'x/../../../../evil'; expected a key usable in a file "
        "name (this one contains a slash or backslash)",
    ),
    "text_key '..'": (
        {"datasets": {"web": {"source": "raw", "text_key": ".."}}},
        "datasets.web.text_key: bad value '..'; expected a key usable in a file name (this one "
        "is '..')",
    ),
    "text_key with a backslash": (
        {"datasets": {"web": {"source": "raw", "text_key": "a\\b"}}},
        "datasets.web.text_key: bad value 'a\\\\b'; expected a key usable in a file name (this "
        "one contains a slash or backslash)",
    ),
    "text_key with a control character": (
        {"datasets": {"web": {"source": "raw", "text_key": "te\x1bxt"}}},
        "datasets.web.text_key: bad value 'te\\x1bxt'; expected a key usable in a file name "
        "(this one contains a control character)",
    ),
    "text_key with NUL": (
        {"datasets": {"web": {"source": "raw", "text_key": "te\0xt"}}},
        "datasets.web.text_key: bad value 'te\\x00xt'; expected a string without NUL characters",
    ),
}


@pytest.mark.parametrize("case", RECIPE_CASES)
def test_hostile_recipe_values_are_refused(tmp_path: Path, case: str) -> None:
    sections, message = RECIPE_CASES[case]
    path = tmp_path / "project" / "recipe.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({**GOOD, **sections}, sort_keys=False), encoding="utf-8")
    refused_api(lambda: load_recipe(path), tmp_path, f"{path}: {message}")


def test_text_key_must_be_one_file_name_part(tmp_path: Path) -> None:
    """Other JSON keys (spaces, dots, unicode) load and name files; a text key that is not one
    file-name part never becomes a storage path, even in a config built without the loader."""
    path = tmp_path / "recipe.yaml"
    for key in ("body text", "meta.text", ".text", "texte_é"):
        datasets = {**GOOD["datasets"], "web": {"source": "raw/web", "text_key": key}}
        path.write_text(yaml.safe_dump({**GOOD, "datasets": datasets}), encoding="utf-8")
        assert load_recipe(path).dataset("web").text_key == key
        storage = StorageResource(root=str(tmp_path / "out"))
        version = "ab" * 32
        assert (
            layout.merged_prefix("web", key, version) == f"merged/web/{'ab' * 8}/web_{key}_document"
        )
        assert (
            storage.tokens_prefix("web", "s0", key)
            == tmp_path / f"out/tokens/web/s0_{key}_document"
        )
    storage = StorageResource(root=str(tmp_path / "out"))
    message = "text_key 'x/../../evil' contains a slash or backslash; it is part of the file names"
    refused_api(lambda: storage.merged_prefix("web", "x/../../evil"), tmp_path, message)
    refused_api(lambda: storage.tokens_prefix("web", "s0", "x/../../evil"), tmp_path, message)


def test_non_utf8_recipe_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"datasets:\n  web: {source: \xff\xfe}\n")
    refused_api(lambda: load_recipe(path), tmp_path, f"{path}: not UTF-8 text")


# -- blend weights, sequence lengths, sample counts -----------------------------------------------
@pytest.mark.parametrize(
    ("weights", "shown"),
    [
        ({"a": -1.0, "b": 1.0}, "{'a': -1.0, 'b': 1.0}"),
        ({"a": NAN, "b": 1.0}, "{'a': nan, 'b': 1.0}"),
        ({"a": INF, "b": 1.0}, "{'a': inf, 'b': 1.0}"),
        ({"a": 0.0, "b": 0.0}, "{'a': 0.0, 'b': 0.0}"),
    ],
)
def test_hostile_weights_are_refused(
    root: Path, weights: dict[str, float], shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    message = f"weights must be finite, >= 0 and not all 0, got {shown}"
    refused_api(lambda: blend_api(root, weights=weights), root.parent, message)
    flags = [f"--weight={name}={value}" for name, value in weights.items()]
    refused_cli(blend_argv(root, *flags), capsys, root.parent, message)


@pytest.mark.parametrize("temperature", [NAN, INF, -1.0, 0.0])
def test_hostile_temperatures_are_refused(
    root: Path, temperature: float, capsys: pytest.CaptureFixture[str]
) -> None:
    message = f"temperature must be > 0, got {temperature}"
    refused_api(
        lambda: blend_api(root, weights=None, temperature=temperature), root.parent, message
    )
    argv = blend_argv(root, f"--temperature={temperature}")
    refused_cli(argv, capsys, root.parent, message)


@pytest.mark.parametrize("length", [1, 0, -4])
def test_sequence_length_below_two_is_refused(
    root: Path, length: int, capsys: pytest.CaptureFixture[str]
) -> None:
    message = f"sequence_length must be >= 2, got {length}"
    refused_api(lambda: blend_api(root, sequence_length=length), root.parent, message)
    refused_api(
        lambda: build_or_load(
            root / "merged/a", root / "cache", "train", NanosetSettings(sequence_length=length)
        ),
        root.parent,
        message,
    )
    weights = ["--weight", "a=1", "--weight", "b=1"]
    refused_cli(
        blend_argv(root, *weights, "--sequence-length", str(length)), capsys, root.parent, message
    )
    refused_cli(index_argv(root, "--sequence-length", str(length)), capsys, root.parent, message)


@pytest.mark.parametrize("flag", ["--train-samples", "--valid-samples", "--test-samples"])
def test_zero_samples_are_refused(
    root: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    setting = flag[2:].replace("-", "_")
    message = f"{setting} must be an integer >= 1, got 0"
    refused_api(lambda: blend_api(root, **{setting: 0}), root.parent, message)
    weights = ["--weight", "a=1", "--weight", "b=1"]
    refused_cli(blend_argv(root, *weights, flag, "0"), capsys, root.parent, message)
    if flag == "--train-samples":
        refused_cli(
            index_argv(root, flag, "0"),
            capsys,
            root.parent,
            "--train-samples must be >= 1 (omit it for one epoch), got 0",
        )


@pytest.mark.parametrize("flag", ["add_extra_token", "drop_last_partial_validation"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_non_boolean_sample_flags_are_refused(root: Path, flag: str, value: object) -> None:
    message = f"{flag} must be true or false, got {value!r}"
    refused_api(lambda: blend_api(root, **{flag: value}), root.parent, message)


@pytest.mark.parametrize("flag", ["--no-add-extra-token", "--no-drop-last-partial-validation"])
def test_nanotron_refuses_turning_a_sample_flag_off(
    root: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = ["--weight", "a=1", "--weight", "b=1", "--semantics", "nanotron"]
    message = "nanotron semantics always adds the extra token and drops the last partial sample"
    refused_cli(blend_argv(root, *weights, flag), capsys, root.parent, message)


@pytest.mark.parametrize("target", ["../b/x", "/etc/passwd"])
def test_dataset_pointer_leaving_its_folder_is_refused(
    root: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--dataset NAME=merged/<ds>`` follows ``current.json`` only inside its folder."""
    pointer = root / "merged/c/current.json"
    pointer.parent.mkdir(parents=True)
    pointer.write_text(json.dumps({"format_version": 1, "version": "c" * 64, "target": target}))
    before = snapshot(root.parent)
    argv = blend_argv(root, "--weight", "a=1", "--weight", "b=1")
    argv[argv.index(f"b={root / 'merged/b'}")] = f"b={root / 'merged/c'}"
    assert main(argv) == 1
    assert f"{target!r} leaves the pointer's folder" in capsys.readouterr().err
    assert snapshot(root.parent) == before


def test_index_api_reads_zero_samples_as_megatron_does(root: Path) -> None:
    """``num_samples=0`` is a minimum, as in Megatron (a blend asks a zero-weight dataset's index
    for 0 samples): one epoch, the same arrays as ``None``; only the CLI refuses a literal 0."""
    zero = build_or_load(
        root / "merged/a", root / "c", "train", NanosetSettings(sequence_length=8), 0
    )
    epoch = build_or_load(
        root / "merged/a", root / "c", "train", NanosetSettings(sequence_length=8)
    )
    assert zero is not None and epoch is not None and zero.cache_hash != epoch.cache_hash
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(zero, name), getattr(epoch, name))


# -- partition keys, S3 object names, pulled paths ------------------------------------------------
HOSTILE_NAMES = {
    "a..b.jsonl": "it contains '..'",
    ".hidden.jsonl": "it starts with '.'",
    "back\\slash.jsonl": "it contains a slash",
    "bell\x07.jsonl": "it contains a control character",
    "esc\x1b[31m.jsonl": "it contains a control character",
    "rtl\u202egpj.jsonl": "it contains a control character",
}


def _dataset(source: str) -> DatasetConfig:
    return DatasetConfig(name="web", source=source)


def test_hostile_shard_names_never_become_partitions(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in [*HOSTILE_NAMES, "ok.jsonl"]:
        (source / name).write_text('{"text": "x"}\n')
    listing = list_shards(_dataset(str(source)))
    assert list(listing.shards) == ["ok"]
    for name, reason in HOSTILE_NAMES.items():
        assert any(r.startswith(f"{source / name}: ") and reason in r for r in listing.rejected)


def test_hostile_s3_object_names_never_become_partitions(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {
        **HOSTILE_NAMES,
        "sub/nested.jsonl": "it contains a slash",
        "../up.jsonl": "it contains '..'",
        "/abs.jsonl": "it contains a slash",
    }
    objects = [S3Object(f"in/{n}", 10, f"e{i}") for i, n in enumerate(names)]
    objects.append(S3Object("in/ok.jsonl", 10, "e-ok"))
    monkeypatch.setattr(assets.support.sources, "shared_client", lambda endpoint: object())
    monkeypatch.setattr(
        assets.support.sources, "list_objects", lambda client, b, prefix, recursive: objects
    )
    listing = list_shards(_dataset("s3://bucket/in"))
    assert list(listing.shards) == ["ok"]
    assert listing.shards["ok"].uri == "s3://bucket/in/ok.jsonl"
    for name, reason in names.items():
        hits = [r for r in listing.rejected if r.startswith(f"s3://bucket/in/{name}: ")]
        assert len(hits) == 1 and reason in hits[0], (name, listing.rejected)


HOSTILE_KEYS = ["../escape", "..", "/tmp/abs", "a/b", "back\\slash", "ctl\x07", ".hidden"]


def test_hostile_partition_keys_write_nothing(make_recipe: Callable[..., Recipe]) -> None:
    """Keys added to the instance by hand (UI, API) reach the shard assets: each run fails naming
    the key, and nothing is written outside (or, for these keys, inside) the storage root."""
    recipe = make_recipe()
    storage_root = Path(recipe.storage.root)
    project = recipe.path.parent
    assets = {a.key: a for a in build_assets(recipe)[0]}
    resources = resources_for(recipe)
    before = snapshot(project)
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions(partitions_name("docs"), HOSTILE_KEYS)
        for stage in ("raw_jsonl", "hf_dataset", "tokens"):
            asset = assets[AssetKey(["docs", stage])]
            for key in HOSTILE_KEYS:
                with (
                    pytest.raises(TokenmillError) as err,
                    build_asset_context(
                        resources=resources, instance=instance, partition_key=key
                    ) as context,
                ):
                    asset(context)
                assert f"partition key {key!r} rejected: " in str(err.value), (stage, key)
    after = snapshot(project)
    outside = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    inside = storage_root.relative_to(project).as_posix()
    assert all(k == inside or k.startswith(f"{inside}/") for k in outside)
    assert not any(".." in p.name or "\x07" in p.name for p in storage_root.rglob("*"))


@pytest.mark.parametrize("bad", ["train-dataset_index.npy\n", "x\x7f.npy", "../merged/\x1b.bin"])
def test_pull_refuses_control_characters(root: Path, bad: str) -> None:
    blend_api(root)
    mpath = root / "blends/x/manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["splits"]["train"]["files"]["dataset_index"]["path"] = bad
    mpath.write_text(json.dumps(manifest))
    before = snapshot(root.parent)
    with pytest.raises(FormatError) as err:
        pull(str(mpath), root.parent / "dest", progress=False)
    assert f"path: {bad!r} has a control character; refusing to pull" in str(err.value)
    assert snapshot(root.parent) == before


# Relative parts of keys below an S3 storage root that could land outside a local folder (or two
# keys on one file), with the reason given.
HOSTILE_ROOT_KEYS = {
    "tokens/docs/../../../escaped.json": "has a part that is '..'",
    "tokens/docs/..\\..\\escaped.json": "has a part that contains a slash or backslash",
    "tokens/docs/bell\x07.json": "has a part that contains a control character",
    "tokens/docs//a.json": "has a part that is empty",
    "tokens/docs/./a.json": "has a part that is '.'",
    "tokens/docs/": "has a part that is empty",  # a console's "folder" marker
}


def refused_key(bucket: str, name: str) -> str:
    """The error for ``s3://bucket/root/<name>``."""
    uri, problem = f"s3://{bucket}/root/{name}", HOSTILE_ROOT_KEYS[name]
    return f"{uri!r}: its key below 's3://{bucket}/root/' {problem}; refusing to copy it locally"


@pytest.mark.parametrize("name", HOSTILE_ROOT_KEYS)
def test_hostile_s3_keys_never_reach_a_work_directory(s3: S3, tmp_path: Path, name: str) -> None:
    """Such a key in our own root is corruption: the stage refuses it, naming the object and the
    reason, before downloading anything (``../../../escaped.json`` would land in ``tmp_path``)."""
    for key in ("root/tokens/docs/a_text_document.bin", f"root/{name}"):
        s3.client.put_object(Bucket=s3.bucket, Key=key, Body=b"{}")
    local = tmp_path / "work" / "root"
    stage = S3Stage(shared_client(s3.endpoint), s3.bucket, "root", local)
    before = snapshot(tmp_path)
    with pytest.raises(InputError) as err:
        stage.fetch(["tokens/"])
    assert str(err.value) == refused_key(s3.bucket, name)
    assert snapshot(tmp_path) == before and not stage.fetched


@pytest.mark.parametrize(
    ("key", "problem"), [("root//etc/passwd", "is absolute"), ("root/", "is empty")]
)
def test_local_name_refuses_what_listing_cannot_reach(key: str, problem: str) -> None:
    """An absolute or empty relative part (no listing of ours returns one) is refused too."""
    with pytest.raises(InputError) as err:
        local_name("bkt", key, "root/")
    assert str(err.value) == (
        f"'s3://bkt/{key}': its key below 's3://bkt/root/' {problem}; refusing to copy it locally"
    )
