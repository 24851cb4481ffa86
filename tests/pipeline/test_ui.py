"""The UI, for real: ``tokenmill materialize`` into a fresh instance, then ``dagster dev`` on a
free loopback port; the GraphQL API lists the asset graph and the materialization metadata, and
headless Chromium renders an asset page with the histogram image. Processes stop by their PID."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import process_group
from cdp_client import CHROMIUM, Browser
from pipeline_project import ROOT, make_project

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)"
)
STAGES = ("dataset_info", "hf_dataset", "merged", "nanoset", "pruned", "raw_jsonl", "tokens")
METADATA_QUERY = """
{ assetOrError(assetKey: {path: ["docs", "merged"]}) { ... on Asset {
    assetMaterializations(limit: 1) { metadataEntries { label
      ... on IntMetadataEntry { intValue }
      ... on MarkdownMetadataEntry { mdStr } } } } } }
"""


# First visit: Dagster offers a newsletter dialog; "Skip" it so the screenshot shows the page.
SKIP_COMMUNITY_DIALOG = """(() => { const skip = [...document.querySelectorAll('button')]
    .find(b => b.innerText.trim() === 'Skip'); if (skip) skip.click(); return true; })()"""
# Markdown metadata under 1,000 characters is drawn inline in the metadata table (longer markdown
# hides behind a "[Show Markdown]" link): the histogram's row holds a rendered table with bars.
HISTOGRAM_INLINE = """(() => {
  for (const row of document.querySelectorAll('tr')) {
    const table = row.querySelector('table');
    const text = row.innerText;
    if (text.startsWith('length_histogram') && table && !text.includes('Show Markdown'))
      return [table.querySelectorAll('tr').length, table.innerText.includes('\u2588')];
  }
  return null; })()"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def graphql(port: int, query: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read())["data"])


@pytest.fixture(scope="module")
def ui(
    tmp_path_factory: pytest.TempPathFactory,
    gpt2_dir: Path,
    documents: dict[str, list[dict[str, str]]],
) -> Iterator[tuple[int, Path]]:
    """A materialized tiny project served by ``dagster dev``: (port, work dir)."""
    work = tmp_path_factory.mktemp("ui")
    recipe = make_project(work, gpt2_dir, documents)
    env = {**os.environ, "DAGSTER_HOME": str(work / "home"), "TOKENMILL_RECIPE": str(recipe.path)}
    tokenmill = Path(sys.executable).with_name("tokenmill")
    done = subprocess.run(
        [str(tokenmill), "materialize"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Summary" in done.stdout and "open_blend(" in done.stdout
    assert (work / "home" / "dagster.yaml").is_file()
    port = free_port()
    dagster = Path(sys.executable).with_name("dagster")
    command = [str(dagster), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)]
    log = work / "dagster-dev.log"
    with process_group(command, cwd=ROOT, env=env, log=log, term_seconds=20) as process:
        deadline = time.monotonic() + 120
        while True:
            try:
                graphql(port, "{ version }")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "dagster dev did not answer in 120 s"
                time.sleep(1)
        yield port, work


def test_graphql_asset_graph_and_metadata(ui: tuple[int, Path]) -> None:
    port, _ = ui
    nodes = graphql(port, "{ assetNodes { assetKey { path } } }")["assetNodes"]
    keys = sorted("/".join(n["assetKey"]["path"]) for n in nodes)
    assert keys == ["blend/mix"] + [f"{ds}/{stage}" for ds in ("code", "docs") for stage in STAGES]
    asset = graphql(port, METADATA_QUERY)["assetOrError"]
    entries = {e["label"]: e for e in asset["assetMaterializations"][0]["metadataEntries"]}
    assert entries["documents"]["intValue"] == 40
    histogram = entries["length_histogram"]["mdStr"]
    assert "| tokens from | count | |" in histogram and len(histogram) < 1000


def test_asset_page_renders_histogram_and_metadata(ui: tuple[int, Path]) -> None:
    port, work = ui
    with Browser(work / "chromium-profile") as browser:
        browser.navigate(f"http://127.0.0.1:{port}/assets/docs/merged")
        browser.wait_for("document.body.innerText.includes('length_histogram')")
        text = browser.evaluate("document.body.innerText")
        for label in ("documents", "tokens", "bytes_written", "extends", "content_hash", "version"):
            assert label in text
        browser.evaluate(SKIP_COMMUNITY_DIALOG)
        rows, bars = browser.wait_for(HISTOGRAM_INLINE, timeout=30)
        assert "buckets [lo, 2·lo)" in browser.evaluate("document.body.innerText")
        browser.screenshot(work / "asset-page.png")
    assert rows >= 3 and bars  # header + at least two buckets, drawn as text bars
    assert (work / "asset-page.png").stat().st_size > 10_000


CHECKS_QUERY = """
{ assetNodeOrError(assetKey: {path: ["docs", "tokens"]}) { ... on AssetNode {
    assetChecksOrError { ... on AssetChecks { checks { name
      executionForLatestMaterialization { status }
      partitionStatuses { ... on AssetCheckDefaultPartitionStatuses {
        succeededPartitions failedPartitions skippedPartitions executionFailedPartitions } }
} } } } } }
"""


def test_partitioned_checks_show_one_status(ui: tuple[int, Path]) -> None:
    """Issue 21: the shards ran as one range; the check list (partition statuses) said
    "Skipped" while the check's latest evaluation said "Passed". Both say passed now."""
    port, work = ui
    node = graphql(port, CHECKS_QUERY)["assetNodeOrError"]
    checks = node["assetChecksOrError"]["checks"]
    assert {c["name"] for c in checks} == {"idx_bin_consistent", "documents_match_export"}
    for check in checks:
        assert check["executionForLatestMaterialization"]["status"] == "SUCCEEDED"
        statuses = check["partitionStatuses"]
        assert sorted(statuses["succeededPartitions"]) == [
            "extra-00000",
            "part-00000",
            "part-00001",
            "part-00002",
        ]
        assert statuses["skippedPartitions"] == statuses["failedPartitions"] == []
    with Browser(work / "chromium-profile") as browser:
        browser.navigate(f"http://127.0.0.1:{port}/assets/docs/tokens?view=checks")
        browser.wait_for("document.body.innerText.includes('documents_match_export')")
        browser.evaluate(SKIP_COMMUNITY_DIALOG)
        browser.wait_for("document.body.innerText.includes('Latest execution')", timeout=30)
        text = browser.evaluate("document.body.innerText")
    # the list (one row per check) and the selected check's latest evaluation agree
    listed = text.split("Execute all", 1)[1].split("Latest execution", 1)[0]
    assert listed.count("Succeeded") == 2 and "Skipped" not in listed
    assert "Evaluation result\nPassed" in text
