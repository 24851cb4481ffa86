"""ENOSPC and EIO while writing, in every local stage: tokenize, merge, index, blend, export, pull.

``faultlib.failing_writes`` makes one file's writes (``open``, ``sendfile``, pyarrow) or its
fsync fail with the errno a full or broken disk gives, without a file name, as the kernel
reports it. Each stage must raise an error that names the file, leave no temp file, no
manifest that disagrees with its files and no final-named file without a manifest (by design
``pull`` keeps the files it verified and its partial files, to resume, and ``export`` the shards
it finished; the complete ones equal a clean run's), and a re-run without the fault must give
the bytes of a clean run. The CLI turns the error into exit code 1 and one line on
stderr. A last test fills a real tmpfs (skipped only where mounting is not permitted).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faultlib import WriteFault, audit, build_sources, failing_writes, tree_digest

from tokenmill.atomic import TMP_MARK
from tokenmill.cli import main
from tokenmill.errors import TokenmillError
from tokenmill.formats.merge import merge_datasets
from tokenmill.indices.blend_build import build_blend
from tokenmill.indices.nanoset import SPLITS, build_or_load
from tokenmill.indices.settings import BlendSettings, NanosetSettings
from tokenmill.ingest.dataset_info import write_dataset_info
from tokenmill.ingest.export import export_shard
from tokenmill.storage.pull import pull
from tokenmill.storage.pull_blocks import PARTIAL_SUFFIX
from tokenmill.tokenize.run import tokenize_files

ENOSPC, EIO = errno.ENOSPC, errno.EIO
PAGE = 4096


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared inputs (``faultlib.build_sources``) and a storage root to pull from."""
    from servers import build_storage_root

    root = build_sources(tmp_path_factory.mktemp("src"))
    build_storage_root(root / "store")
    return root


def run_stage(stage: str, src: Path, out: Path, tokenizer: Path) -> None:
    """One stage through the library, writing under ``out``."""
    if stage == "tokenize":
        tokenize_files([src / "a.jsonl", src / "b.jsonl"], out / "p", tokenizer, append_eod=True)
    elif stage == "quarantine":
        tokenize_files([src / "bad.jsonl"], out / "p", tokenizer, on_bad_record="quarantine")
    elif stage == "merge":
        merge_datasets([src / f"s{i}_text_document" for i in range(3)], out / "m")
    elif stage == "index":
        for split in SPLITS:
            build_or_load(
                src / "docs_text_document",
                out,
                split,
                NanosetSettings(split_spec="80,10,10", sequence_length=32),
                500 if split == "train" else None,
            )
    elif stage == "blend":
        build_blend(
            "mix",
            {"docs": src / "docs_text_document", "code": src / "code_text_document"},
            out / "mix",
            out / "mix" / "cache",
            BlendSettings(
                NanosetSettings(sequence_length=32, split_spec="80,10,10", train_samples=300),
                weights={"docs": 0.7, "code": 0.3},
            ),
        )
    elif stage == "export":
        for name in ("a", "b"):
            export_shard(src / f"{name}.jsonl", out)
        write_dataset_info(out)
    else:
        pull(str(src / "store" / "blends" / "mix" / "manifest.json"), out, jobs=1)


STAGES = ("tokenize", "quarantine", "merge", "index", "blend", "export", "pull")


