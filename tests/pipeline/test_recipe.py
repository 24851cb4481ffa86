"""Recipes: a good one loads into frozen models; every bad field names file, field, value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from assets.support.staleness import blend_data_version, nanoset_data_version
from tokenmill.errors import ConfigError
from tokenmill.indices.blend_versioning import blend_data_version as library_blend_version
from tokenmill.indices.nanoset import index_version
from tokenmill.recipe import (
    DatasetConfig,
    NanosetConfig,
    ScheduleConfig,
    TokenizerConfig,
    load_recipe,
    parse_recipe,
    recipe_path,
)

ROOT = Path(__file__).resolve().parents[2]
GOOD: dict[str, Any] = {
    "storage": {"root": "out"},
    "tokenizer": {"path": "tok"},
    "datasets": {
        "web": {"source": "raw/web"},
        "code": {"source": "raw/code", "text_key": "content"},
    },
    "nanoset": {"train_samples": 10},
    "blends": {"mix": {"weights": {"web": 3, "code": 1}}, "hot": {"temperature": 2}},
}


def bad(tmp_path: Path, **sections: Any) -> str:
    """The ConfigError message for GOOD with ``sections`` replaced."""
    data = {**GOOD, **sections}
    with pytest.raises(ConfigError) as info:
        parse_recipe(data, tmp_path / "r.yaml")
    return str(info.value)


def test_good_recipe_resolves_paths_and_defaults(tmp_path: Path) -> None:
    recipe = parse_recipe(GOOD, tmp_path / "r.yaml")
    assert recipe.storage.root == str(tmp_path / "out")
    assert recipe.tokenizer.path == str(tmp_path / "tok") and recipe.tokenizer.append_eod
    assert recipe.dataset("code") == DatasetConfig(
        name="code", source=str(tmp_path / "raw/code"), text_key="content"
    )
    assert recipe.nanoset.semantics == "megatron" and recipe.nanoset.split == "949,50,1"
    assert recipe.nanoset.add_extra_token and recipe.nanoset.drop_last_partial_validation
    assert recipe.blends[0].weight_map() == {"web": 3.0, "code": 1.0}
    assert recipe.blends[1].datasets == ("web", "code") and recipe.blends[1].temperature == 2.0
    with pytest.raises(ValidationError, match="frozen"):
        recipe.nanoset.seed = 1  # type: ignore[misc]
    again = parse_recipe(GOOD, tmp_path / "r.yaml")
    assert again == recipe and hash(again) == hash(recipe)


def test_megatron_flags_are_read(tmp_path: Path) -> None:
    flags = {"add_extra_token": False, "drop_last_partial_validation": False}
    recipe = parse_recipe({**GOOD, "nanoset": {"train_samples": 10, **flags}}, tmp_path / "r.yaml")
    assert recipe.nanoset.add_extra_token is False
    assert recipe.nanoset.drop_last_partial_validation is False


def test_base_dir_is_relative_to_the_recipe(tmp_path: Path) -> None:
    (tmp_path / "recipes").mkdir()
    path = tmp_path / "recipes" / "r.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "base_dir": ".."}), encoding="utf-8")
    assert load_recipe(path).storage.root == str(tmp_path / "out")


def test_shipped_recipes_load() -> None:
    demo = load_recipe(ROOT / "recipes" / "demo.yaml")
    assert [ds.name for ds in demo.datasets] == ["docs", "code"]
    assert demo.storage.root == str(ROOT / "data")
    example = load_recipe(ROOT / "recipes" / "example-temperature.yaml")
    assert example.schedules.reprocess is None and example.nanoset.semantics == "nanotron"
    growing = load_recipe(ROOT / "recipes" / "example-growing.yaml")
    assert growing.nanoset.semantics == "growing" and growing.nanoset.train_samples is None


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"nanoset": {"semantics": "gpt"}},
            "nanoset.semantics: bad value 'gpt'; expected one of megatron, nanotron",
        ),
        (
            {"nanoset": {"sequence_length": 0}},
            "nanoset.sequence_length: bad value 0; expected an integer >= 2",
        ),
        (
            {"nanoset": {"split": "90,10"}},
            "nanoset.split: bad value '90,10'; expected three non-negative numbers",
        ),
        (
            {"nanoset": {"seqlen": 5}},
            "nanoset.seqlen: unknown field, value 5; expected one of semantics, sequence_length",
        ),
        (
            {"datasets": {"Web": {"source": "x"}}},
            "datasets.Web: bad name 'Web'; expected lower-case letters",
        ),
        (
            {"datasets": {"blend": {"source": "x"}}},
            "datasets.blend: bad name 'blend'",
        ),
        (
            {"datasets": {"web": {"source": "x", "on_bad_record": "skip"}}},
            "datasets.web.on_bad_record: bad value 'skip'; expected one of fail, quarantine",
        ),
        (
            {"datasets": {"web": {"source": "out/raw/web"}}},
            "datasets.web.source: ",
        ),
        ({"datasets": {}}, "datasets: bad value {}; expected a mapping {name: {source: ...}}"),
        (
            {"blends": {"mix": {"weights": {"web": 1, "books": 1}}}},
            "blends.mix.weights: unknown dataset 'books'; expected a dataset of this recipe "
            "(web, code)",
        ),
        (
            {"blends": {"mix": {"weights": {"web": -1, "code": 1}}}},
            "blends.mix.weights.web: bad value -1; expected a finite number >= 0",
        ),
        (
            {"blends": {"mix": {"weights": {"web": 1}, "temperature": 2}}},
            "blends.mix: bad value {'weights': {'web': 1}, 'temperature': 2}; expected exactly one",
        ),
        (
            {"blends": {"mix": {"temperature": 0}}},
            "blends.mix.temperature: bad value 0; expected a finite number > 0",
        ),
        (
            {"schedules": {"refresh": "every night"}},
            "schedules.refresh: bad value 'every night'; expected a 5-field cron string",
        ),
        (
            {"schedules": {"refresh_interval_minutes": 7}},
            "schedules.refresh_interval_minutes: bad value 7; expected minutes dividing 60",
        ),
        (
            {"schedules": {"refresh_interval_minutes": 0}},
            "schedules.refresh_interval_minutes: bad value 0; expected minutes dividing 60",
        ),
        (
            {"nanoset": {}},
            "nanoset.train_samples: bad value None; expected an integer >= 1 (a blend needs",
        ),
        (
            {"nanoset": {"train_samples": 10, "add_extra_token": "no"}},
            "nanoset.add_extra_token: bad value 'no'; expected true or false",
        ),
        (
            {"nanoset": {"train_samples": 10, "drop_last_partial_validation": 0}},
            "nanoset.drop_last_partial_validation: bad value 0; expected true or false",
        ),
        (
            {"nanoset": {"train_samples": 10, "semantics": "nanotron", "add_extra_token": False}},
            "nanoset.add_extra_token: bad value False; expected true with semantics nanotron",
        ),
        ({"tokenizer": {"path": ""}}, "tokenizer.path: bad value ''; expected a non-empty string"),
        # rules the index and blend builders enforce, checked at load (issue 21)
        (
            {"blends": {"mix": {"weights": {"web": 1, "code": 0}}}},
            "blends.mix.weights.code: bad value 0.0; expected a weight > 0 with "
            "nanoset.semantics megatron",
        ),
        (
            {"nanoset": {"train_samples": 10, "seed": 2**32}},
            "nanoset.seed: bad value 4294967296; expected an integer from 0 to 4294967295",
        ),
        (
            {"nanoset": {"train_samples": 10, "split": "100,0,0", "valid_samples": 5}},
            "nanoset.valid_samples: bad value 5; expected null (split '100,0,0' gives the valid "
            "split no share)",
        ),
        (
            {"nanoset": {"train_samples": 10, "split": "0,1,1"}},
            "nanoset.split: bad value '0,1,1'; expected a positive train share (a blend needs",
        ),
        (
            {"blends": {}, "nanoset": {"train_samples": 4, "split": "0,1,1"}},
            "nanoset.train_samples: bad value 4; expected null (split '0,1,1' gives the train",
        ),
        (
            {"datasets": {"web": {"source": "raw", "max_quarantine_fraction": 1.5}}},
            "datasets.web.max_quarantine_fraction: bad value 1.5; expected a number from 0 to 1",
        ),
        (
            {"blends": {"mix": {"weights": {"web": 1}, "allow_empty_splits": "yes"}}},
            "blends.mix.allow_empty_splits: bad value 'yes'; expected true or false",
        ),
    ],
)
def test_bad_fields_name_file_field_value_and_allowed(
    tmp_path: Path, sections: dict[str, Any], message: str
) -> None:
    text = bad(tmp_path, **sections)
    assert text.startswith(f"{tmp_path / 'r.yaml'}: "), text
    assert message in text, text


def test_source_inside_the_storage_stages_is_refused(tmp_path: Path) -> None:
    text = bad(tmp_path, datasets={"web": {"source": "out/raw/web"}})
    assert f"{tmp_path / 'out' / 'raw'}, where tokenmill writes artifacts" in text


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the recipe"):
        load_recipe(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("datasets: [unclosed", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML"):
        load_recipe(broken)


def test_recipe_path_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_RECIPE", raising=False)
    assert recipe_path(root=tmp_path) == tmp_path / "recipes" / "demo.yaml"
    monkeypatch.setenv("TOKENMILL_RECIPE", "other.yaml")
    assert recipe_path(root=tmp_path) == tmp_path / "other.yaml"
    assert recipe_path("/abs/x.yaml", root=tmp_path) == Path("/abs/x.yaml")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (["datasets"], "recipe: bad value ['datasets']; expected a mapping of fields"),
        ({**GOOD, "blend": {}}, "blend: unknown field, value {}; expected one of base_dir,"),
        ({**GOOD, "nanoset": [1]}, "nanoset: bad value [1]; expected a mapping of fields"),
        (
            {**GOOD, "datasets": {"web": "raw/web"}},
            "datasets.web: bad value 'raw/web'; expected a mapping of fields",
        ),
        (  # an entry named like a field is still an entry
            {**GOOD, "datasets": {"text_key": "raw/web"}},
            "datasets.text_key: bad value 'raw/web'; expected a mapping of fields",
        ),
        (
            {**GOOD, "datasets": {"web": {"text_key": "t"}}},
            "datasets.web.source: bad value None; expected a non-empty string",
        ),
        (
            {**GOOD, "tokenizer": {"path": "tok", "workers": True}},
            "tokenizer.workers: bad value True; expected an integer >= 1",
        ),
        (
            {**GOOD, "blends": {"mix": {"temperature": 1, "datasets": ["web", "web"]}}},
            "blends.mix.datasets: bad value ['web', 'web']; expected a non-empty list of distinct",
        ),
        (
            {**GOOD, "blends": {"mix": {"weights": {"web": 1}, "datasets": ["web"]}}},
            "blends.mix.datasets: bad value ['web']; expected no 'datasets' beside 'weights'",
        ),
        (
            {**GOOD, "datasets": {"web": {"source": "x", "glob": "a/*.jsonl"}}},
            "datasets.web.glob: bad value 'a/*.jsonl'; expected a file-name pattern without",
        ),
        (
            {**GOOD, "storage": {"root": "out", "s3_endpoint_url": ""}},
            "storage.s3_endpoint_url: bad value ''; expected a non-empty string",
        ),
        (  # pydantic's own checks read the same way
            {**GOOD, "blends": {"mix": {"temperature": 1, "datasets": ["web", 7]}}},
            "blends.mix.datasets.1: bad value 7; expected a valid string",
        ),
        (  # a name or the file's path come from the YAML key and the file, never a field
            {**GOOD, "datasets": {"web": {"source": "x", "name": "y"}}},
            "datasets.web.name: unknown field, value 'y'; expected one of source, text_key,",
        ),
        ({**GOOD, "path": "x"}, "path: unknown field, value 'x'; expected one of base_dir,"),
        (
            {**GOOD, "storage": {"root": "s3://"}},
            "storage.root: bad value 's3://'; expected s3://bucket[/prefix] or a local directory",
        ),
    ],
)
def test_shape_errors_name_the_field(tmp_path: Path, data: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_recipe(data, tmp_path / "r.yaml")
    assert str(info.value).startswith(f"{tmp_path / 'r.yaml'}: {message}"), str(info.value)


def test_every_problem_is_reported_one_per_line(tmp_path: Path) -> None:
    """Unlike a first-error-only reader, all independent problems come at once."""
    nanoset = {"train_samples": 10, "sequence_length": 1, "seed": -1, "split": "1,1"}
    text = bad(tmp_path, nanoset=nanoset, tokenizer={"path": "tok", "append_eod": "yes"})
    path = tmp_path / "r.yaml"
    assert text.splitlines() == [
        f"{path}: tokenizer.append_eod: bad value 'yes'; expected true or false",
        f"{path}: nanoset.sequence_length: bad value 1; expected an integer >= 2",
        f"{path}: nanoset.split: bad value '1,1'; expected three non-negative numbers "
        '"train,valid,test" with a positive sum',
        f"{path}: nanoset.seed: bad value -1; expected an integer >= 0",
    ]


def test_zero_weights_pass_under_nanotron_and_new_settings_keep_versions(tmp_path: Path) -> None:
    """nanotron blends accept a 0 weight; ``allow_empty_splits`` changes no blend byte, so it
    stays out of the data version (``model_dump``)."""
    nanotron = {"semantics": "nanotron", "train_samples": 10}
    data = {**GOOD, "nanoset": nanotron, "blends": {"mix": {"weights": {"web": 1, "code": 0}}}}
    assert parse_recipe(data, tmp_path / "r.yaml").blends[0].weights == (1.0, 0.0)
    allowed = {"mix": {"weights": {"web": 1}, "allow_empty_splits": True}}
    [blend] = parse_recipe({**GOOD, "blends": allowed}, tmp_path / "r.yaml").blends
    assert blend.allow_empty_splits and "allow_empty_splits" not in blend.model_dump()


def test_defaults_match_the_config_classes(tmp_path: Path) -> None:
    """A recipe that says nothing optional gets exactly the config classes' defaults."""
    minimal = {"tokenizer": {"path": "tok"}, "datasets": {"web": {"source": "raw"}}}
    recipe = parse_recipe(minimal, tmp_path / "r.yaml")
    assert recipe.nanoset == NanosetConfig() and recipe.schedules == ScheduleConfig()
    assert recipe.storage.root == str(tmp_path / "data") and recipe.blends == ()
    assert recipe.tokenizer == TokenizerConfig(path=str(tmp_path / "tok"))
    hf = parse_recipe({**minimal, "datasets": {"w": {"source": "r", "format": "hf"}}}, "r.yaml")
    assert hf.datasets[0].glob == "*" and hf.datasets[0].shard_suffixes == (".parquet", ".arrow")


