"""A byte-level BPE ``tokenizer.json`` as tiktoken-style ranks, for the tiktoken and gigatoken
engines (written at first-use verification, beside the record; ``RankFiles`` says where).
"""

from __future__ import annotations

import base64
import io
import itertools
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.atomic import write_bytes
from tokenmill.errors import ConfigError
from tokenmill.tokenize.tokenizer_info import RankFiles


def write_rank_files(spec: dict[str, Any], record_path: Path) -> RankFiles:
    """Cache ``spec`` as tiktoken-style ranks (ConfigError when it has no such form)."""
    pattern, ranks, specials = tiktoken_parts(spec)
    by_id = sorted(ranks.items(), key=lambda item: item[1])
    order = sorted(specials, key=specials.__getitem__)
    lines = b"".join(b"%s %d\n" % (base64.b64encode(tok), r) for r, (tok, _) in enumerate(by_id))
    ids = np.array([i for _, i in by_id] + [specials[s] for s in order], dtype=np.uint32)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    files = RankFiles(
        ranks=record_path.with_suffix(".ranks"),
        ids=record_path.with_suffix(".ids.npy"),
        pattern=pattern,
        scheme=SCHEMES.get(pattern),
        specials=tuple(order),
    )
    write_bytes(files.ranks, lines)
    write_bytes(files.ids, buf.getvalue())
    return files


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + i): b for i, b in enumerate(extra)})
    return table


GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# gigatoken's built-in pre-tokenizers by the regex they implement (others load tokenizer.json).
SCHEMES = {GPT2_PATTERN: "gpt2", TEKKEN_PATTERN: "nemotron", QWEN2_PATTERN: "qwen2"}


def tiktoken_parts(spec: dict[str, Any]) -> tuple[str, dict[bytes, int], dict[str, int]]:
    """``(pattern, ranks, specials)`` when tiktoken can express ``spec``; ConfigError if not."""
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
        raise ConfigError("model is not a deterministic byte-level BPE")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ConfigError("model uses subword prefixes/suffixes")
    if spec.get("normalizer") is not None:
        raise ConfigError(f"normalizer {spec['normalizer'].get('type')} has no tiktoken form")
    last = steps[-1] if steps else {}
    if last.get("type") != "ByteLevel" or last.get("add_prefix_space"):
        raise ConfigError("pre-tokenizer does not end in ByteLevel without a prefix space")
    if len(steps) == 1 and last.get("use_regex", True):
        pattern = GPT2_PATTERN
    elif len(steps) == 2 and not last.get("use_regex", True) and _is_isolated_split(steps[0]):
        pattern = steps[0]["pattern"]["Regex"]
    else:
        raise ConfigError("pre-tokenizer is not ByteLevel or Split(regex, Isolated) + ByteLevel")
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        raise ConfigError("an added token strips whitespace or is single_word")
    specials = {t["content"]: int(t["id"]) for t in added}
    ordered = sorted(specials)
    if any(b.startswith(a) for a, b in itertools.pairwise(ordered)):
        raise ConfigError("an added token is a prefix of another (match order would differ)")
    decode = _byte_decoder()
    vocab = {tok: int(i) for tok, i in model["vocab"].items() if tok not in specials}
    outside = set("".join(vocab)) - decode.keys()
    if outside:
        raise ConfigError(f"vocabulary uses characters outside the byte-level alphabet: {outside}")
    to_latin1 = str.maketrans({ch: chr(b) for ch, b in decode.items()})
    return (
        pattern,
        {t.translate(to_latin1).encode("latin-1"): i for t, i in vocab.items()},
        specials,
    )


def _is_isolated_split(step: dict[str, Any]) -> bool:
    pattern = step.get("pattern") or {}
    return (
        step.get("type") == "Split"
        and "Regex" in pattern
        and step.get("behavior") == "Isolated"
        and not step.get("invert")
    )
