"""get_training_batch == megatron-core GPTDataset.__getitem__ (FORMATS §11), sample by sample.

The reference below is written per sample from FORMATS §5.5 and §11 in plain Python (loops
over EODs and mask cells as Megatron writes them); it shares no code with the loader.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from _helpers import FLAG_COMBOS, bench_module
from hypothesis import example, given, reject, settings
from hypothesis import strategies as st

from tokenmill.errors import ConfigError, FormatError, InputError
from tokenmill.formats.dataset_manifest import read_dataset_manifest, write_dataset_manifest
from tokenmill.formats.indexed import IndexedDataset, IndexedDatasetWriter
from tokenmill.formats.merge import merge_datasets
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.nanoset import build_nanoset_indices, build_or_load
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.loader import BlendedDataset, NanosetDataset, open_blend, open_nanoset

MEGATRON = bench_module("_megatron_getitem")  # its packed_lengths: the §11.4 piece lengths
EOD = 3
S = 12
DTYPES = {
    "tokens": np.int64,
    "labels": np.int64,
    "loss_mask": np.float32,
    "position_ids": np.int64,
    "attention_mask": np.bool_,
    "cu_seqlens": np.int32,
    "max_seqlen": np.int32,
}


def reference_text(ds: NanosetDataset, k: int, seq: int = S) -> tuple[list[int], list[int]]:
    """§5.5: sample ``k``'s tokens (padded with the pad id) and its pieces' token counts."""
    j = int(ds.shuffle_index[k])
    b, bo = (int(v) for v in ds.sample_index[j])
    e, eo = (int(v) for v in ds.sample_index[j + 1])
    doc = ds.document_index
    parts = []
    for i in range(b, e + 1):
        offset = bo if i == b else 0
        length = (eo + ds.extra - offset) if i == e else None
        parts.append(ds.data.get(int(doc[i]), offset, length).tolist())
    text = [t for part in parts for t in part]
    text += [ds.pad_id] * (seq + ds.extra - len(text))
    return text, [len(part) for part in parts]


def reference_sample(text: list[int], pieces: list[int], extra: int, eod: int, pad: int, **f):
    """§11 for one sample, as Megatron writes it (per EOD, per mask cell)."""
    if extra:
        tokens, labels = text[:-1], text[1:]
    else:
        tokens, labels = list(text), [*text[1:], pad]
    n = len(tokens)
    loss_mask = [0.0 if f["eod_mask_loss"] and t == eod else 1.0 for t in tokens]
    position_ids = list(range(n))
    mask = None
    if f["create_attention_mask"]:
        mask = [[1.0 if c <= r else 0.0 for c in range(n)] for r in range(n)]
    if f["reset_position_ids"] or f["reset_attention_mask"]:
        prev = 0
        for i in [p for p in range(n) if tokens[p] == eod]:
            if f["reset_attention_mask"] and mask is not None:
                for r in range(i + 1, n):
                    for c in range(i + 1):
                        mask[r][c] = 0.0
            if f["reset_position_ids"]:
                for p in range(i + 1, n):
                    position_ids[p] -= i + 1 - prev
                prev = i + 1
    loss_mask = [0.0 if lab == pad else m for lab, m in zip(labels, loss_mask, strict=True)]
    out = {
        "tokens": [0 if t == pad else t for t in tokens],
        "labels": [0 if t == pad else t for t in labels],
    }
    if f["inter_document_masking"]:
        lens = MEGATRON.packed_lengths(pieces, bool(extra), n)
        cu = [0]
        for length in lens:
            cu.append(cu[-1] + length)
        out |= {
            "loss_mask": loss_mask,
            "position_ids": [p for length in lens for p in range(length)],
            "cu_seqlens": cu + [n] * (n + 1 - len(cu)),
            "max_seqlen": max(lens),
        }
    elif mask is not None:
        masked = [[[v < 0.5 for v in row] for row in mask]]
        out |= {"attention_mask": masked, "loss_mask": loss_mask, "position_ids": position_ids}
    else:
        out |= {"loss_mask": loss_mask, "position_ids": position_ids}
    return out


def assert_matches_reference(batch: dict[str, np.ndarray], expected: list[dict]) -> None:
    assert list(batch) == list(expected[0])
    for key, values in batch.items():
        assert values.dtype == DTYPES[key], key
        want = np.array([e[key] for e in expected], dtype=DTYPES[key])
        assert values.shape == want.shape, key
        assert np.array_equal(values, want), key


def write_tokens(prefix: Path, lengths: list[int], seed: int, dtype: type, eod: int | None):
    """Documents of small ids (EODs inside and at the end); a manifest recording ``eod``."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for n in lengths:
            doc = rng.integers(0, 12, n)
            if n:
                doc[-1] = EOD
            writer.add_document(doc, [n])
    write_dataset_manifest(
        prefix, kind="tokens", inputs=[], config={"eod_id": eod}, counts={"sequences": 0}
    )
    return IndexedDataset(prefix)


