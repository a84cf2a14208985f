"""Two processes annotating one run at once lose nothing (two explorers, or an explorer and an import).

The audit's wrong result: two `ffkv serve` processes on one run lost 9 of 20 concurrent labels, the
lock being one per process. Each save is a read-merge-rewrite of labels.parquet; the file lock
around it makes the saves of all processes land.
"""

from __future__ import annotations

import subprocess
import sys
import time

from ffkv.store.annotations import read_labels

SAVES = 25
ANNOTATE = """
import sys, time
from pathlib import Path
from ffkv.store.annotations import Annotations
run, who, start = sys.argv[1:4]
store = Annotations(run)
Path(start + "." + who).write_text("ready")
while not Path(start).exists():
    time.sleep(0.005)
for key in range({saves}):
    store.save(0, key, "shallow", "a label", who)
""".format(saves=SAVES)


def test_two_processes_saving_at_once_lose_nothing(tmp_path):
    start = tmp_path / "start"
    writers = [subprocess.Popen([sys.executable, "-c", ANNOTATE, str(tmp_path), who, str(start)])
               for who in ("ann", "bob")]
    deadline = time.time() + 120
    while not all((tmp_path / f"start.{who}").exists() for who in ("ann", "bob")) and time.time() < deadline:
        time.sleep(0.01)
    start.write_text("go")  # both imported and wait at the start line
    assert [w.wait(120) for w in writers] == [0, 0]
    labels = read_labels(tmp_path)
    assert len(labels) == 2 * SAVES
    assert labels.groupby("annotator").size().to_dict() == {"ann": SAVES, "bob": SAVES}
    assert not list((tmp_path / "annotations").glob("*.tmp"))
