"""specstream's own C++ kernels for CPU steps (csrc/), built on first use and kept in the cache.

- `short_attention`: a short step's attention (decode, verification) read straight from the paged KV
  pool. torch has no kernel for it: the torch version (attention.attend_short) gathers the keys into new
  tensors and runs two batched matmuls, whose fixed cost dominates at a few query rows
  (benchmarks/cpu_kernels.py compares them).
- `q8_linear`: a projection with 8-bit weights and a scale per block of 32 (GGUF Q8_0, weights.py's
  Int8Blocks), which torch's kernels take only as two 4-bit planes.
- `q4_linear`: a projection with 4-bit blocks (GGUF Q4_0/Q4_1) in quant.PackedQ4's layout.
- `a8_linear`: 8-bit activations times GGUF blocks, summed as integers (csrc/a8_linear.cpp).
- `rms_norm`: RMSNorm with one summation order per row, so that the eager forward and the compiled steps
  (which otherwise sum a row's squares in different orders) normalize a row to the same bits.
- `sample_rows`: a token per row drawn from softmax(logits / temperature), cut to its min-p, top-k and top-p, with the
  row's uniform, in a few passes over the logits and no sort of the vocabulary (sampling.draw); and
  `probability_rows`, the same distributions whole (sampling.probabilities_for); `argmax_rows`, each row's
  argmax as torch.argmax gives it, in two vector passes (sampling.argmax_rows: greedy decoding and verification).

The kernels are built with the C++ compiler and the vector instruction set that inductor uses on this
machine (the compiled forward needs both anyway), into cache_dir()/kernels/<key>, where the key covers
the source, torch's version, the flags and the CPU. A build takes seconds, once per machine; loading a
built one takes milliseconds. Where building fails (no compiler, say) `load()` says so once in the log
and returns False, and callers keep the torch version.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from specstream.cache import cache_dir, point_inductor_here

log = logging.getLogger("specstream.kernels.cpu")

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("short_attention.cpp", "q8_linear.cpp", "q4_linear.cpp", "a8_linear.cpp", "rms_norm.cpp", "sample_rows.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "common.h"]

# short_attention's path argument that asks a tree row to be attended over the keys it sees laid side by side, so
# that it gets the bits of its path verified as a chain (csrc/short_attention.cpp: kTreesAlone)
ATTENTION_TREES_ALONE = -2

_lib = torch.library.Library("specstream", "DEF")
_lib.define(
    "short_attention(Tensor query, Tensor keys, Tensor values, Tensor kv_index, Tensor? mask, Tensor q_index, "
    "Tensor out_index, float scaling, int path=-1) -> Tensor"
)
_lib.define("q8_linear(Tensor x, Tensor codes, Tensor scales, int path=-1) -> Tensor")
_lib.define("q4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int path=-1) -> Tensor")
_lib.define("a8_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int path=-1) -> Tensor")
_lib.define("a8_quantize(Tensor x) -> (Tensor, Tensor)")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor uniforms) -> Tensor")
_lib.define("probability_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p) -> Tensor")
_lib.define("argmax_rows(Tensor logits) -> Tensor")


@torch.library.register_fake("specstream::short_attention")
def _short_attention_shape(query, keys, values, kv_index, mask, q_index, out_index, scaling, path=-1):
    return query.new_empty((out_index.shape[0], query.shape[1], query.shape[2]))


@torch.library.register_fake("specstream::q8_linear")
def _q8_linear_shape(x, codes, scales, path=-1):
    return x.new_empty((x.shape[0], codes.shape[0] * 16))  # codes: [N / 16, K / 2, 32]


@torch.library.register_fake("specstream::q4_linear")
def _q4_linear_shape(x, codes, scales, mins, path=-1):
    return x.new_empty((x.shape[0], codes.shape[0] * codes.shape[2]))  # codes: [N / 16, K / 2, 16]


@torch.library.register_fake("specstream::a8_linear")
def _a8_linear_shape(x, codes, scales, mins, path=-1):
    return x.new_empty((x.shape[0], codes.shape[0] * 16))  # codes: [N / 16, K / 32, 256 or 512]


@torch.library.register_fake("specstream::rms_norm")
def _rms_norm_shape(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.register_fake("specstream::sample_rows")
def _sample_rows_shape(logits, temperature, top_k, top_p, min_p, uniforms):
    return logits.new_empty((logits.shape[0],), dtype=torch.long)


@torch.library.register_fake("specstream::probability_rows")
def _probability_rows_shape(logits, temperature, top_k, top_p, min_p):
    return logits.new_empty(logits.shape)


@torch.library.register_fake("specstream::argmax_rows")
def _argmax_rows_shape(logits):
    return logits.new_empty((logits.shape[0],), dtype=torch.long)


@torch.library.register_fake("specstream::a8_quantize")
def _a8_quantize_shape(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], x.shape[1] // 32), dtype=torch.float32)


_loaded: bool | None = None  # None: not tried yet
_building: concurrent.futures.Future | None = None  # a build started ahead of need (build_ahead)


def fits_head(head_dim: int) -> bool:
    """Whether short_attention takes this head dimension (a multiple of 32 up to 256)."""
    return head_dim % 32 == 0 and head_dim <= 256


def attention_pairs(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether short_attention serves this dtype and head dimension on its vector path's bfloat16 pairs, each
    sequence's keys laid out once for all its queries (bfloat16, 64-wide heads, AVX512-BF16 without AMX). There it
    also attends prefill chunks faster than SDPA (docs/MEASUREMENTS.md: "Prefill chunks through the attention kernel"). Loads
    nothing."""
    return loaded() and dtype == torch.bfloat16 and head_dim == 64 and bool(torch.ops.specstream.short_attention_pairs())


