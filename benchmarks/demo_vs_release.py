"""`ffkv demo` against an earlier release, side by side: both times and each step's.

Each side is a fresh Python process running the README's first command's job (`ffkv.demo.run_demo`) into its own
new run directory: this checkout's `src/` against the source of `--base` (a git revision, unpacked with
`git archive` into `--work`), both on this environment's packages. The sides take turns (the order alternates),
`--repeats` times. For each run it prints the wall and CPU time (user + system) of the whole process, the load
average before it, the index's seconds and every analyze step's (from the run's manifest), and it writes them all
to `--out` (JSON). Goal: the demo within 2 minutes on an idle 2-core machine.

    python benchmarks/demo_vs_release.py --base REV [--repeats 2] [--work /tmp/ffkv-demo-bench] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

RUN = "from ffkv.demo import run_demo; run_demo({out!r}, progress=False)"


def unpack(revision: str, folder: Path) -> Path:
    """The source tree of `revision` in `folder` (made once; `git archive`, so no checkout is touched)."""
    if not (folder / "src" / "ffkv").is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(HERE), "archive", revision], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def run_side(source: Path, out: Path) -> dict:
    """One demo in a fresh process on `source`'s package: wall and CPU seconds, load before, per-step seconds."""
    shutil.rmtree(out, ignore_errors=True)
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(source / "src")}
    subprocess.run([sys.executable, "-c", RUN.format(out=str(out))], check=True, env=env, cwd=source,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    steps = {"index": manifest.get("timings", {}).get("index_seconds")}
    steps.update({name: info.get("seconds") for name, info in manifest.get("analyses", {}).items()})
    return {"wall": round(wall, 2), "cpu": round(cpu, 2), "load": round(load, 2), "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the earlier release: a git revision of this repository")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ffkv-demo-bench"))
    parser.add_argument("--out", type=Path, default=None, help="write every measurement here (JSON)")
    args = parser.parse_args()
    base = unpack(args.base, args.work / f"base-{args.base}")
    sides = {"base": base, "now": HERE}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]
        for name in order:
            got = run_side(sides[name], args.work / f"run-{name}")
            results[name].append(got)
            print(f"{name:5} wall {got['wall']:7.1f} s  cpu {got['cpu']:7.1f} s  load {got['load']:.2f}", flush=True)
    steps = list(dict.fromkeys(s for runs in results.values() for r in runs for s in r["steps"]))
    print(f"\n{'step':22}" + "".join(f"{name:>16}" for name in sides) + "   (median seconds)")
    for step in ["wall", "cpu", *steps]:
        cells = []
        for name in sides:
            values = [r[step] if step in ("wall", "cpu") else r["steps"].get(step) for r in results[name]]
            values = [v for v in values if v is not None]
            cells.append(f"{statistics.median(values):16.1f}" if values else f"{'-':>16}")
        print(f"{step:22}" + "".join(cells))
    if args.out:
        args.out.write_text(json.dumps({"base": args.base, "results": results}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
