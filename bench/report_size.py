"""How big the report page is and how long it takes to write, by graph size: a target of a few MB
for a 200-node graph.

    .venv/bin/python bench/report_size.py [-o bench/results/report_size.json]

For each graph (resnet50 and vgg16 imported from PipeDream's profiles; chains of 240 and 1,000
nodes with a skip edge every third node), dp's plan on hetero-4 (uniform for the chains), then
`plan_data` + `write_page` timed, and the page's bytes split into plotly.js and the rest; then the
time headless Chromium takes from opening the file to the figures drawn (`body[data-rendered=yes]`).
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.io.pipedream import import_pipedream
from hetplan.planners import PlanOptions, make_plan
from hetplan.report.page import _plotly_bundle, write_page
from hetplan.report.sources import plan_data

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from test_report_page import chain_graph  # noqa: E402

SHARED = REPO.parent / "shared" / "data" / "pipedream-profiles"


def graphs():
    for name in ("resnet50", "vgg16"):
        yield name, import_pipedream(SHARED / name / "graph.txt"), "dp"
    for n in (240, 1000):
        yield f"chain-{n}", chain_graph(n), "uniform"


def drawn_s(page: Path) -> float:
    """Seconds from opening the page in headless Chromium to every figure drawn."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu"])
        tab = browser.new_page(viewport={"width": 1300, "height": 900})
        t0 = time.perf_counter()
        tab.goto(page.resolve().as_uri())
        tab.wait_for_selector("body[data-rendered=yes]", timeout=120_000)
        took = time.perf_counter() - t0
        browser.close()
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", type=Path, default=REPO / "bench" / "results" / "report_size.json")
    args = ap.parse_args()
    cluster, rows = load_cluster("hetero-4"), []
    plotly_bytes = len(_plotly_bundle())
    with tempfile.TemporaryDirectory() as tmp:
        for name, graph, planner in graphs():
            plan = make_plan(graph, cluster, planner, PlanOptions(microbatches=8 if planner == "uniform" else None))
            t0 = time.perf_counter()
            page = write_page(plan_data(plan, graph, cluster, name), Path(tmp) / f"{name}.html")
            took = time.perf_counter() - t0
            size, drawn = page.stat().st_size, drawn_s(page)
            rows.append({"graph": name, "nodes": len(graph.nodes), "edges": len(graph.edges), "planner": planner,
                         "stages": len(plan.stages), "microbatches": plan.microbatches, "page_bytes": size,
                         "plotly_bytes": plotly_bytes, "data_bytes": size - plotly_bytes, "write_s": took,
                         "drawn_in_chromium_s": drawn})
            print(f"{name:>10}: {len(graph.nodes):5d} nodes, {len(plan.stages)} stages x {plan.microbatches} "
                  f"micro-batches: page {size / 1e6:.2f} MB (plotly.js {plotly_bytes / 1e6:.2f} MB, the rest "
                  f"{(size - plotly_bytes) / 1e6:.2f} MB), written in {took:.2f} s, drawn in Chromium in {drawn:.2f} s",
                  flush=True)
    serde.atomic_write_text(args.output, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
