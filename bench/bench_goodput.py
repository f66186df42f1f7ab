"""Goodput, disaggregated vs colocated on the same cores (issue 16): the serving suite's goodput scenarios alone.

    python bench/bench_goodput.py [--llama-server PATH] [--threads 2] [--goodput-long-len 256-1024] [...]

is `pdserve bench --suite cpu --only goodput --systems llama-server pdserve-colocated pdserve-1p1d-pinned ...`:
every flag of `pdserve bench` applies (a later --systems replaces the default list, e.g. to leave llama-server
out). It writes results.json, goodput_vs_rate.png and report.md into --out (bench/results/<date> by default);
the SLO formula and the definitions are in pdserve/bench/goodput.py.
"""

from __future__ import annotations

import sys

from pdserve import cli
from pdserve.bench.suite import GOODPUT_SYSTEMS


def main(argv: list[str]) -> int:
    return cli.main(["bench", "--suite", "cpu", "--only", "goodput", "--systems", *GOODPUT_SYSTEMS, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