def build_ahead() -> None:
    """Start building the kernels (where the cache has none yet) in a thread of its own, so that the
    compiler runs while start-up does other work (loading the model); load() waits for it."""
    global _building
    if _loaded is None and _building is None:
        _building = concurrent.futures.Future()

        def run(future: concurrent.futures.Future) -> None:
            try:
                future.set_result(_build())
            except BaseException as exc:  # noqa: BLE001 - load() reports it
                future.set_exception(exc)

        threading.Thread(target=run, args=(_building,), name="specstream-kernel-build", daemon=True).start()


def load() -> bool:
    """Build (once per machine) and load the kernels; whether they are available."""
    global _loaded, _building
    if _loaded is None:
        building, _building = _building, None
        try:
            torch.ops.load_library(str(building.result() if building is not None else _build()))
            _loaded = True
        except Exception as exc:  # noqa: BLE001 - the torch versions of the kernels serve instead
            log.warning("specstream's CPU kernels are unavailable, torch's ops serve instead: %s: %s", type(exc).__name__, exc)
            _loaded = False
    return _loaded


def loaded() -> bool:
    """Whether the kernels are loaded (load() ran and succeeded); loads nothing."""
    return bool(_loaded)


def block_tiles() -> bool:
    """Whether the block-weight kernels (q4_linear, q8_linear) multiply bfloat16 rows on AMX tiles here: the
    kernels are loaded, and this CPU and build have the tile path. Loads nothing."""
    return loaded() and 1 in torch.ops.specstream.q4_paths() and 1 in torch.ops.specstream.q8_paths()


def _command(source: list[Path]) -> list[str]:
    """The compiler's command line, less its output file."""
    point_inductor_here()  # before inductor loads: pick_vec_isa's probe builds go to its cache
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch.utils import cpp_extension

    isa = pick_vec_isa()
    lib = Path(torch.__file__).parent / "lib"
    return [
        os.environ.get("CXX", "g++"),
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp",
        *(isa.build_arch_flags().split() if isa else []),
        *(["-mf16c"] if isa else []),  # float16 scales in hardware: every CPU with AVX2 or AVX-512 has F16C
        # bfloat16 pair products (q4_linear's bfloat16 path) where this CPU has them; the key covers the CPU
        *(["-mavx512bf16"] if isa and "avx512" in str(isa) and "avx512_bf16" in _cpu_flags().split() else []),
        # integer dot products (a8_linear's paths) where this CPU has them and the compiler takes them
        *(int8_dot_flags(os.environ.get("CXX", "g++"), "avx512" in str(isa)) if isa else []),
        *(f"-D{macro}" for macro in (isa.build_macro() if isa else [])),
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(str(s) for s in source),
        f"-L{lib}",
        f"-Wl,-rpath,{lib}",
        "-lc10",
        "-ltorch_cpu",
    ]