LENGTHS = [9, 1, 14, 0, 5, 30, 2, 7, 3, 11, 6, 4]


def indices(data: IndexedDataset, seq: int, seed: int, extra: bool, drop_last: bool) -> tuple:
    """One epoch of Nanoset index arrays over all of ``data``."""
    return build_nanoset_indices(
        data.sequence_lengths,
        (0, len(data)),
        sequence_length=seq,
        seed=seed,
        num_samples=None,
        add_extra_token=extra,
        drop_last_partial=drop_last,
    )


def nanoset(data: IndexedDataset, *, extra: bool, drop_last: bool, pad_id: int = -1, seed=6):
    arrays = indices(data, S, seed, extra, drop_last)
    return NanosetDataset(data, *arrays, sequence_length=S, add_extra_token=extra, pad_id=pad_id)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> IndexedDataset:
    return write_tokens(tmp_path_factory.mktemp("d") / "a", LENGTHS, 1, np.uint16, EOD)


@pytest.mark.parametrize("extra", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("pad_id", [-1, 5])
def test_every_flag_combination_equals_the_reference(
    data: IndexedDataset, extra: bool, drop_last: bool, pad_id: int
) -> None:
    ds = nanoset(data, extra=extra, drop_last=drop_last, pad_id=pad_id)
    ks = np.array([*range(len(ds)), len(ds) - 1, 0])
    assert ds.get_batch(ks).flags.writeable  # get_batch still returns its own int64 copy
    texts = [reference_text(ds, int(k)) for k in ks]
    if not drop_last:
        assert any(pad_id in text for text, _ in texts)  # padded samples are covered
    for flags in FLAG_COMBOS:
        expected = [reference_sample(t, p, int(extra), EOD, pad_id, **flags) for t, p in texts]
        assert_matches_reference(ds.get_training_batch(ks, **flags), expected)


@settings(max_examples=25, deadline=None, derandomize=True)
@example(lengths=[1, 0, 1], seq=2, seed=0, extra=False, drop_last=False, pad_id=-1)
@given(
    lengths=st.lists(st.integers(0, 25), min_size=1, max_size=12),
    seq=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    extra=st.booleans(),
    drop_last=st.booleans(),
    pad_id=st.sampled_from([-1, 0, EOD]),
)
def test_random_datasets_equal_the_reference(
    lengths: list[int], seq: int, seed: int, extra: bool, drop_last: bool, pad_id: int
) -> None:
    """Empty sequences, samples ending on a sequence end, 1-token pieces, pad = a token value."""
    with tempfile.TemporaryDirectory() as tmp:
        data = write_tokens(Path(tmp) / "r", lengths, seed, np.uint16, EOD)
        try:
            arrays = indices(data, seq, seed, extra, drop_last)
        except ConfigError:  # inputs the reference rejects (e.g. too few tokens)
            reject()
        ds = NanosetDataset(
            data, *arrays, sequence_length=seq, add_extra_token=extra, pad_id=pad_id
        )
        if not len(ds):
            reject()
        ks = np.random.default_rng(seed).integers(0, len(ds), 12)
        texts = [reference_text(ds, int(k), seq) for k in ks]
        for flags in FLAG_COMBOS:
            expected = [reference_sample(t, p, int(extra), EOD, pad_id, **flags) for t, p in texts]
            if any(len(e.get("cu_seqlens", ())) > seq + 1 for e in expected):
                # More pieces (empty sequences count) than S + 1 entries can hold: Megatron's
                # per-sample arrays would not stack either; ours refuses with a clear error.
                with pytest.raises(FormatError, match="do not fit in cu_seqlens"):
                    ds.get_training_batch(ks, **flags)
                continue
            assert_matches_reference(ds.get_training_batch(ks, **flags), expected)


def test_partial_valid_sample_vector_d(tmp_path: Path) -> None:
    """FORMATS §9.3 d: sample j=4 is [401, 402, 403, pad, pad] from one piece of 3 tokens."""
    with IndexedDatasetWriter(tmp_path / "four", np.uint16) as writer:
        for s, n in enumerate([5, 3, 7, 4]):
            writer.add_document(np.arange(n) + 100 * (s + 1), [n])
    rows = [[0, 0], [0, 4], [2, 0], [2, 4], [3, 1], [3, 3]]
    ds = NanosetDataset(
        IndexedDataset(tmp_path / "four"),
        np.array([0, 1, 2, 3], np.int32),
        np.array(rows, np.int32),
        np.array([2, 1, 3, 0, 4], np.uint32),
        sequence_length=4,
    )
    out = ds.get_training_batch([4], eod_id=402, eod_mask_loss=True, inter_document_masking=True)
    assert out["tokens"].tolist() == [[401, 402, 403, 0]]
    assert out["labels"].tolist() == [[402, 403, 0, 0]]
    assert out["loss_mask"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert out["cu_seqlens"].tolist() == [[0, 4, 4, 4, 4]]
    assert out["max_seqlen"].tolist() == [4]
    mask = ds.get_training_batch(
        [4],
        eod_id=402,
        reset_position_ids=True,
        reset_attention_mask=True,
        create_attention_mask=True,
    )
    assert mask["position_ids"].tolist() == [[0, 1, 0, 1]]
    assert mask["attention_mask"][0, 0].astype(int).tolist() == [
        [0, 1, 1, 1],
        [0, 0, 1, 1],
        [1, 1, 0, 1],
        [1, 1, 0, 0],
    ]


def test_blend_equals_the_reference_of_its_datasets(tmp_path: Path, data: IndexedDataset) -> None:
    other = write_tokens(tmp_path / "b", [20, 3, 8, 13, 1, 9], 2, np.int32, EOD)
    a = nanoset(data, extra=True, drop_last=False)
    b = nanoset(other, extra=True, drop_last=False, seed=9)
    rng = np.random.default_rng(0)
    which = rng.integers(0, 2, 40).astype(np.int16)
    local = np.where(which == 0, rng.integers(0, len(a), 40), rng.integers(0, len(b), 40))
    blend = BlendedDataset({"a": a, "b": b}, which, local.astype(np.int64))
    ids = rng.permutation(40)[:25]
    texts = [reference_text((a, b)[which[i]], int(local[i])) for i in ids]
    for flags in FLAG_COMBOS:
        expected = [reference_sample(t, p, 1, EOD, -1, **flags) for t, p in texts]
        assert_matches_reference(blend.get_training_batch(ids, **flags), expected)
        empty = blend.get_training_batch([], **flags)
        assert list(empty) == list(expected[0])
        assert all(v.shape[0] == 0 and v.dtype == DTYPES[k] for k, v in empty.items())


def test_eod_recorded_explicit_or_missing(tmp_path: Path, data: IndexedDataset) -> None:
    ds = nanoset(data, extra=True, drop_last=True)
    assert ds.recorded_eod_id() == EOD
    recorded = ds.get_training_batch(range(len(ds)), eod_mask_loss=True)
    explicit = ds.get_training_batch(range(len(ds)), eod_id=EOD, eod_mask_loss=True)
    other = ds.get_training_batch(range(len(ds)), eod_id=EOD + 1, eod_mask_loss=True)
    assert np.array_equal(recorded["loss_mask"], explicit["loss_mask"])
    assert not np.array_equal(recorded["loss_mask"], other["loss_mask"])
    bare = tmp_path / "bare"
    with IndexedDatasetWriter(bare, np.uint16) as writer:
        writer.add_document(np.arange(40) % 7, [40])
    unknown = nanoset(IndexedDataset(bare), extra=True, drop_last=True)
    with pytest.raises(ConfigError, match=r"no EOD id recorded for .*bare.*pass eod_id="):
        unknown.get_training_batch([0])
    assert unknown.get_training_batch([0], eod_id=6)["tokens"].shape == (1, S)


def test_blend_datasets_must_agree_on_the_eod(tmp_path: Path, data: IndexedDataset) -> None:
    a = nanoset(data, extra=True, drop_last=True)
    b = nanoset(write_tokens(tmp_path / "b", LENGTHS, 2, np.uint16, 7), extra=True, drop_last=True)
    blend = BlendedDataset({"web": a, "code": b}, np.array([0, 1], np.int16), np.array([0, 0]))
    with pytest.raises(ConfigError, match=r"different EOD ids \('web': 3, 'code': 7\)"):
        blend.get_training_batch([0, 1])
    assert blend.get_training_batch([0, 1], eod_id=3)["tokens"].shape == (2, S)
    padded = nanoset(data, extra=True, drop_last=True, pad_id=0)
    mixed = BlendedDataset(
        {"web": a, "pad0": padded}, np.array([0, 1], np.int16), np.zeros(2, np.int64)
    )
    with pytest.raises(ConfigError, match=r"pad_id differ \(\{'web': -1, 'pad0': 0\}\)"):
        mixed.get_training_batch([0], eod_id=3)


def test_open_nanoset_takes_pad_id(tmp_path: Path, data: IndexedDataset) -> None:
    built = build_or_load(
        data.prefix,
        tmp_path / "cache",
        "valid",
        NanosetSettings(
            split_spec="0,1,0", sequence_length=S, seed=6, drop_last_partial_validation=False
        ),
    )
    assert built is not None
    ds = open_nanoset(data.prefix, index=built, pad_id=99)
    padded = (ds.get_batch(range(len(ds))) == 99).any(axis=1)
    assert ds.pad_id == 99 and padded.sum() == 1
    train = ds.get_training_batch(range(len(ds)))
    assert (
        not (train["loss_mask"][padded] == 1.0).all() and (train["loss_mask"][~padded] == 1).all()
    )


def test_open_blend_takes_pad_id_and_the_recorded_eod(tmp_path: Path) -> None:
    paths = {"web": tmp_path / "web", "code": tmp_path / "code"}
    write_tokens(paths["web"], LENGTHS * 3, 1, np.uint16, EOD)
    write_tokens(paths["code"], LENGTHS * 2, 2, np.int32, EOD)
    build_blend(
        "mix",
        paths,
        tmp_path / "blend",
        tmp_path / "cache",
        BlendSettings(
            NanosetSettings(sequence_length=S, split_spec="1,0,0", seed=3, train_samples=20),
            weights={"web": 0.6, "code": 0.4},
        ),
    )
    blend = open_blend(tmp_path / "blend", pad_id=-7)
    assert {ds.pad_id for ds in blend.datasets.values()} == {-7}
    ids = np.arange(len(blend))
    batch = blend.get_training_batch(ids, eod_mask_loss=True)
    assert batch["tokens"].shape == (len(blend), S)
    samples = blend.get_batch(ids)
    assert np.array_equal(batch["loss_mask"] == 0, samples[:, :-1] == EOD)


def test_merge_carries_and_checks_the_eod(tmp_path: Path) -> None:
    write_tokens(tmp_path / "a", [4, 5], 1, np.uint16, EOD)
    write_tokens(tmp_path / "b", [6], 2, np.uint16, EOD)
    merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert read_dataset_manifest(tmp_path / "m")["config"]["eod_id"] == EOD
    write_tokens(tmp_path / "c", [6], 2, np.uint16, EOD + 1)
    with pytest.raises(InputError, match=r"eod_id 4, but .*a has 3"):
        merge_datasets([tmp_path / "a", tmp_path / "c"], tmp_path / "n")


def test_torch_adapter_and_packed_collate(data: IndexedDataset) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from tokenmill.loader import BatchSampler
    from tokenmill.loader.torch import TrainingDataset, packed_collate, training_batch

    ds = nanoset(data, extra=True, drop_last=False)
    flags = {"eod_mask_loss": True, "inter_document_masking": True}
    ks = list(range(len(ds)))
    arrays = ds.get_training_batch(ks, **flags)
    tensors = training_batch(ds, ks, **flags)
    assert list(tensors) == list(arrays)
    for key, value in tensors.items():
        assert value.dtype == getattr(torch, np.dtype(DTYPES[key]).name), key
        assert np.array_equal(value.numpy(), arrays[key]), key
    masked = training_batch(ds, [0], create_attention_mask=True)["attention_mask"]
    assert masked.dtype == torch.bool and masked.shape == (1, 1, S, S)

    wrapped = TrainingDataset(ds, **flags)
    loader = DataLoader(wrapped, batch_sampler=BatchSampler(len(ds), 2), collate_fn=packed_collate)
    first = next(iter(loader))
    assert list(first) == ["input_ids", "labels", "position_ids"]
    assert torch.equal(first["input_ids"], tensors["tokens"][:2])
    want = np.where(arrays["loss_mask"][:2] == 0, -100, arrays["labels"][:2])
    assert first["labels"].tolist() == want.tolist() and (want == -100).any()
    assert torch.equal(first["position_ids"], tensors["position_ids"][:2])
    per_sample = packed_collate([wrapped[0], wrapped[1]])
    assert all(torch.equal(per_sample[key], first[key]) for key in first)
    flat = packed_collate(wrapped.__getitems__([0, 1]), flatten=True)
    assert flat["input_ids"].shape == (1, 2 * S)
