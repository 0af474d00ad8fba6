"""The integer dot-product instruction's peak on this CPU: VPDPBUSD on 512 bits (64 byte products each), in
12 independent chains so that only its throughput bounds it, on each of --threads cores at once. What a8's
projections reach at 9 or 16 rows is read against this (README: "What bounds these shapes").

    python benchmarks/vnni_peak.py               # 2 processes, one a core
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main() {
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  const long n = 200000000;
  auto start = std::chrono::steady_clock::now();
  for (long r = 0; r < n; ++r) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
    __asm__ volatile("" : "+v"(w), "+v"(x));  // keeps the loop from being folded away
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m512i sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  std::printf("%.1f %d\n", n * 12 * 64 / s / 1e9, _mm512_reduce_add_epi32(sum) & 1);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    flags = set(Path("/proc/cpuinfo").read_text().split())
    if "avx512_vnni" not in flags:
        raise SystemExit("this CPU has no avx512_vnni")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", str(src), "-o", str(exe)], check=True)
        runs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True) for _ in range(args.threads)]
        rates = [float(p.communicate()[0].split()[0]) for p in runs]
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    print(f"{model}: VPDPBUSD (512 bits) peak {' + '.join(f'{r:.0f}' for r in rates)} = {sum(rates):.0f} G byte "
          f"products a second on {args.threads} cores at once")


if __name__ == "__main__":
    main()
