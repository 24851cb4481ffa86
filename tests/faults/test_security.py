"""Security, statically and by behaviour (issue 6 §4, the parts not about secrets): the dev UI binds
loopback only; library code never unpickles, evals or loads YAML/torch unsafely (an AST scan of
tokenmill/, assets/, pipelines/ and bench/); and the readers never run anything found in data —
payloads that would create a file when unpickled or evaluated are refused or kept as plain data,
and the file never appears.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import shlex
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from tiny_pairs import build_blend_at

from tokenmill.atomic import file_sha256
from tokenmill.cli import main
from tokenmill.errors import CacheError, ConfigError, FormatError
from tokenmill.formats.blend_manifest import seal
from tokenmill.formats.dataset_manifest import write_dataset_manifest
from tokenmill.formats.indexed import IndexedDatasetWriter
from tokenmill.indices.nanoset import build_or_load
from tokenmill.indices.settings import NanosetSettings
from tokenmill.loader import open_blend, open_nanoset
from tokenmill.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_DIRS = ("tokenmill", "tokenmill_dev", "assets", "pipelines", "bench")


# -- network exposure -----------------------------------------------------------------------------
def test_make_dev_serves_the_ui_on_loopback_only() -> None:
    """``make dev`` runs ``dagster dev -h 127.0.0.1`` (under the ``pipelines.dev`` supervisor; dry
    run: nothing is executed)."""
    out = subprocess.run(
        ["make", "-n", "dev"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    commands = [shlex.split(line) for line in out.splitlines() if " dev -w " in line]
    assert len(commands) == 1, out
    line = commands[0]
    start = next(i for i, w in enumerate(line) if Path(w).name == "dagster")
    assert line[start - 2 : start] == ["-m", "pipelines.dev"], out
    words = line[start:]
    assert words[1] == "dev"
    hosts = [words[i + 1] for i, w in enumerate(words) if w in ("-h", "--host")]
    assert hosts == ["127.0.0.1"]
    assert "0.0.0.0" not in (ROOT / "Makefile").read_text()


def test_deployment_configs_expose_nothing_beyond_the_cluster() -> None:
    """The one wildcard bind is the code server's gRPC port inside its container (the webserver
    and daemon reach it over the pod/task network; nothing publishes it). The chart keeps the UI
    on a ClusterIP service without an ingress."""
    binds = []
    for path in [*sorted((ROOT / "infra").rglob("*")), ROOT / "workspace.yaml"]:
        if path.is_file() and "0.0.0.0" in path.read_text():
            lines = [ln.strip() for ln in path.read_text().splitlines() if "0.0.0.0" in ln]
            binds += [(path.relative_to(ROOT).as_posix(), ln) for ln in lines]
    assert binds == [
        (
            "infra/Dockerfile",
            'CMD ["dagster", "api", "grpc", "--host", "0.0.0.0", "--port", "3030", \\',
        )
    ]
    values = yaml.safe_load((ROOT / "infra/helm/values.yaml").read_text())
    webserver = values.get("dagsterWebserver", {})
    assert webserver.get("service", {}).get("type", "ClusterIP") == "ClusterIP"
    assert not webserver.get("ingress", {}).get("enabled", False)
    assert not values.get("ingress", {}).get("enabled", False)
    for deployment in values["dagster-user-deployments"]["deployments"]:
        assert deployment.get("service", {}).get("type", "ClusterIP") == "ClusterIP"


# -- static scan of library code ------------------------------------------------------------------
FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def _dotted(node: ast.AST) -> str:
    """``np.load`` for an Attribute chain of Names, "" otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.AST | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _call_problems(call: ast.Call, aliases: dict[str, str]) -> list[str]:
    """What is unsafe about one call (names resolved through the module's import aliases)."""
    name = _dotted(call.func)
    head, _, rest = name.partition(".")
    full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
    problems = []
    if full == "numpy.load" and not _is_const(_keyword(call, "allow_pickle"), False):
        problems.append("np.load without a literal allow_pickle=False")
    if full in ("eval", "exec", "builtins.eval", "builtins.exec"):
        problems.append(f"{full}()")
    if full in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
        problems.append(f"{full}()")
    if full in ("yaml.load", "yaml.load_all"):
        loader = _keyword(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
        if _dotted(loader).rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS:
            problems.append(f"{full}() without a safe Loader")
    if full in ("torch.load", "pandas.read_pickle"):
        problems.append(f"{full}()")
    if _is_const(_keyword(call, "trust_remote_code"), True):
        problems.append("trust_remote_code=True")
    if full.startswith("subprocess.") and _is_const(_keyword(call, "shell"), True):
        problems.append(f"{full}(shell=True)")
    return problems


def scan(source: str) -> tuple[list[str], int]:
    """Unsafe constructs in one module (``line: what``) and how many ``np.load`` calls it has."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[(alias.asname or alias.name).split(".")[0]] = alias.name.split(".")[0]
                if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                    problems.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                problems.append(f"{node.lineno}: from {node.module} import ...")
    loads = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            problems += [f"{node.lineno}: {p}" for p in _call_problems(node, aliases)]
            name = _dotted(node.func)
            head, _, rest = name.partition(".")
            loads += (f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head)) == (
                "numpy.load"
            )
    return problems, loads


def test_the_scanner_catches_what_it_looks_for() -> None:
    bad = """
import numpy as np, pickle, yaml, torch, subprocess
from numpy import load as npload
from yaml import load
np.load("x")
np.load("x", allow_pickle=True)
npload("x", allow_pickle=flag)
eval("1")
yaml.load(text)
load(text, Loader=yaml.FullLoader)
torch.load("w.pt")
AutoTokenizer.from_pretrained(p, trust_remote_code=True)
subprocess.run(cmd, shell=True)
np.load("x", allow_pickle=False)
yaml.load(text, Loader=yaml.SafeLoader)
"""
    problems, loads = scan(bad)
    assert [p.split(": ", 1)[0] for p in problems] == [
        "2", "5", "6", "7", "8", "9", "10", "11", "12", "13"
    ]  # fmt: skip
    assert loads == 4


def test_library_code_never_unpickles_or_evaluates() -> None:
    found: dict[str, list[str]] = {}
    total_loads = 0
    for folder in LIBRARY_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            problems, loads = scan(path.read_text(encoding="utf-8"))
            total_loads += loads
            if problems:
                found[path.relative_to(ROOT).as_posix()] = problems
    assert found == {}
    assert total_loads >= 4  # the scan saw the real np.load calls (index cache, loader, tokenizer)


# -- nothing from data is ever executed -----------------------------------------------------------
class Payload:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): the classic pickle exploit."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _plant(path: Path, marker: Path, rows: int) -> None:
    """Overwrite an ``.npy`` with an object array of payloads (what ``np.save`` pickles)."""
    np.save(path, np.array([Payload(marker)] * rows, dtype=object), allow_pickle=True)


def _rehash(entry: dict[str, Any], path: Path) -> None:
    entry.update(bytes=path.stat().st_size, sha256=file_sha256(path))


@pytest.fixture
def built(tmp_path: Path) -> dict[str, Path]:
    """Two datasets, an index of ``a`` and a blend ``mix`` of both under ``tmp_path/root``."""
    root = tmp_path / "root"
    for seed, name in enumerate("ab"):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, 30, 60)
        with IndexedDatasetWriter(root / "merged" / name, np.uint16) as writer:
            writer.add_documents(rng.integers(0, 50000, int(lengths.sum())), lengths)
        write_dataset_manifest(root / "merged" / name, kind="merged", inputs=[], config={},
                               counts={})  # fmt: skip
    index = build_or_load(
        root / "merged/a", root / "idx", "train", NanosetSettings(sequence_length=8)
    )
    assert index is not None
    datasets = {"a": root / "merged/a", "b": root / "merged/b"}
    fields = {"sequence_length": 8, "split_spec": "90,10,0", "train_samples": 30}
    build_blend_at(root, "mix", datasets, weights={"a": 1, "b": 1}, **fields)
    return {
        "root": root,
        "blend": root / "blends/mix/manifest.json",
        "index": index.paths["description"],
        "shuffle": index.paths["shuffle"],
    }


def test_the_payload_is_live(tmp_path: Path) -> None:
    """Control: loading the planted file the unsafe way does run it."""
    marker = tmp_path / "pwned"
    _plant(tmp_path / "x.npy", marker, 2)
    np.load(tmp_path / "x.npy", allow_pickle=True)
    assert marker.exists()


def test_pickled_index_is_refused_even_when_its_hashes_match(
    built: dict[str, Path], tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    shuffle, description = built["shuffle"], built["index"]
    _plant(shuffle, marker, 3)
    record = json.loads(description.read_text())
    _rehash(record["files"]["shuffle"], shuffle)
    record["files"]["shuffle"].update(dtype="|O")
    description.write_text(json.dumps(record))
    with pytest.raises(FormatError, match=r"shuffle_index: unreadable \.npy"):
        open_nanoset(built["root"] / "merged/a", index=description)
    rebuilt = build_or_load(
        built["root"] / "merged/a",
        built["root"] / "idx",
        "train",
        NanosetSettings(sequence_length=8),
    )
    assert rebuilt is not None and rebuilt.shuffle_index.dtype.kind == "u"
    assert not marker.exists()


def test_pickled_blend_array_is_refused_even_when_its_hashes_match(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    mpath = built["blend"]
    manifest = json.loads(mpath.read_text())
    for array in ("dataset_index", "dataset_sample_index"):
        path = mpath.parent / manifest["splits"]["train"]["files"][array]["path"]
        _plant(path, marker, 4)
        _rehash(manifest["splits"]["train"]["files"][array], path)
    mpath.write_text(json.dumps(seal(manifest)))  # sealed again: hashes and sizes all match
    with pytest.raises(FormatError, match=r"dataset_index: unreadable \.npy"):
        open_blend(mpath, "train", verify="full")
    assert main(["inspect", str(mpath)]) == 1
    assert "unreadable .npy" in capsys.readouterr().err
    assert main(["verify", str(mpath)]) == 1  # sizes and hashes match; loading refuses
    assert "unreadable .npy" in capsys.readouterr().out
    assert not marker.exists()


def test_pickle_or_python_in_place_of_a_manifest_is_never_run(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    blob = pickle.dumps(Payload(marker))
    built["blend"].write_bytes(blob)
    with pytest.raises(FormatError, match="manifest: not valid JSON"):
        open_blend(built["blend"])
    dataset_manifest = built["root"] / "merged/manifests/a.manifest.json"
    dataset_manifest.write_bytes(blob)
    assert main(["verify", str(built["root"] / "merged/a")]) == 1
    assert "manifest: not valid JSON" in capsys.readouterr().out
    built["index"].write_text(f"__import__('builtins').open({str(marker)!r}, 'w')")
    with pytest.raises(FormatError, match="description: not valid JSON"):
        open_nanoset(built["root"] / "merged/b", index=built["index"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"datasets: !!python/object/apply:builtins.open [{str(marker)!r}, w]\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(recipe)
    assert not marker.exists()


def test_code_looking_strings_in_a_manifest_stay_data(
    built: dict[str, Path], tmp_path: Path
) -> None:
    """Strings and objects shaped like code (a Python expression, a ``__reduce__`` /
    jsonpickle-style object) in the fields a reader only displays are kept as data."""
    marker = tmp_path / "pwned"
    expression = f"__import__('builtins').open({str(marker)!r}, 'w')"
    mpath = built["blend"]
    manifest = json.loads(mpath.read_text())
    manifest["name"] = expression
    manifest["weighting"]["weights"] = {
        "py/reduce": [{"py/function": "builtins.open"}, [expression]]
    }
    mpath.write_text(json.dumps(seal(manifest)))
    blend = open_blend(mpath, "train", verify="full")
    assert blend.manifest["name"] == expression and len(blend) > 0
    description = json.loads(built["index"].read_text())
    description["key"]["__reduce__"] = ["builtins.open", [str(marker), "w"]]
    built["index"].write_text(json.dumps(description))
    with pytest.raises(CacheError, match="remove the entry's files to rebuild"):
        build_or_load(
            built["root"] / "merged/a",
            built["root"] / "idx",
            "train",
            NanosetSettings(sequence_length=8),
        )
    assert not marker.exists()
    assert os.listdir(tmp_path) == ["root"]
