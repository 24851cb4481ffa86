"""The pull ledger: what a crash leaves is read back safely, and trust follows the file."""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.storage.pull_ledger import LEDGER_NAME, Ledger


def test_a_torn_last_line_is_ignored_and_the_next_record_starts_a_new_line(
    tmp_path: Path,
) -> None:
    ledger = Ledger(tmp_path)
    ledger.start("a.bin", "k1")
    ledger.blocks_done("a.bin", "k1", [0])
    ledger.release()
    with open(tmp_path / LEDGER_NAME, "ab") as fh:  # a crash in the middle of a write
        fh.write(b'{"block":"a.bin","key":"k1","i":[')
    ledger = Ledger(tmp_path)
    assert ledger.blocks("a.bin", "k1") == {0}
    ledger.blocks_done("a.bin", "k1", [2, 3])
    ledger.release()
    assert Ledger(tmp_path).blocks("a.bin", "k1") == {0, 2, 3}


def test_blocks_belong_to_one_partial_and_one_content(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.start("a.bin", "k1")
    ledger.blocks_done("a.bin", "k1", [3])
    assert ledger.blocks("a.bin", "k2") == set()  # other content wanted: nothing to trust
    ledger.start("a.bin", "k1")  # a fresh partial: the earlier blocks are void
    assert ledger.blocks("a.bin", "k1") == set()
    ledger.release()


def test_a_complete_file_is_trusted_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"abc")
    ledger = Ledger(tmp_path)
    ledger.done("a.bin", "3:x", path)
    assert ledger.trusted("a.bin", "3:x", path) and not ledger.trusted("a.bin", "3:y", path)
    ledger.compact(["a.bin"])
    ledger.release()
    ledger = Ledger(tmp_path)
    assert ledger.trusted("a.bin", "3:x", path)
    os.utime(path, ns=(1, 1))  # rewritten, or touched: checked again
    assert not ledger.trusted("a.bin", "3:x", path)
    ledger.compact([])
    ledger.release()
    assert (tmp_path / LEDGER_NAME).read_bytes() == b""
