"""Every ``tokenmill`` command of README.md and the user guide runs as written, from a folder laid
out as ``make demo`` leaves the repo root (its corpus, GPT-2 tokenizer and merged datasets)."""

from __future__ import annotations

import itertools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.formats.merge import natural_key, virtual_merge
from tokenmill.formats.shard_records import IngestStats, raw_stats_record, write_record
from tokenmill.ingest.records import Quarantine, read_jsonl_batches
from tokenmill.storage import layout
from tokenmill.storage.versions import version_hash, write_pointer
from tokenmill.tokenize.run import tokenize_files
from tokenmill_dev.bundled import BUILDERS
from tokenmill_dev.corpus import stdlib_documents

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", ROOT / "docs" / "user-guide.md")
# Runs every stage through Dagster: what `make demo` itself runs, tested in
# tests/pipeline/test_materialize.py; its user-guide line is a synopsis ([--recipe R] ...).
NOT_HERE = {"materialize"}


def documented_commands(path: Path) -> list[list[str]]:
    """The ``tokenmill`` lines of the ```bash blocks of ``path`` (continuations joined,
    comments dropped), as argument lists without the leading ``tokenmill``."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        lines = iter(block.splitlines())
        for line in lines:
            command = line
            while command.rstrip().endswith("\\"):
                command = command.rstrip()[:-1] + " " + next(lines).strip()
            words = shlex.split(command, comments=True)
            if words[:1] == ["tokenmill"]:
                commands.append(words[1:])
    return commands


def _bash_lines(path: Path) -> list[str]:
    """Every line of the ```bash blocks of ``path``."""
    text = path.read_text(encoding="utf-8")
    return [
        line
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.splitlines()
    ]


def test_activation_line_puts_the_installed_tokenmill_on_path() -> None:
    """The quick start activates the venv ``make`` creates, whose ``bin/`` holds the
    ``tokenmill`` console script (else: ``tokenmill: command not found``)."""
    activate = [line for line in _bash_lines(ROOT / "README.md") if "activate" in line]
    assert [shlex.split(line, comments=True) for line in activate] == [[".", ".venv/bin/activate"]]
    assert re.search(r"^VENV := \.venv$", (ROOT / "Makefile").read_text(), re.M)
    assert 'tokenmill = "tokenmill.cli:main"' in (ROOT / "pyproject.toml").read_text()
    assert (Path(sys.executable).parent / "tokenmill").is_file()  # the venv running this test


def test_tokenizer_target_builds_every_documented_tokenizer() -> None:
    """``make tokenizers TOKENIZERS=...`` builds each bundled tokenizer offline into
    ``.tokenizers/<name>``, and every ``.tokenizers/<name>`` the docs and recipes use is one."""
    names = sorted(BUILDERS)
    plan = subprocess.run(
        ["make", "-n", "-B", "tokenizers", f"TOKENIZERS={' '.join(names)}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in names:
        assert f"-m tokenmill_dev.bundled {name} .tokenizers/{name}" in plan, plan
    texts = [p.read_text() for p in (*DOCS, *sorted((ROOT / "recipes").glob("*.yaml")))]
    used = {m for text in texts for m in re.findall(r"\.tokenizers/([\w-]+)", text)}
    assert used and used <= set(names), used


def test_cli_outputs_are_git_ignored() -> None:
    """The README's CLI block writes only under git-ignored folders (no untracked ``out/``)."""
    outputs = set()
    for argv in documented_commands(ROOT / "README.md"):
        for word in argv:
            if re.match(r"(out|data)/", word):
                outputs.add(word.split("/")[0] + "/x")
    assert outputs == {"out/x", "data/x"}
    for path in sorted(outputs):
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
        assert ignored.returncode == 0, f"{path} is not git-ignored"


def _write_jsonl(path: Path, docs: list[dict[str, str]], bad: list[bytes] = ()) -> Path:
    lines = [json.dumps(d, ensure_ascii=False).encode() for d in docs] + list(bad)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory, gpt2_dir: Path) -> Path:
    """``make demo``'s outputs, small: ``data/sources/{docs,code}`` (one docs shard with bad
    lines), ``.tokenizers/gpt2``, the shards' raw stats and tokens, and ``data/merged/<ds>/<v16>/``
    + ``current.json`` (virtual merges) made by the library the pipeline runs; the repo's
    ``docs/takedown-example.txt``."""
    root = tmp_path_factory.mktemp("demo")
    (root / "docs").mkdir()
    (root / "docs" / "takedown-example.txt").symlink_to(ROOT / "docs" / "takedown-example.txt")
    (root / ".tokenizers").mkdir()
    (root / ".tokenizers" / "gpt2").symlink_to(gpt2_dir)
    docs = list(itertools.islice(stdlib_documents(kind="docs"), 90))
    code = list(itertools.islice(stdlib_documents(kind="code"), 12))
    sources = root / "data" / "sources"
    shards = {
        "docs": [
            _write_jsonl(sources / "docs/part-00000.jsonl", docs[:40]),
            _write_jsonl(sources / "docs/part-00001.jsonl", docs[40:80]),
            _write_jsonl(sources / "docs/extra-00000.jsonl", docs[80:], [b'{"text": 42}', b"[1]"]),
        ],
        "code": [_write_jsonl(sources / "code/part-00000.jsonl", code)],
    }
    for ds, paths in shards.items():
        pairs = []
        for path in paths:
            key = path.name.removesuffix(".jsonl")
            out = root / "data" / layout.tokens_dir(ds) / key
            result = tokenize_files(
                [path], out, gpt2_dir, append_eod=True, on_bad_record="quarantine"
            )
            pairs.append((key, result.prefix))
            _write_raw_stats(root / "data", ds, key, path)
        version = version_hash({"demo": ds})
        merged = root / "data" / layout.merged_prefix(ds, "text", version)
        virtual_merge(sorted(pairs, key=lambda p: natural_key(p[0])), merged)  # merge: virtual
        target = merged.relative_to(root / "data" / layout.merged_dir(ds)).as_posix()
        write_pointer(root / "data" / layout.merged_pointer(ds), version, target)
    return root


def _write_raw_stats(root: Path, ds: str, key: str, path: Path) -> None:
    """The shard's ``raw/<ds>/<key>.stats.json`` as the pipeline's raw step writes it (what
    ``find``, ``explain`` and ``takedown`` read to map documents to source lines)."""
    stats = IngestStats(path=str(path.resolve()))
    with Quarantine(root / layout.raw_dir(ds) / f"{key}.quarantine.jsonl") as quarantine:
        for _ in read_jsonl_batches(
            path, on_bad_record="quarantine", quarantine=quarantine, stats=stats
        ):
            pass
    source = {"uri": str(path.resolve()), "bytes": path.stat().st_size, "sha256": "unused"}
    config = {"text_key": "text", "on_bad_record": "quarantine"}
    record = raw_stats_record(key, source, config, stats, None)
    write_record(root / layout.raw_stats(ds, key), record)


def test_every_documented_command_runs_as_written(
    demo_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = [c for path in DOCS for c in documented_commands(path)]
    run = [c for c in commands if c[0] not in NOT_HERE]
    assert len(run) >= 13 and {c[0] for c in run} >= {
        "tokenize", "merge", "index", "blend", "export", "inspect", "verify", "pull", "gc",
        "explain", "find", "takedown",
    }  # fmt: skip
    monkeypatch.chdir(demo_root)
    for argv in run:
        rc = main(argv)
        out, err = capsys.readouterr()
        assert rc == 0, f"tokenmill {shlex.join(argv)}: exit {rc}\n{out}\n{err}"
    # What the README says the lines leave behind.
    assert (demo_root / "out/docs/manifests/extra_text_document.manifest.json").is_file()
    assert len((demo_root / "out/docs/extra.quarantine.jsonl").read_text().splitlines()) == 2
    assert not (demo_root / "out/docs/part-00000.quarantine.jsonl").exists()
    pulled = demo_root / "out/copy"
    assert (pulled / "blends/mix/manifest.json").is_file()
    assert list(pulled.glob("merged/*/*/manifests/*_text_document.manifest.json"))
    assert main(["verify", str(pulled / "blends/mix")]) == 0
