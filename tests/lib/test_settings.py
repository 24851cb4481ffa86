"""``NanosetSettings``: the recipe makes it, and a blend and a lone index built from it agree."""

from __future__ import annotations

from pathlib import Path

from tiny_pairs import random_dataset

from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.growing import ERA_SAMPLES
from tokenmill.indices.nanoset import build_or_load
from tokenmill.indices.settings import NanosetSettings
from tokenmill.recipe import NanosetConfig


def test_the_recipe_model_makes_the_settings_value() -> None:
    cfg = NanosetConfig.model_validate(
        {"sequence_length": 16, "split": "90,5,5", "seed": 7, "train_samples": 100,
         "add_extra_token": False, "drop_last_partial_validation": False}
    )  # fmt: skip
    assert cfg.settings() == NanosetSettings(
        sequence_length=16, split_spec="90,5,5", seed=7, train_samples=100,
        add_extra_token=False, drop_last_partial_validation=False,
    )  # fmt: skip


def test_index_keywords_apply_the_validation_flag_to_valid_only() -> None:
    settings = NanosetSettings(sequence_length=8, drop_last_partial_validation=False)
    drops = [settings.index_keywords(s)["drop_last_partial"] for s in ("train", "valid", "test")]
    assert drops == [True, False, True]
    assert "era_samples" not in settings.index_keywords("train")  # no part of a megatron key
    growing = NanosetSettings(sequence_length=8, semantics="growing")
    assert growing.index_keywords("train")["era_samples"] == ERA_SAMPLES


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
        weights={"docs": 1.0}, **settings.blend_keywords(),
    )  # fmt: skip
    recorded = manifest["splits"]["valid"]["datasets"][0]["index"]["cache_hash"]
    lone = build_or_load(
        prefix, tmp_path / "nanoset", num_samples=None, build=False,
        **settings.index_keywords("valid"),
    )  # fmt: skip
    assert lone is not None and lone.cache_hash == recorded
    assert lone.description["key"]["drop_last_partial"] is False