def test_data_versions_are_the_library_versions() -> None:
    """Nanoset and blend data versions are the library's own (``nanoset.index_version``,
    ``blend_versioning.blend_data_version``) of the recipe's settings values; pinned, so a
    change to them (every index and blend looking stale after an upgrade) is deliberate."""
    expected = {
        "demo.yaml": (
            "ac694d51dd394b11a97396feef392d8312444c34b45faa9b69645f16e52b5ce4",
            {"demo": "9ad48e85ec1c732e59834babc0ddafb1ab63dc940a864bc88bc74fe05cadf234"},
        ),
        "example-temperature.yaml": (
            "92cb7558284a66d492be7edc852581332ef6896e85de34121c6277b356e6cb93",
            {
                "balanced": "66053d8f06fc633234b07e4cd5e0dc52153836eb477fb0dd854f623483de7b29",
                "mostly_web": "b612d4b7c526ba8e374de09a52a0bd9cceb1cc882025aa950ef30d40d635069a",
            },
        ),
    }
    for name, (nanoset_version, blend_versions) in expected.items():
        recipe = load_recipe(ROOT / "recipes" / name)
        settings = recipe.nanoset.settings()
        assert nanoset_data_version("ab" * 32, recipe.nanoset) == nanoset_version
        assert index_version("ab" * 32, settings, settings.index_sizes()) == nanoset_version
        members = {b.name: [(d, "cd" * 32) for d in b.datasets] for b in recipe.blends}
        got = {
            b.name: blend_data_version(b, recipe.nanoset, members[b.name]) for b in recipe.blends
        }
        assert got == blend_versions
        library = {
            b.name: library_blend_version(b.settings(settings), members[b.name])
            for b in recipe.blends
        }
        assert library == blend_versions


