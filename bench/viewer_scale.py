"""How the HTML viewer scales: a run of N episodes made by repeating the records of a real run.

    python -m bench.viewer_scale RUN_OR_EPISODES_JSONL --episodes 3000 [--browser]

Prints the time to build the page, its size, and with --browser (headless Chromium) the time until the
page has rendered its overview and table, and the time to open one episode.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "viewer"))

from harness.trajectory import TrajectoryWriter, iter_records  # noqa: E402
from harness.viewer import write_html  # noqa: E402
from harness.viewer.data import find_episodes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--episodes", type=int, default=3000)
    ap.add_argument("--browser", action="store_true")
    a = ap.parse_args()
    seeds = list(iter_records(find_episodes(a.run)))
    if not seeds:
        sys.exit("no records in that run")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        with TrajectoryWriter(run / "episodes.jsonl") as w:
            for i in range(a.episodes):
                rec = seeds[i % len(seeds)].model_copy()
                rec.task = rec.task.model_copy(update={"id": f"{rec.task.id}_{i // len(seeds)}"})
                rec.key = f"{rec.task.id}#{rec.sample}"
                w.append(rec)
        jsonl = (run / "episodes.jsonl").stat().st_size
        t0 = time.perf_counter()
        page = write_html(run)
        build = time.perf_counter() - t0
        print(f"{a.episodes} episodes: episodes.jsonl {jsonl / 1e6:.1f} MB, page {page.stat().st_size / 1e6:.1f} MB, "
              f"built in {build:.2f} s")
        if a.browser:
            from cdp import Chromium, find_chromium

            exe = find_chromium()
            if exe is None:
                sys.exit("no Chromium found")
            b = Chromium(exe, Path(tmp) / "profile")
            try:
                t0 = time.perf_counter()
                b.goto(page.as_uri())
                load = time.perf_counter() - t0
                rows = b.eval("document.querySelectorAll('#episodes tbody tr').length")
                t0 = time.perf_counter()
                b.eval(f"location.hash = '#ep/{a.episodes - 1}'")
                b.wait_for("!!document.getElementById('conversation')")
                ep = time.perf_counter() - t0
                print(f"browser: overview and table ({rows} rows shown) in {load:.2f} s; an episode in {ep:.3f} s")
            finally:
                b.close()


if __name__ == "__main__":
    main()
