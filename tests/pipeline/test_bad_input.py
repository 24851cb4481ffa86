"""Systematic bad input stops ``materialize`` (exit 1) with a line naming the likely cause: a
shard whose every line was quarantined (e.g. a wrong ``text_key``), a dataset past its
``max_quarantine_fraction``, a weighted dataset that would vanish from a split of a blend."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dagster import AssetKey, DagsterInstance
from pipeline_project import Documents, MakeRecipe

from assets.support.staleness import recorded_version
from pipelines.materialize import materialize_recipe, preflight
from tokenmill.errors import InputError
from tokenmill.recipe import Recipe

TINY = "sources/tiny"


Materialize = Callable[[Recipe], tuple[int, str]]


@pytest.fixture
def materialize(
    instance: DagsterInstance, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> Materialize:
    """``materialize(recipe)``: ``materialize_recipe`` on the test's instance (home in
    ``tmp_path``); its exit code and what it printed."""

    def run(recipe: Recipe) -> tuple[int, str]:
        code = materialize_recipe(recipe, instance, home=tmp_path)
        return code, capsys.readouterr().out

    return run


def write_jsonl(folder: Path, name: str, records: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_a_wrong_text_key_fails_naming_the_keys_present(
    make_recipe: MakeRecipe, materialize: Materialize, tmp_path: Path, documents: Documents
) -> None:
    make_recipe()  # the tiny corpus first
    records = [{"id": i, "content": d["text"]} for i, d in enumerate(documents["docs"][:6])]
    write_jsonl(tmp_path / "sources" / "web", "web-00000.jsonl", records)
    recipe = make_recipe(
        datasets={"web": {"source": "sources/web", "text_key": "body"}},
        blends={"mix": {"weights": {"docs": 0.7, "web": 0.3}}},
    )
    code, out = materialize(recipe)
    assert code == 1
    line = (
        "FAILED web-00000: web/raw_jsonl check documents_accounted: web-00000: all 6 records "
        "were quarantined: text_key 'body' not found; the first records have keys: content, id"
    )
    assert line in out, out
    assert "blend mix: not built" in out and "Open a blend" not in out


def test_a_dataset_past_its_quarantine_fraction_fails(
    make_recipe: MakeRecipe, materialize: Materialize
) -> None:
    """docs: 3 bad lines of 43 records; the default fraction (0.01) is too small for that."""
    recipe = make_recipe(datasets={"docs": {"source": "sources/docs"}})
    assert recipe.dataset("docs").max_quarantine_fraction == 0.01
    code, out = materialize(recipe)
    assert code == 1
    assert (
        "FAILED docs/merged check quarantine_share: docs: 3 of 43 records quarantined (7.0%), "
        "more than datasets.docs.max_quarantine_fraction 0.01" in out
    ), out
    assert "blend/mix" not in out.split("downstream rebuilt:")[1].splitlines()[0]


@pytest.mark.parametrize("allowed", [False, True])
def test_a_weighted_dataset_that_vanishes_from_a_split_fails_the_blend(
    make_recipe: MakeRecipe,
    materialize: Materialize,
    tmp_path: Path,
    documents: Documents,
    allowed: bool,
) -> None:
    """Two documents split 80,10,10 leave ``tiny`` out of a split: its share would silently
    go to ``docs``, unless the recipe says ``allow_empty_splits``."""
    make_recipe()  # the tiny corpus first
    write_jsonl(tmp_path / TINY, "tiny-00000.jsonl", documents["code"][:2])
    blend: dict[str, Any] = {"weights": {"docs": 0.5, "tiny": 0.5}}
    if allowed:
        blend["allow_empty_splits"] = True
    recipe = make_recipe(datasets={"tiny": {"source": TINY}}, blends={"mix": blend})
    code, out = materialize(recipe)
    if allowed:
        assert code == 0 and "blend mix: train 120" in out, out
        return
    assert code == 1
    assert (
        "FAILED blend/mix: blend mix: weighted datasets would get no sample: tiny from split" in out
    )
    assert "set blends.mix.allow_empty_splits: true" in out
    assert "blend mix: not built" in out and "Open a blend" not in out


def test_s3_preflight_names_a_missing_bucket_before_any_run(
    make_recipe: MakeRecipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    from botocore.exceptions import ClientError

    import pipelines.materialize

    asked = []

    class Client:
        def head_bucket(self, Bucket: str) -> None:
            asked.append(Bucket)
            if Bucket == "gone":
                error = {"Error": {"Code": "NoSuchBucket", "Message": "no such bucket"}}
                raise ClientError(error, "HeadBucket")  # type: ignore[arg-type]

    monkeypatch.setattr(pipelines.materialize, "shared_client", lambda endpoint: Client())
    recipe = make_recipe(storage={"root": "s3://gone/root"})
    with pytest.raises(InputError, match=r"^s3://gone \(storage or a source.*NoSuchBucket"):
        preflight(recipe)
    assert asked == ["gone"]
    preflight(make_recipe())  # local: nothing asked
    assert asked == ["gone"]


def test_a_blend_not_rebuilt_says_which_version_is_still_current(
    make_recipe: MakeRecipe, materialize: Materialize, instance: DagsterInstance
) -> None:
    """After a good run, a shard of bad lines pushes docs past its quarantine fraction: the
    blend is not rebuilt, and the summary says which version training still gets."""
    recipe = make_recipe()
    assert materialize(recipe)[0] == 0
    version = recorded_version(instance, AssetKey(["blend", "mix"]))
    assert version is not None
    good = b'{"text": "A short but real document about parsing arguments."}\n' * 2
    bad = b'{"title": "no text"}\n' * 30
    (Path(recipe.dataset("docs").source) / "bad-00000.jsonl").write_bytes(good + bad)
    code, out = materialize(recipe)
    assert code == 1
    assert "FAILED docs/merged check quarantine_share: docs: 33 of 75 records" in out, out
    blend = out.split("  blend mix: ")[1].splitlines()
    assert blend[1].startswith(f"    NOT rebuilt; current version is still {version[:16]} from ")
    assert "docs/nanoset: NOT rebuilt; current version is still" in out
    assert "Open a blend" not in out
