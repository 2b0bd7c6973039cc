"""What /metrics costs the proxy: CPU per request with metrics off and on, in one run.

    python bench/metrics_cost.py [--rounds 4] [--seconds 5] [--connections 64]

Two gym-proxy servers (2 ASGI counter workers each, the routing bench's app): one
without `--metrics`, one with it, measured both while a scraper reads `/metrics` every
second (a Prometheus scrape interval 5-15x shorter than usual) and while nobody does.
The load (bench/loadgen.py, the routing bench's pooled client) runs against each of the
three in turn, `--rounds` times, in alternating order, so they share the machine's
noise; the table gives each round and the medians. The data path counts what /metrics
shows whether or not `--metrics` is given, so the scraped-against-not-scraped ratio, in
one process, is what the metrics cost. Target: at most 1.03x the proxy CPU per request.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing import measure  # noqa: E402
from servers import GymProxy, free_port  # noqa: E402


class Scraper:
    """GET /metrics every `interval` seconds while `on` is set; counts the scrapes."""

    def __init__(self, url: str, interval: float = 1.0) -> None:
        self.url, self.interval = url, interval
        self.scrapes = 0
        self.on = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            if self.on.is_set():
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    response.read()
                self.scrapes += 1

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)


ROWS = ("no --metrics", "--metrics, not scraped", "--metrics, scraped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=512)
    opts = parser.parse_args()
    metrics_port = free_port()
    plain = GymProxy(2)
    scraped = GymProxy(2, "--metrics", f"127.0.0.1:{metrics_port}")
    scraper = Scraper(f"http://127.0.0.1:{metrics_port}/metrics")
    directory = tempfile.mkdtemp(prefix="gpmc-", dir="/tmp")
    rows: dict[str, list[dict]] = {name: [] for name in ROWS}
    try:
        fronts = {
            ROWS[0]: plain.front_end(opts.sessions),
            ROWS[1]: scraped.front_end(opts.sessions),
        }
        fronts[ROWS[2]] = fronts[ROWS[1]]
        for name, front in list(fronts.items())[:2]:
            front.name = name.replace(" ", "-").replace(",", "")  # one plan file each
        plans = {name: front.plan(directory) for name, front in fronts.items()}
        for round_index in range(opts.rounds):
            order = list(ROWS) if round_index % 2 == 0 else list(reversed(ROWS))
            for name in order:
                scraper.on.set() if name == ROWS[2] else scraper.on.clear()
                cell = measure(fronts[name], plans[name], opts.seconds, opts.connections)
                rows[name].append(cell)
                print(f"  round {round_index + 1} {name:<24} {cell['rps']:>9,.0f} req/s "
                      f"{cell['front_cpu_us']:.1f} us/req", file=sys.stderr)  # fmt: skip
    finally:
        scraper.stop()
        plain.stop()
        scraped.stop()
    print(f"\n{opts.connections} connections, {opts.seconds:g} s per cell, 2 workers; "
          f"{scraper.scrapes} scrapes of /metrics, one a second while scraped\n")  # fmt: skip
    print("| | " + " | ".join(f"{n}: req/s | {n}: proxy us/req" for n in ROWS) + " |")
    print("|---|" + "---|---|" * len(ROWS))
    for i in range(opts.rounds):
        cells = [rows[n][i] for n in ROWS]
        line = " | ".join(f"{c['rps']:,.0f} | {c['front_cpu_us']:.2f}" for c in cells)
        print(f"| round {i + 1} | {line} |")
    medians = [statistics.median(c["front_cpu_us"] for c in rows[n]) for n in ROWS]
    print("| median | " + " | ".join(f" | {m:.2f}" for m in medians) + " |")
    scrape = medians[2] / medians[1]
    listener = medians[1] / medians[0]
    total = medians[2] / medians[0]
    verdict = "ok" if total <= 1.03 else "MISSED"
    print(f"\nscraped / not scraped (one process: what the scrapes cost): {scrape:.3f}x")
    print(f"--metrics not scraped / no --metrics (two processes: includes their noise): "
          f"{listener:.3f}x")  # fmt: skip
    print(f"metrics on and scraped / no --metrics: {total:.3f}x (target <= 1.03x: {verdict})")


if __name__ == "__main__":
    main()