# The dot-product instruction sets of a8_linear's paths and q4_linear's tiles (AMX-BF16, bfloat16 rows): the CPU's
# flag (/proc/cpuinfo), and the compiler's flags that enable it.
_INT8_DOT = (
    ("avx512_vnni", ["-mavx512vnni"], True),  # (flag, compiler flags, needs AVX-512)
    ("amx_int8", ["-mamx-tile", "-mamx-int8"], True),
    ("avx_vnni", ["-mavxvnni"], False),
    ("amx_bf16", ["-mamx-tile", "-mamx-bf16"], True),
)


def int8_dot_flags(compiler: str, avx512: bool, cpu_flags: str | None = None) -> list[str]:
    """The compiler flags for the dot-product instructions this CPU has (AVX512-VNNI, AMX-INT8, AVX-VNNI for
    a8_linear; AMX-BF16 for q4_linear's bfloat16 rows), each only where the compiler takes it: a compiler too
    old for one builds the kernels without that path (a8_linear falls back to the next: AMX to AVX512-VNNI to
    AVX2; q4_linear to its vector path), and says so once in the log."""
    have = set((cpu_flags if cpu_flags is not None else _cpu_flags()).split())
    flags = []
    for flag, options, needs_avx512 in _INT8_DOT:
        if flag not in have or (needs_avx512 and not avx512):
            continue
        if _compiler_takes(compiler, options):
            flags += [o for o in options if o not in flags]
        else:
            log.warning("the C++ compiler %s does not take %s: the kernels' %s path is not built, a slower one serves",
                        compiler, " ".join(options), flag)
    return flags


def _compiler_takes(compiler: str, options: list[str]) -> bool:
    try:
        done = subprocess.run([compiler, *options, "-x", "c++", "-c", "-", "-o", os.devnull], input="int main() {}\n",
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_key() -> str:
    """What the built library depends on (its sources, the compiler's command, torch's version, the CPU), as
    a short digest: the key of its place in the cache, and part of the key of start-up timings kept between
    starts, which a change of kernel makes stale."""
    h = hashlib.sha256(repr((torch.__version__, sys.platform, _command(SOURCES), _cpu_flags())).encode())
    for source in (*SOURCES, *HEADERS):
        h.update(source.read_bytes())
    return h.hexdigest()[:20]


def _build() -> Path:
    """The built library's path, building it first where the cache has none for this key."""
    target = cache_dir() / "kernels" / build_key() / "specstream_kernels.so"
    return kept_library(target, lambda out: _compile_and_link(_command(SOURCES), out), "specstream's CPU kernels")


def kept_library(target: Path, build: Callable[[Path], None], what: str) -> Path:
    """target, a library kept in the cache beside its SHA-256: built first (build(path) writes it) where
    it is missing or does not match its digest. It is built under a temporary name and renamed, so a
    concurrent start never loads a half-written file."""
    digest = target.with_name(target.name + ".sha256")
    if target.is_file():
        if digest.is_file() and digest.read_text().strip() == _sha256(target):
            return target
        # Truncated, overwritten, or left by a build that never recorded its digest: never loaded as it is.
        log.warning("the kept library %s does not match its digest: building it again", target)
        target.unlink(missing_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        build(Path(tmp))
        digest.write_text(_sha256(Path(tmp)) + "\n")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s into %s", what, target.parent)
    return target


def _compile_and_link(command: list[str], out: Path) -> None:
    """Run `command` (_command's: every source, then the libraries) as one compiler process per source, at
    once, and a link: the sources parse the same large headers, so on two cores this takes about half the
    time of one process compiling them in turn."""
    sources = [str(s) for s in SOURCES]
    libraries = command.index(f"-L{Path(torch.__file__).parent / 'lib'}")
    flags = [c for c in command[:libraries] if c not in sources and c != "-shared"]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [str(Path(tmp) / f"{Path(s).stem}.o") for s in sources]
        runs = [subprocess.Popen([*flags, "-c", s, "-o", o], stderr=subprocess.PIPE, text=True) for s, o in zip(sources, objects)]
        errors = []
        for run in runs:
            _, err = run.communicate(timeout=600)
            if run.returncode != 0:
                errors.append(err.strip()[-2000:])
        if errors:
            raise RuntimeError(f"the C++ build failed: {errors[0]}")
        link = [command[0], "-shared", "-fopenmp", *objects, *command[libraries:], "-o", str(out)]
        done = subprocess.run(link, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"linking the C++ kernels failed: {done.stderr.strip()[-2000:]}")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
