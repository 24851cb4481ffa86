"""SIGKILL during every local stage (tokenize, merge, index, blend, pull), then a re-run.

Each kill lands at a chosen point (``faultlib.kill_parked``): mid-write, inside a commit, just
before the manifest. After the kill no manifest or description present disagrees with its files,
the final-named files no manifest covers are exactly the ones that point can leave (none
mid-write; a committed pair or array set just before its manifest; verified files kept by
``pull`` for resuming), readers refuse those, and a re-run gives the bytes of a clean run.
``tests/lib/test_tokenize.py`` already kills a 2-worker tokenize mid-write and checks that its
forked children exit; these tests add the other points, the other stages and whole-tree bytes.

Manifests record absolute input paths (tokenize: input ``uri``, ``tokenizer``; merge: input
prefixes), so clean and killed runs share their inputs and use the same output names at the
same depth; no manifest holds a timestamp.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from faultlib import Audit, audit, build_sources, kill_parked, tree_digest
from pipeline_project import tokenizer_dir

from tokenmill.atomic import TMP_DIR
from tokenmill.cli import main
from tokenmill.errors import FormatError
from tokenmill.formats.dataset_manifest import check_dataset_files
from tokenmill.loader import open_blend
from tokenmill.storage.pull import pull
from tokenmill.verify import verify_blend

IDX_WRITER = "tokenmill.formats.indexed"
TOKENIZER = tokenizer_dir("gpt2")  # built by the gpt2_dir fixture


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared inputs (``faultlib.build_sources``)."""
    return build_sources(tmp_path_factory.mktemp("src"))


def tokenize_args(src: Path, out: Path, workers: int = 1, inputs: str = "ab") -> list[str]:
    return [
        "tokenize",
        "--input",
        *(str(src / f"{name}.jsonl") for name in inputs),
        "--output-prefix",
        str(out / "p"),
        "--tokenizer",
        str(TOKENIZER),
        "--append-eod",
        "--workers",
        str(workers),
    ]


def merge_args(src: Path, out: Path, order: str = "012") -> list[str]:
    inputs = [str(src / f"s{i}_text_document") for i in order]
    return ["merge", "--input", *inputs, "--output-prefix", str(out / "m")]


def index_args(src: Path, out: Path) -> list[str]:
    return [
        *("index", "--dataset", str(src / "docs_text_document"), "--cache-dir", str(out)),
        *("--sequence-length", "32", "--split", "80,10,10", "--train-samples", "500"),
    ]


def blend_args(
    src: Path, out: Path, docs_weight: str = "0.7", cache: Path | None = None
) -> list[str]:
    return [
        *("blend", "--dataset", f"docs={src / 'docs_text_document'}"),
        *("--dataset", f"code={src / 'code_text_document'}"),
        *("--weight", f"docs={docs_weight}", "--weight", "code=0.3"),
        *("--output", str(out / "mix"), "--sequence-length", "32", "--split", "80,10,10"),
        *("--train-samples", "300"),
        *(("--cache-dir", str(cache)) if cache else ()),
    ]


ARGS = {"tokenize": tokenize_args, "merge": merge_args, "index": index_args, "blend": blend_args}


