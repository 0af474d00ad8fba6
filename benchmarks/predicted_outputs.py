"""Predicted outputs (OpenAI's `prediction`) through `Engine`: code edits on the bundled model, each request decoded
plain (`off`), with the default speculation (`auto`) and with `auto` given the unedited code as its prediction, side
by side in one process, one stream, ABBA order over --passes passes.

The tasks are functions of Python's standard library (code this project did not write), at most --max-lines lines
each, in a fixed order, the prediction being the function as the library has it:
- `--task rename` (the default): the prompt holds the function and asks to rename one of its parameters and to
  answer with the whole function (OpenAI's documented use: the file being edited is the prediction). The prompt
  holds what the prediction holds, so n-gram drafts from the prompt find much of it too.
- `--task recall`: the prompt gives only the function's signature and the first line of its docstring and asks
  for the function. The prediction is not in the prompt, and the model's answer follows it only here and there:
  this checks that a prediction the answer does not follow costs nothing.
The answer is the model's own whatever the prediction; the script counts the answers that equal `auto`'s without
it (greedy: all, unless a near-tie flipped in bf16; with --deterministic, all: the runs then time the same answers).

    python benchmarks/predicted_outputs.py                       # 12 functions, rename, greedy, 2 passes
    python benchmarks/predicted_outputs.py --task recall --temperature 0.7 --tasks 8
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_forward import cpu_name  # noqa: E402
from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402

MODULES = ["textwrap", "shutil", "fnmatch", "glob", "posixpath", "calendar", "heapq", "base64", "html", "difflib",
           "string", "csv", "json.decoder", "urllib.parse", "gettext", "locale"]


def tasks(count: int, max_lines: int) -> list[tuple[str, str, str]]:
    """(function name, its source, the parameter to rename) for `count` standard-library functions of 8 to
    max_lines lines with a parameter of 2 letters or more, taken in turn from MODULES."""
    found: list[list[tuple[str, str, str]]] = []
    for name in MODULES:
        module = importlib.import_module(name)
        of_module = []
        for fname, fn in sorted(vars(module).items()):
            if not inspect.isfunction(fn) or fn.__module__ != module.__name__ or fname.startswith("_"):
                continue
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            params = [p for p in inspect.signature(fn).parameters if len(p) >= 2 and p != "self"]
            if params and 8 <= source.count("\n") <= max_lines and source.startswith("def "):
                of_module.append((f"{name}.{fname}", source.rstrip("\n"), params[0]))
        found.append(of_module)
    picked: list[tuple[str, str, str]] = []
    while len(picked) < count and any(found):
        for of_module in found:
            if of_module and len(picked) < count:
                picked.append(of_module.pop(0))
    return picked


def prompt(task: str, source: str, param: str) -> list[dict]:
    if task == "recall":
        lines = source.splitlines()
        head = lines[:2]  # the signature and (usually) the docstring's first line
        return [{
            "role": "user",
            "content": "Write this Python function of the standard library, whole, in a code block and nothing "
                       "else:\n\n```python\n" + "\n".join(head) + "\n```",
        }]
    return [{
        "role": "user",
        "content": f"Rename the parameter `{param}` to `{param}_in` everywhere in this Python function. Answer with "
                   f"the whole updated function in a code block and nothing else.\n\n```python\n{source}\n```",
    }]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["rename", "recall"], default="rename")
    ap.add_argument("--tasks", type=int, default=12)
    ap.add_argument("--max-lines", type=int, default=30)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="the same tokens whatever the drafts (bf16 too)")
    args = ap.parse_args()
    work = tasks(args.tasks, args.max_lines)
    engines = {}
    for method in ("off", "auto"):
        config = EngineConfig(compile=not args.no_compile, compile_in_background=False,
                              deterministic=args.deterministic, speculative=SpeculativeConfig(method=method))
        engines[method] = Engine(config, log=False)
    runs = [("off", False), ("auto", False), ("auto", True)]
    names = {("off", False): "off", ("auto", False): "auto", ("auto", True): "auto + prediction"}

    def run(key, task, seed):
        method, predicted = key
        _, source, param = task
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed,
                                prediction=f"```python\n{source}\n```" if predicted else None)
        start = time.perf_counter()
        out = engines[method].generate([prompt(args.task, source, param)], params)[0]
        return out, time.perf_counter() - start

    for key in runs:  # warm-up: one task each
        run(key, work[0], 0)
    tokens = {key: [0] * args.passes for key in runs}
    seconds = {key: [0.0] * args.passes for key in runs}
    per_task = {key: [[] for _ in work] for key in runs}
    usage = [0, 0]
    same = 0
    for p in range(args.passes):
        for i, task in enumerate(work):
            order = runs if (p + i) % 2 == 0 else runs[::-1]
            outs = {}
            for key in order:
                out, took = run(key, task, 1000 * p + i)
                outs[key] = out
                tokens[key][p] += len(out.token_ids)
                seconds[key][p] += took
                per_task[key][i].append(len(out.token_ids) / took)
            accepted, rejected = outs["auto", True].stats.prediction_usage
            usage[0] += accepted
            usage[1] += rejected
            same += outs["auto", True].token_ids == outs["auto", False].token_ids
    print(f"\nPredicted outputs: {len(work)} standard-library functions (at most {args.max_lines} lines), task "
          f"{args.task}, T={args.temperature}, one stream, {args.passes} passes ABBA"
          f"{', deterministic' if args.deterministic else ''}\n")
    print("| run | tok/s (per pass) | / off | per-task ratio to off (median, min-max) |")
    print("|---|---|---|---|")
    base = [t / s for t, s in zip(tokens["off", False], seconds["off", False])]
    for key in runs:
        rates = [t / s for t, s in zip(tokens[key], seconds[key])]
        ratios = sorted(statistics.median(a) / statistics.median(b)
                        for a, b in zip(per_task[key], per_task["off", False]))
        print(f"| {names[key]} | {sum(tokens[key]) / sum(seconds[key]):.1f} ({', '.join(f'{r:.1f}' for r in rates)}) | "
              f"{sum(tokens[key]) / sum(seconds[key]) / (sum(tokens['off', False]) / sum(seconds['off', False])):.2f}x "
              f"({'/'.join(f'{r / b:.2f}' for r, b in zip(rates, base))}) | "
              f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |")
    total = sum(usage)
    print(f"\nprediction tokens drafted {total}, accepted {usage[0]} ({usage[0] / max(total, 1):.0%}); answers equal to "
          f"auto's without a prediction: {same} of {len(work) * args.passes}")
    print(f"CPU: {cpu_name()}; {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
