"""``NanosetSettings`` and ``BlendSettings``: the recipe and the CLI make them, and a blend and a
lone index built from one value agree."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tiny_pairs import random_dataset

from tokenmill.commands import blend as blend_command
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.growing import ERA_SAMPLES
from tokenmill.indices.nanoset import SPLITS, build_or_load, entry_key, index_version
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.recipe import BlendConfig, NanosetConfig


def test_the_recipe_model_makes_the_settings_value() -> None:
    cfg = NanosetConfig.model_validate(
        {"sequence_length": 16, "split": "90,5,5", "seed": 7, "train_samples": 100,
         "add_extra_token": False, "drop_last_partial_validation": False}
    )  # fmt: skip
    assert cfg.settings() == NanosetSettings(
        sequence_length=16, split_spec="90,5,5", seed=7, train_samples=100,
        add_extra_token=False, drop_last_partial_validation=False,
    )  # fmt: skip


def test_the_validation_flag_applies_to_valid_only() -> None:
    settings = NanosetSettings(sequence_length=8, drop_last_partial_validation=False)
    keys = [entry_key(1000, "h", s, settings) for s in ("train", "valid", "test")]
    assert [k[0]["drop_last_partial"] for k in keys if k] == [True, False, True]
    assert "era_samples" not in keys[0][0]  # type: ignore[index]  # no part of a megatron key
    growing = NanosetSettings(sequence_length=8, semantics="growing")
    key = entry_key(100, "h", "train", growing, shards=[("a", 100)])
    assert key is not None and key[0]["era_samples"] == ERA_SAMPLES


def test_the_recipe_blend_model_makes_the_blend_value() -> None:
    nanoset = NanosetSettings(sequence_length=16, train_samples=100)
    weighted = BlendConfig.model_validate({"name": "mix", "weights": {"a": 3, "b": 1}})
    assert weighted.settings(nanoset) == BlendSettings(nanoset, weights={"a": 3.0, "b": 1.0})
    tempered = BlendConfig.model_validate({"name": "mix", "datasets": ["a"], "temperature": 2})
    assert tempered.settings(nanoset) == BlendSettings(nanoset, temperature=2.0)


def test_the_cli_makes_the_value_the_recipe_makes() -> None:
    parser = argparse.ArgumentParser()
    blend_command.register(parser.add_subparsers())
    args = parser.parse_args(
        ["blend", "--dataset", "a=x", "--dataset", "b=y", "--weight", "a=3", "--weight", "b=1",
         "--output", "out", "--sequence-length", "16", "--split", "90,5,5", "--seed", "7",
         "--train-samples", "100", "--no-drop-last-partial-validation"]
    )  # fmt: skip
    cfg = NanosetConfig.model_validate(
        {"sequence_length": 16, "split": "90,5,5", "seed": 7, "train_samples": 100,
         "drop_last_partial_validation": False}
    )  # fmt: skip
    blend = BlendConfig.model_validate({"name": "out", "weights": {"a": 3, "b": 1}})
    assert blend_command._settings(args) == blend.settings(cfg.settings())


def test_blend_weights_are_a_read_only_copy() -> None:
    weights = {"a": 1.0}
    settings = BlendSettings(NanosetSettings(sequence_length=8), weights=weights)
    weights["a"] = 2.0
    assert settings.weights == {"a": 1.0}
    with pytest.raises(TypeError):
        settings.weights["a"] = 3.0  # type: ignore[index]


def test_a_blend_and_a_lone_index_from_one_value_share_the_cache_entry(tmp_path: Path) -> None:
    """Non-default flags: the blend's valid index is the entry ``build_or_load`` finds with the
    same value's keywords (one epoch, the last partial sample kept)."""
    prefix = random_dataset(tmp_path / "merged/docs_text_document", 80, seed=3)
    settings = NanosetSettings(
        sequence_length=8, split_spec="80,20,0", train_samples=30,
        add_extra_token=False, drop_last_partial_validation=False,
    )  # fmt: skip
    manifest = build_blend(
        "mix", {"docs": prefix}, tmp_path / "blends/mix", tmp_path / "nanoset",
        BlendSettings(settings, weights={"docs": 1.0}),
    )  # fmt: skip
    recorded = manifest["splits"]["valid"]["datasets"][0]["index"]["cache_hash"]
    lone = build_or_load(prefix, tmp_path / "nanoset", "valid", settings, None, build=False)
    assert lone is not None and lone.cache_hash == recorded
    assert lone.description["key"]["drop_last_partial"] is False


def test_the_index_version_moves_with_the_entry_keys() -> None:
    """``index_version`` (the nanoset data version) changes exactly when a split's entry key
    would: the era size is no part of a megatron key, a seed or the valid flag is."""
    base = NanosetSettings(sequence_length=8, train_samples=50)

    def both(settings: NanosetSettings) -> tuple[object, str]:
        keys = [entry_key(1000, "h", s, settings, settings.sizes()[s]) for s in SPLITS]
        return keys, index_version("v", settings, settings.index_sizes())

    same = both(base)
    assert both(NanosetSettings(sequence_length=8, train_samples=50, era_samples=3)) == same
    for change in ({"seed": 7}, {"drop_last_partial_validation": False}, {"train_samples": 51}):
        keys, version = both(
            NanosetSettings(**{"sequence_length": 8, "train_samples": 50, **change})
        )
        assert keys != same[0] and version != same[1]
    assert index_version("w", base, base.index_sizes()) != same[1]  # another dataset version