@pytest.fixture(scope="module")
def clean(src: Path, gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Digest of each stage's output tree after an uninterrupted run."""
    digests = {}
    for stage, args in ARGS.items():
        out = tmp_path_factory.mktemp(f"clean-{stage}") / "out"
        assert main(args(src, out)) == 0
        digests[stage] = tree_digest(out)
    return digests


def rerun_matches(stage: str, src: Path, out: Path, clean: dict) -> None:
    """Re-run the stage undisturbed: everything consistent, bytes as the clean run."""
    assert main(ARGS[stage](src, out)) == 0
    state = audit(out)
    assert (state.temps, state.orphans, state.problems) == ([], [], [])
    assert tree_digest(out) == clean[stage]


def never_completed(prefix: Path) -> None:
    with pytest.raises(FormatError, match="missing: the dataset was never completed"):
        check_dataset_files(prefix)


def killed(
    args: Callable[[Path], list[str]], tmp_path: Path, hook: str, **kw: Any
) -> tuple[Path, Audit]:
    """The command ``args(out)`` (``out``: ``tmp_path/out``) killed where ``hook`` parks it
    (``kill_parked``, ``kw`` its call and side); ``out`` and its audit."""
    out = tmp_path / "out"
    kill_parked(args(out), hook, tmp_path / "k", **kw)
    return out, audit(out)


@pytest.mark.parametrize("workers", [1, 2])
def test_tokenize_killed_mid_write(src: Path, clean: dict, tmp_path: Path, workers: int) -> None:
    out = tmp_path / "out"
    args = tokenize_args(src, out, workers)
    # one worker writes in process; with more, the parent appends each worker's part
    step = "add_documents" if workers == 1 else "add_part"
    kill_parked(args, f"{IDX_WRITER}:IndexedDatasetWriter.{step}", tmp_path / "k", after=True)
    state = audit(out)
    # all in the run's staging folder, .tmp/p_text_document.tmp-<host>-<pid>-<rand>/ (the parts too)
    assert state.temps and all(t.startswith(".tmp/p_text_document.tmp-") for t in state.temps)
    assert [t for t in state.temps if "/.tmp/p_text_document.bin.tmp-" in t]
    assert (state.orphans, state.manifests) == ([], [])
    rerun_matches("tokenize", src, out, clean)


@pytest.mark.parametrize(
    ("call", "after", "orphans"),
    [
        (1, True, ["p_text_document.bin"]),  # .bin renamed into place, .idx not yet
        (3, False, ["p_text_document.bin", "p_text_document.idx"]),  # the manifest not yet
    ],
    ids=["between-bin-and-idx", "manifest-written-not-renamed"],
)
def test_tokenize_killed_while_committing(
    src: Path, clean: dict, tmp_path: Path, call: int, after: bool, orphans: list[str]
) -> None:
    """Killed while renaming the staged files into place (holding the output's lock): the
    files not yet renamed and the lock file are left in .tmp/; the next run completes."""
    hook = "tokenmill.tokenize.outputs:commit"
    args = partial(tokenize_args, src, workers=2)
    out, state = killed(args, tmp_path, hook, call=call, after=after)
    assert (state.orphans, state.manifests, state.problems) == (orphans, [], [])
    staged = {"p_text_document.idx", "p_text_document.manifest.json"} - set(orphans)
    left = sorted(t.rsplit("/", 1)[1] for t in state.temps)
    assert left == sorted({*staged, "p_text_document.lock"})
    never_completed(out / "p_text_document")
    rerun_matches("tokenize", src, out, clean)


def test_tokenize_killed_over_a_previous_result(src: Path, clean: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(tokenize_args(src, out, inputs=("a",))) == 0
    kill_parked(
        tokenize_args(src, out), f"{IDX_WRITER}:IndexedDatasetWriter.add_documents", tmp_path / "k"
    )
    state = audit(out)  # the old result stays whole: the new one was only staged
    assert (state.orphans, state.problems) == ([], [])
    assert state.manifests == ["manifests/p_text_document.manifest.json"]
    rerun_matches("tokenize", src, out, clean)


@pytest.mark.parametrize(
    ("hook", "call", "orphans"),
    [
        (f"{IDX_WRITER}:IndexedDatasetWriter.add_index", 2, []),  # one input copied
        ("tokenmill.formats._writer_io:copy_file", 3, []),
        ("tokenmill.formats.merge:write_dataset_manifest", 1, ["m.bin", "m.idx"]),
    ],
    ids=["between-inputs", "copying-the-last-input", "before-manifest"],
)
def test_merge_killed(
    src: Path, clean: dict, tmp_path: Path, hook: str, call: int, orphans: list[str]
) -> None:
    out, state = killed(partial(merge_args, src), tmp_path, hook, call=call)
    assert (state.orphans, state.manifests, state.problems) == (orphans, [], [])
    if orphans:
        never_completed(out / "m")
    rerun_matches("merge", src, out, clean)


def test_merge_killed_over_a_previous_result(src: Path, clean: dict, tmp_path: Path) -> None:
    """Same-sized new output under an old manifest would pass the size check with other bytes;
    the old manifest must be gone before the new pair is renamed into place."""
    out = tmp_path / "out"
    assert main(merge_args(src, out, order="102")) == 0
    kill_parked(
        merge_args(src, out), "tokenmill.formats.merge:write_dataset_manifest", tmp_path / "k"
    )
    state = audit(out)
    assert (state.orphans, state.manifests, state.problems) == (["m.bin", "m.idx"], [], [])
    never_completed(out / "m")
    rerun_matches("merge", src, out, clean)


def _index_names(out: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in out.glob(pattern))


@pytest.mark.parametrize(
    ("hook", "call", "orphans"),
    [
        ("tokenmill.atomic:commit", 1, ""),  # train document index written, not renamed
        ("tokenmill.formats.nanoset_cache:save_array", 2, "*-train-document_index.npy"),
        ("tokenmill.formats.nanoset_cache:write_description", 2, "*-valid-*_index.npy"),
    ],
    ids=["first-array-renaming", "between-arrays", "before-valid-description"],
)
def test_index_killed(
    src: Path, clean: dict, tmp_path: Path, hook: str, call: int, orphans: str
) -> None:
    out, state = killed(partial(index_args, src), tmp_path, hook, call=call)
    assert state.problems == []
    assert state.orphans == (_index_names(out, orphans) if orphans else [])
    assert len(state.manifests) == (1 if "valid" in orphans else 0)  # train entry complete
    assert main(index_args(src, out)) == 0  # a described entry is reused, the others rebuilt
    state = audit(out)
    assert (state.temps, state.orphans, state.problems) == ([], [], [])
    assert tree_digest(out) == clean["index"]


@pytest.mark.parametrize(
    ("hook", "call", "staged"),
    [
        ("tokenmill.indices.blend_build:_build_split", 2, 2),  # train arrays in the temp folder
        ("tokenmill.indices.blend_build:write_json", 1, 6),  # every array, no version manifest
        ("tokenmill.storage.versions:write_bytes", 1, 0),  # version renamed, pointer not written
    ],
    ids=["after-train-split", "before-version-manifest", "before-pointer"],
)
def test_blend_killed(
    src: Path, clean: dict, tmp_path: Path, hook: str, call: int, staged: int
) -> None:
    out, state = killed(partial(blend_args, src), tmp_path, hook, call=call)
    staging = sorted(
        f"mix/{p.relative_to(out / 'mix')}"
        for p in out.glob("mix/versions/.tmp/*.tmp-*/*")
        if p.is_file()
    )
    assert len(staging) == staged and all(s.endswith(".npy") for s in staging)
    # the temp folder only, and the pointer's lock file when killed holding it (a flock dies
    # with its process: the file blocks nobody, and the next pointer write removes it)
    temps = [t for t in state.temps if t != "mix/.tmp/manifest.json.lock"]
    assert (temps, state.orphans, state.problems) == (staging, [], [])
    assert "mix/manifest.json" not in state.manifests
    with pytest.raises(FormatError, match="missing: the blend was never completed"):
        verify_blend(out / "mix")
    if not staged:  # the complete version opens by name; the re-run reuses it
        (version,) = [p.name for p in (out / "mix/versions").iterdir() if p.name != TMP_DIR]
        assert len(open_blend(out / "mix" / "manifest.json", version=version)) == 300
    rerun_matches("blend", src, out, clean)


def test_blend_rebuild_killed_keeps_the_previous_version(
    src: Path, clean: dict, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert main(blend_args(src, out, docs_weight="0.2", cache=tmp_path / "old-cache")) == 0
    pointer = (out / "mix/manifest.json").read_bytes()
    old = open_blend(out / "mix")
    (old_version,) = [p.name for p in (out / "mix/versions").iterdir() if p.name != TMP_DIR]
    hook = "tokenmill.indices.blend_build:_build_split"
    kill_parked(blend_args(src, out), hook, tmp_path / "k", call=2)  # train arrays written
    state = audit(out)
    assert state.problems == [] and (out / "mix/manifest.json").read_bytes() == pointer
    assert state.orphans == [] and len(state.temps) == 2  # the killed build's staging folder
    assert all(t.startswith("mix/versions/.tmp/") for t in state.temps)
    reopened = open_blend(out / "mix" / "manifest.json", split="train")
    assert reopened.version == old.version
    assert (reopened.get_batch(range(len(old))) == old.get_batch(range(len(old)))).all()
    assert main(blend_args(src, out)) == 0  # the interrupted refresh, undisturbed
    state = audit(out)
    assert (state.temps, state.orphans, state.problems) == ([], [], [])
    digest = tree_digest(out)
    assert {k: v for k, v in digest.items() if f"/{old_version}/" not in k} == clean["blend"]
    assert len(digest) - len(clean["blend"]) == 7  # the previous version stays until gc


@pytest.mark.parametrize(
    ("hook", "call", "after", "jobs"),
    [
        ("tokenmill.storage.pull_blocks:Hasher.update", 1, True, 1),  # first file half-way (temp)
        ("tokenmill.storage.pull_blocks:commit", 3, True, 1),  # three files complete
        ("tokenmill.storage.pull:_commit_manifest", 1, False, 1),  # all files, no manifest
        ("tokenmill.storage.pull_blocks:Hasher.update", 4, True, 8),  # eight transfers at once
    ],
    ids=["mid-file", "after-three-files", "before-manifest", "parallel"],
)
def test_pull_killed(
    storage_root: Path, tmp_path: Path, hook: str, call: int, after: bool, jobs: int
) -> None:
    manifest = storage_root / "blends" / "mix" / "manifest.json"
    clean_dir = tmp_path / "clean"
    pull(str(manifest), clean_dir)
    out = tmp_path / "out"
    args = ["pull", str(manifest), str(out), "--jobs", str(jobs)]
    kill_parked(args, hook, tmp_path / "k", call=call, after=after)
    state = audit(out)
    assert state.problems == []
    assert "blends/mix/manifest.json" not in state.manifests
    # Files already verified and renamed stay for the resume (by design); no manifest says done.
    assert set(state.orphans) <= set(tree_digest(clean_dir))
    with pytest.raises(FormatError, match="never completed"):
        open_blend(out / "blends" / "mix" / "manifest.json", split="train")
    report = pull(str(manifest), out)
    assert set(state.orphans) <= set(report.skipped)  # verified again, not fetched again
    state = audit(out)
    assert (state.temps, state.orphans, state.problems) == ([], [], [])
    assert tree_digest(out) == tree_digest(clean_dir)