@pytest.fixture(scope="module")
def clean(src: Path, gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each stage's output tree from an undisturbed run."""
    outs = {}
    for stage in STAGES:
        outs[stage] = tmp_path_factory.mktemp(f"clean-{stage}") / "out"
        run_stage(stage, src, outs[stage], gpt2_dir)
    return outs


# Stages that keep complete files after a failure, by design: ``pull`` keeps what it verified,
# to resume; ``export`` keeps the shards finished before the failing one (each is atomic).
KEEPS_COMPLETE = ("pull", "export")


def left_behind(stage: str, out: Path, clean: dict) -> None:
    """Nothing partial: no temps, no manifest disagreeing with its files, no final-named file
    without a manifest other than complete files a stage keeps (identical to a clean run's)."""
    if not out.exists():
        return
    state = audit(out)
    # pull keeps its partial files (their verified blocks are in its ledger) to resume from
    resumable = [t for t in state.temps if stage == "pull" and t.endswith(PARTIAL_SUFFIX)]
    assert ([t for t in state.temps if t not in resumable], state.problems) == ([], [])
    if stage in KEEPS_COMPLETE:
        assert not {"blends/mix/manifest.json", "dataset_info.json"} & set(state.manifests)
        reference, kept = tree_digest(clean[stage]), tree_digest(out)
        assert {o: kept[o] for o in state.orphans} == {o: reference[o] for o in state.orphans}
    else:
        assert state.orphans == []


CASES = [
    ("tokenize", "*.bin", ENOSPC, "write", 20_000),
    ("tokenize", "*.bin", EIO, "fsync", 0),
    ("tokenize", "*.manifest.json", ENOSPC, "write", 100),
    ("quarantine", "*.quarantine.jsonl", ENOSPC, "write", 10),
    ("quarantine", "*.quarantine.jsonl", EIO, "fsync", 0),
    ("merge", "*.bin", ENOSPC, "write", 50_000),  # sendfile, then the copy fallback
    ("merge", "*.idx", EIO, "fsync", 0),
    ("merge", "*.manifest.json", EIO, "write", 0),
    ("index", "*-sample_index.npy", ENOSPC, "write", 64),
    ("index", "*-valid-shuffle_index.npy", EIO, "fsync", 0),
    ("index", "*-test-description.json", ENOSPC, "write", 100),
    ("blend", "valid-dataset_index.npy", ENOSPC, "write", 100),
    ("blend", "*-document_index.npy", EIO, "write", 0),  # a Nanoset cache inside the blend
    ("blend", "manifest.json", EIO, "fsync", 0),
    ("export", "b.parquet", ENOSPC, "write", 0),
    ("export", "a.parquet", EIO, "fsync", 0),
    ("export", "dataset_info.json", ENOSPC, "write", 10),
    ("pull", "docs_text_document.bin", ENOSPC, "write", 1000),
    ("pull", "*.idx", EIO, "fsync", 0),
    ("pull", "*.manifest.json", EIO, "write", 0),
    ("pull", "manifest.json", ENOSPC, "write", 10),
]


@pytest.mark.parametrize(
    ("stage", "pattern", "error", "on", "after"),
    CASES,
    ids=[f"{c[0]}-{c[1]}-{errno.errorcode[c[2]]}-{c[3]}" for c in CASES],
)
def test_write_fault(
    src: Path,
    clean: dict,
    gpt2_dir: Path,
    tmp_path: Path,
    stage: str,
    pattern: str,
    error: int,
    on: str,
    after: int,
) -> None:
    out = tmp_path / "out"
    fault = WriteFault(pattern, error, after, on)
    with failing_writes(fault), pytest.raises((OSError, TokenmillError)) as info:
        run_stage(stage, src, out, gpt2_dir)
    assert fault.fired, f"{pattern} was never written"
    name = Path(fault.fired[0]).name.split(TMP_MARK)[0]
    assert os.strerror(error) in str(info.value)
    assert name in str(info.value), f"the error does not name {name}: {info.value}"
    left_behind(stage, out, clean)
    run_stage(stage, src, out, gpt2_dir)
    state = audit(out)
    assert (state.temps, state.orphans, state.problems) == ([], [], [])
    assert tree_digest(out) == tree_digest(clean[stage])


def cli_args(stage: str, src: Path, out: Path, tokenizer: Path) -> list[str]:
    """The CLI spelling of ``run_stage`` (single input, single split where that is shorter)."""
    return {
        "tokenize": [
            *("tokenize", "--input", str(src / "a.jsonl"), "--output-prefix", str(out / "p")),
            *("--tokenizer", str(tokenizer), "--workers", "1"),
        ],
        "merge": ["merge", "--input", str(src / "s0_text_document"), "--output-prefix", f"{out}/m"],
        "index": [
            *("index", "--dataset", str(src / "docs_text_document"), "--cache-dir", str(out)),
            *("--sequence-length", "32", "--split", "80,10,10"),
        ],
        "blend": [
            *("blend", "--dataset", f"d={src / 'docs_text_document'}", "--weight", "d=1"),
            *("--output", str(out), "--sequence-length", "32", "--split", "80,10,10"),
            *("--train-samples", "100"),
        ],
        "export": ["export", "--input", str(src / "a.jsonl"), "--output-dir", str(out)],
        "pull": ["pull", str(src / "store" / "blends" / "mix"), str(out)],
    }[stage]


@pytest.mark.parametrize(
    ("stage", "pattern", "error"),
    [
        ("tokenize", "*.bin", ENOSPC),
        ("merge", "*.bin", ENOSPC),
        ("index", "*-description.json", EIO),
        ("blend", "manifest.json", ENOSPC),
        ("export", "*.parquet", ENOSPC),
        ("pull", "*.bin", EIO),
    ],
)
def test_cli_reports_the_file_and_exits_1(
    src: Path,
    gpt2_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    stage: str,
    pattern: str,
    error: int,
) -> None:
    out = tmp_path / "out"
    with failing_writes(WriteFault(pattern, error, after=10)) as fault:
        rc = main(cli_args(stage, src, out, gpt2_dir))
    err = capsys.readouterr().err
    assert rc == 1 and fault.fired, err
    # Parallel stages (pull) may hit the fault in several files; the error names one of them.
    names = {Path(path).name.split(TMP_MARK)[0] for path in fault.fired}
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tokenmill {stage}: error: "), err
    assert os.strerror(error) in err and any(name in err for name in names), err
    assert "Traceback" not in err


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[Path, int], None]]:
    """``mount(path, bytes)``: a tmpfs of that size at ``path`` (remounting resizes it);
    unmounted at the end. Skips the test where mounting is not permitted."""
    mounted: list[Path] = []

    def mount(path: Path, size: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        opts = f"size={size}" + (",remount" if path in mounted else "")
        cmd = ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode and not mounted:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
        assert proc.returncode == 0, proc.stderr
        if path not in mounted:
            mounted.append(path)

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    for path in mounted:  # lazily if a failed test still holds a file open in it
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


@pytest.mark.parametrize("stage", [s for s in STAGES if s != "quarantine"])  # too small
def test_real_enospc_on_a_full_tmpfs(
    src: Path,
    clean: dict,
    gpt2_dir: Path,
    tmp_path: Path,
    tmpfs: Callable[[Path, int], None],
    stage: str,
) -> None:
    """A tmpfs with half the pages the stage needs: the kernel's own ENOSPC, wherever it hits
    (buffered writes, flush at close, sendfile, numpy, pyarrow)."""
    out = tmp_path / "out"
    pages = sum(-(-p.stat().st_size // PAGE) for p in clean[stage].rglob("*") if p.is_file())
    tmpfs(out, max(1, pages // 2) * PAGE)
    with pytest.raises((OSError, TokenmillError)) as info:
        run_stage(stage, src, out, gpt2_dir)
    assert os.strerror(ENOSPC) in str(info.value)
    assert str(out) in str(info.value), f"the error names no file: {info.value}"
    left_behind(stage, out, clean)
    tmpfs(out, 64 << 20)
    run_stage(stage, src, out, gpt2_dir)
    assert tree_digest(out) == tree_digest(clean[stage])
