"""What /metrics costs the proxy: CPU per request with metrics off and on, in one run.

    python bench/metrics_cost.py [--rounds 4] [--seconds 5] [--connections 64]

Two gym-proxy servers (2 ASGI counter workers each, the routing bench's app): one plain,
one with `--metrics` and a scraper reading `/metrics` every second (a Prometheus scrape
interval 5-15x shorter than usual). The load (bench/loadgen.py, the routing bench's
pooled client) runs against each in turn, `--rounds` times, alternating, so the two share
the machine's noise; the table gives each round and the median. The data path counts
what /metrics shows whether or not `--metrics` is given, so this measures the scrapes.
Target: metrics on costs at most 1.03x the proxy CPU per request of metrics off.
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
    """GET /metrics every `interval` seconds until stopped; counts the scrapes."""

    def __init__(self, url: str, interval: float = 1.0) -> None:
        self.url, self.interval = url, interval
        self.scrapes = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            with urllib.request.urlopen(self.url, timeout=5) as response:
                response.read()
            self.scrapes += 1

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)


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
    rows: dict[str, list[dict]] = {"metrics off": [], "metrics on": []}
    try:
        fronts = {
            "metrics off": plain.front_end(opts.sessions),
            "metrics on": scraped.front_end(opts.sessions),
        }
        plans = {
            name: front.plan(f"{directory}/{i}") for i, (name, front) in enumerate(fronts.items())
        }
        for round_index in range(opts.rounds):
            order = list(fronts) if round_index % 2 == 0 else list(reversed(fronts))
            for name in order:
                cell = measure(fronts[name], plans[name], opts.seconds, opts.connections)
                rows[name].append(cell)
                print(f"  round {round_index + 1} {name:<12} {cell['rps']:>9,.0f} req/s "
                      f"{cell['front_cpu_us']:.1f} us/req", file=sys.stderr)  # fmt: skip
    finally:
        scraper.stop()
        plain.stop()
        scraped.stop()
    print(f"\n{opts.connections} connections, {opts.seconds:g} s per cell, 2 workers; "
          f"{scraper.scrapes} scrapes of /metrics\n")  # fmt: skip
    print(
        "| round | off: req/s | off: proxy CPU us/req | on: req/s | on: proxy CPU us/req "
        "| on / off |"
    )
    print("|---|---|---|---|---|---|")
    ratios = []
    for i, (off, on) in enumerate(zip(rows["metrics off"], rows["metrics on"], strict=True)):
        ratio = on["front_cpu_us"] / off["front_cpu_us"]
        ratios.append(ratio)
        print(f"| {i + 1} | {off['rps']:,.0f} | {off['front_cpu_us']:.2f} | {on['rps']:,.0f} | "
              f"{on['front_cpu_us']:.2f} | {ratio:.3f}x |")  # fmt: skip
    off_cpu = statistics.median(c["front_cpu_us"] for c in rows["metrics off"])
    on_cpu = statistics.median(c["front_cpu_us"] for c in rows["metrics on"])
    print(f"| median | | {off_cpu:.2f} | | {on_cpu:.2f} | {on_cpu / off_cpu:.3f}x |")
    verdict = "ok" if on_cpu / off_cpu <= 1.03 else "MISSED"
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}x"
    print(f"\nmetrics on / off, proxy CPU per request: {on_cpu / off_cpu:.3f}x "
          f"(target <= 1.03x: {verdict}); per-round ratios {spread}")  # fmt: skip


if __name__ == "__main__":
    main()