@pytest.mark.parametrize(
    "change",
    [
        {"sequence_length": 9},
        {"split": "90,5,5"},
        {"seed": 7},
        {"train_samples": 11},
        {"valid_samples": 3},
        {"semantics": "nanotron"},
        {"add_extra_token": False},
        {"drop_last_partial_validation": False},
    ],
)
def test_every_index_setting_changes_the_data_versions(
    tmp_path: Path, change: dict[str, object]
) -> None:
    """An edit of any index setting changes the nanoset and blend data versions (so both look
    stale); ``allow_empty_splits`` (no byte of a blend) changes neither."""
    base = {"train_samples": 10}
    before = parse_recipe({**GOOD, "nanoset": base}, tmp_path / "r.yaml")
    after = parse_recipe({**GOOD, "nanoset": {**base, **change}}, tmp_path / "r.yaml")
    blend = before.blends[0]
    members = [(d, "cd" * 32) for d in blend.datasets]
    assert nanoset_data_version("ab", before.nanoset) != nanoset_data_version("ab", after.nanoset)
    assert blend_data_version(blend, before.nanoset, members) != blend_data_version(
        blend, after.nanoset, members
    )
    allowed = blend.model_copy(update={"allow_empty_splits": True})
    assert blend_data_version(allowed, before.nanoset, members) == blend_data_version(
        blend, before.nanoset, members
    )


