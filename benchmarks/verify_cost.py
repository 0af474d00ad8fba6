"""What a verification step costs against the forward-time curve's timing of it: steps of n rows over the
curve's context, keeping one row's logits (as a prefill chunk does, and as the curve was timed before) and
keeping every row's (as a verification does, and as the curve is timed now), alternated in one process, on
the default engine (`specstream serve`'s: compiled forward, default kernels). Prints ms and each time over a
one-row step's. Each repeat runs the sizes largest first, each timed step after --lead-in untimed steps of its own
shape: a step right after a much larger one runs slower for a few steps, as calibration.CostModel.measure notes.

    .venv/bin/python benchmarks/verify_cost.py
    .venv/bin/python benchmarks/verify_cost.py --rows 1 2 4 8 16 32 --repeats 40
    .venv/bin/python benchmarks/verify_cost.py --rows 1 2 3 4 5 6 8 12 16 --context 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from quant_forward import cpu_name  # noqa: E402

from specstream import Engine, EngineConfig, SpeculativeConfig  # noqa: E402
from specstream.calibration import CONTEXT, throwaway_tables  # noqa: E402
from specstream.model.runner import ForwardItem  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--lead-in", type=int, default=3, help="untimed steps of a shape before each timed one")
    p.add_argument("--context", type=int, default=CONTEXT, help=f"tokens already cached (default: the curve's, {CONTEXT})")
    args = p.parse_args()
    if args.context < 1:
        raise SystemExit("--context must be at least 1")
    if not 0 <= args.lead_in <= 50:
        raise SystemExit("--lead-in must be between 0 and 50")
    context = args.context
    engine = Engine(EngineConfig(speculative=SpeculativeConfig(method="off")), log=False)
    engine.upgrade(wait=True)
    runner, times = engine.runner, {}
    with throwaway_tables(runner.pool, 1, context + max(args.rows)) as tables:
        if not tables:
            raise SystemExit(f"the KV pool cannot hold {context + max(args.rows)} positions; lower --context")
        table = tables[0]
        runner.forward([ForwardItem(table, 0, [5] * context, 1)])
        for _ in range(args.repeats):
            for n in sorted(set(args.rows), reverse=True):
                for keep in (1, n):
                    item = ForwardItem(table, context, [7] * n, keep)
                    for _ in range(args.lead_in):
                        runner.forward([item])
                    start = time.perf_counter()
                    runner.forward([item])
                    times.setdefault((n, keep), []).append(time.perf_counter() - start)
    one = statistics.median(times[args.rows[0], args.rows[0]])
    print(f"| rows | one row's logits, ms (x a {args.rows[0]}-row step) | every row's logits, ms (x) |")
    print("|---|---|---|")
    for n in args.rows:
        a, b = statistics.median(times[n, 1]), statistics.median(times[n, n])
        print(f"| {n} | {a * 1e3:.2f} ({a / one:.2f}x) | {b * 1e3:.2f} ({b / one:.2f}x) |")
    print(f"\n{context} tokens of context, {args.repeats} alternations; {engine.forward_description}\nCPU: {cpu_name()}")


if __name__ == "__main__":
    main()