@pytest.mark.parametrize(
    ("minutes", "cron"),
    [
        (1, "*/1 * * * *"),
        (5, "*/5 * * * *"),
        (30, "*/30 * * * *"),
        (120, "0 */2 * * *"),
        (1440, "0 0 * * *"),
    ],
)
def test_refresh_interval_is_a_cron_that_ticks_evenly(minutes: int, cron: str) -> None:
    assert ScheduleConfig(refresh_interval_minutes=minutes).refresh_interval_cron == cron


def test_growing_semantics_settings(tmp_path: Path) -> None:
    """growing: era_samples is read (and dumped, so data versions see it), blends need no
    train size, and the partial valid sample cannot be kept; other semantics dump no era."""
    nanoset = {"semantics": "growing", "era_samples": 64, "train_samples": None}
    recipe = parse_recipe({**GOOD, "nanoset": nanoset}, tmp_path / "r.yaml")
    assert recipe.nanoset.era_samples == 64 and recipe.nanoset.train_samples is None
    assert recipe.nanoset.model_dump()["era_samples"] == 64
    assert "era_samples" not in parse_recipe(GOOD, tmp_path / "r.yaml").nanoset.model_dump()
    keep = {**nanoset, "drop_last_partial_validation": False}
    assert "true with semantics growing" in bad(tmp_path, nanoset=keep)
    zero = {**nanoset, "era_samples": 0}
    assert "nanoset.era_samples: bad value 0" in bad(tmp_path, nanoset=zero)
