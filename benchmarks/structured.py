"""Structured outputs on the bundled model: validity, mode-independence, mask cost, and what
grammar-forced drafts buy, side by side in one run (fp32, so greedy outputs must be equal).

    .venv/bin/python benchmarks/structured.py            # full run
    .venv/bin/python benchmarks/structured.py --quick    # 8 schemas, fewer repeats

1. validity: every schema x {speculation off, forced drafts, ngram, ngram + forced drafts} x
   {greedy, temperature 0.8}, all schemas of a cell batched in one generate(); each output
   must parse and validate (jsonschema). Greedy outputs must be identical across the modes.
2. mask cost: the greedy outputs replayed through a fresh matcher, timing per position the
   llguidance mask plus unpacking and applying it to a full 49,152-logit row.
3. throughput, single stream, ABBA order: fixed-key extraction schemas with forced drafts on
   vs off (speculation off, and n-gram); and unconstrained vs constrained (forced drafts off).
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import numpy as np
import torch

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.structured.decoding import StructuredDecoding
from specstream.sampling import StructuredOutput

PEOPLE = [
    ("Alice Martin", 34, "Lyon", "alice.martin@example.com", "engineer"),
    ("Bob Chen", 42, "Toronto", "bob.chen@example.org", "teacher"),
    ("Carla Diaz", 29, "Madrid", "carla@example.net", "nurse"),
    ("Dmitri Ivanov", 51, "Riga", "dmitri.i@example.com", "pilot"),
]


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required, "additionalProperties": False}


STR, INT, NUM, BOOL = {"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def extraction_cases() -> list[tuple[str, dict, str]]:
    """Fixed-key extraction: every key required, the text holds every value."""
    cases = []
    for name, age, city, email, job in PEOPLE:
        text = f"{name} is a {age}-year-old {job} from {city}. Contact: {email}."
        cases.append(("person", _obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 130}, "city": STR}), text))
        cases.append(("contact", _obj({"full_name": STR, "email": STR, "occupation": STR}), text))
        cases.append(("profile", _obj({"name": STR, "age": INT, "city": STR, "email": STR, "job": STR}), text))
    cases.append(("order", _obj({"order_id": STR, "quantity": INT, "unit_price": NUM, "paid": BOOL}), "Order A-1043: 3 lamps at 19.99 each, already paid."))
    cases.append(("flight", _obj({"airline": STR, "flight_number": STR, "from": STR, "to": STR}), "Air Canada flight AC 870 from Toronto to Paris."))
    cases.append(("book", _obj({"title": STR, "author": STR, "year": INT}), "Dune, by Frank Herbert, was published in 1965."))
    return cases


def varied_cases() -> list[tuple[str, dict, str]]:
    """Nested objects, arrays, enums, bounded numbers, optional fields, anyOf."""
    review = "The Bistro on Main: great soup, slow service. 4 out of 5. Visited in May."
    return [
        ("enum_sentiment", _obj({"sentiment": {"enum": ["positive", "negative", "mixed"]}}), review),
        ("bounded_rating", _obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": STR}), review),
        ("nested_address", _obj({"name": STR, "address": _obj({"street": STR, "city": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
         "Send it to Jane Roe, 12 Oak Street, Springfield 62704."),
        ("array_tags", _obj({"tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 4}}), review),
        ("array_objects", _obj({"items": {"type": "array", "maxItems": 3, "items": _obj({"name": STR, "qty": {"type": "integer", "minimum": 1, "maximum": 99}})}}),
         "Shopping list: 2 apples, 1 bread, 6 eggs."),
        ("optional_fields", _obj({"name": STR, "nickname": STR, "age": INT}, required=["name"]), "Robert, known as Bob, is 40."),
        ("anyof_value", _obj({"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}]}}), "The answer is 42."),
        ("anyof_objects", _obj({"shape": {"anyOf": [_obj({"kind": {"const": "circle"}, "radius": NUM}), _obj({"kind": {"const": "square"}, "side": NUM})]}}),
         "A circle with radius 2.5."),
        ("number_bounds", _obj({"temperature_c": {"type": "number", "minimum": -50, "maximum": 60}, "humidity": {"type": "integer", "minimum": 0, "maximum": 100}}),
         "Today: 21.5 degrees Celsius and 40% humidity."),
        ("boolean_flags", _obj({"is_open": BOOL, "accepts_cards": BOOL, "has_parking": BOOL}), "Open now, cash only, free parking."),
        ("enum_array", _obj({"days": {"type": "array", "maxItems": 7, "items": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}}}),
         "We are open Monday, Wednesday and Friday."),
        ("deep_nesting", _obj({"company": _obj({"name": STR, "ceo": _obj({"name": STR, "since": {"type": "integer", "minimum": 1900, "maximum": 2030}})})}),
         "Acme Corp is led by Wile E. Coyote, CEO since 1999."),
        ("const_version", _obj({"version": {"const": "1.0"}, "status": {"enum": ["ok", "error"]}}), "Status report: everything ok."),
        ("string_lengths", _obj({"code": {"type": "string", "minLength": 3, "maxLength": 6}, "label": STR}), "Product code XJ9, label Deluxe."),
        ("list_of_numbers", _obj({"scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 100}, "maxItems": 5}}), "Scores: 88, 92.5 and 79."),
        ("mixed_optional_nested", _obj({"event": STR, "when": _obj({"date": STR, "time": STR}, required=["date"]), "online": BOOL}, required=["event", "when"]),
         "Team meeting on 2024-05-03 at 10:00, on Zoom."),
    ]


def chat(schema: dict, text: str) -> list[dict]:
    return [{"role": "user", "content": f"Extract the information as JSON matching this schema: {json.dumps(schema)}\n\nText: {text}"}]


def params(schema: dict | None, temperature: float, seed: int, spec_off: bool, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        structured=StructuredOutput(json_schema=schema) if schema is not None else None,
        num_speculative_tokens=0 if spec_off else None,
    )


def validity(engines: dict, cases, max_tokens: int, temperature: float) -> tuple[dict, dict]:
    """Per mode: (valid, total, drafted, forced, accepted), and the token ids of every output."""
    results, tokens = {}, {}
    for mode, (engine, spec_off) in engines.items():
        outs = engine.generate([chat(s, t) for _, s, t in cases], [params(s, temperature, i, spec_off, max_tokens) for i, (_, s, _) in enumerate(cases)])
        ok = 0
        for (name, schema, _), out in zip(cases, outs):
            try:
                jsonschema.validate(json.loads(out.text), schema)
                ok += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                print(f"  INVALID {mode} T={temperature} {name} ({out.finish_reason}): {out.text!r}: {exc}"[:300])
        drafted, forced = sum(o.stats.drafted for o in outs), sum(o.stats.forced for o in outs)
        accepted = sum(o.stats.accepted for o in outs)
        results[mode] = (ok, len(outs), drafted, forced, accepted)
        print(f"  {mode:13s} T={temperature}: {ok}/{len(outs)} valid, drafted {drafted} (forced {forced}), accepted {accepted}", flush=True)
        tokens[mode] = [o.token_ids for o in outs]
    return results, tokens


def mask_costs(engine: Engine, cases, outputs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Seconds per position: the llguidance mask alone, and mask + unpack + apply to a row."""
    sd: StructuredDecoding = engine.structured
    row = torch.randn(1, engine.vocab_size)
    fill, total = [], []
    for (_, schema, _), tokens in zip(cases, outputs):
        matcher = sd.compiler.compile(StructuredOutput(json_schema=schema))
        for tok in tokens:
            timed_mask(sd, matcher, row, fill, total)
            if not matcher.consume_token(tok) or matcher.is_stopped():
                break
    return np.array(fill), np.array(total)


def timed_mask(sd: StructuredDecoding, matcher, row: torch.Tensor, fill: list, total: list) -> torch.Tensor:
    """The matcher's mask at its current state, timing the llguidance call (into fill) and the call
    plus applying the mask to a logit row (into total)."""
    start = time.perf_counter()
    mask = sd._masks([(matcher, [])])[0]
    mid = time.perf_counter()
    sd._apply(row, mask)
    end = time.perf_counter()
    fill.append(mid - start)
    total.append(end - start)
    return mask


def mask_costs_random_walk(cases, max_positions: int = 150, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """mask_costs() without the model: each schema's matcher walks a random path of allowed
    tokens (ending when EOS is allowed), so the cost is measured on real grammar states."""
    from specstream.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_model
    from transformers import AutoConfig

    source = resolve_model(DEFAULT_MODEL)
    tokenizer = load_tokenizer(source)
    vocab = AutoConfig.from_pretrained(source.path, **source.kwargs).vocab_size
    sd = StructuredDecoding(tokenizer, vocab, {tokenizer.eos_token_id})
    rng = np.random.default_rng(seed)
    row = torch.randn(1, vocab)
    fill, total = [], []
    for _, schema, _ in cases:
        matcher = sd.compiler.compile(StructuredOutput(json_schema=schema))
        for _ in range(max_positions):
            mask = timed_mask(sd, matcher, row, fill, total)
            allowed = np.flatnonzero(mask[0].numpy())
            if tokenizer.eos_token_id in allowed or matcher.is_stopped():
                break
            matcher.consume_token(int(rng.choice(allowed)))
    return np.array(fill), np.array(total)


def throughput(pairs: list[tuple[str, callable, callable]], cases, repeats: int) -> None:
    """For each (label, run_a, run_b): tokens/s of b over a, ABBA-interleaved over repeats."""
    for label, run_a, run_b in pairs:
        tok = {"a": 0, "b": 0}
        sec = {"a": 0.0, "b": 0.0}
        for r in range(repeats):
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            for which in order:
                run = run_a if which == "a" else run_b
                for case in cases:
                    n, dt = run(case)
                    tok[which] += n
                    sec[which] += dt
        a, b = tok["a"] / sec["a"], tok["b"] / sec["b"]
        print(f"  {label}: {a:.1f} -> {b:.1f} tok/s = {b / a:.2f}x", flush=True)


def timed(engine: Engine, p: SamplingParams, messages) -> tuple[int, float]:
    start = time.perf_counter()
    out = engine.generate(messages, p)[0]
    return len(out.token_ids), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 makes greedy outputs comparable across modes")
    ap.add_argument("--schemas", type=int, default=None, help="use only the first N schemas (a smoke run)")
    ap.add_argument("--throughput-schemas", type=int, default=6)
    ap.add_argument("--throughput-only", action="store_true", help="only section 3 (forced drafts on vs off)")
    ap.add_argument("--mask-only", action="store_true", help="only the mask cost, on random walks through each grammar (no model)")
    ap.add_argument("--fixed-k", action="store_true", help="k = k_max, no calibration at start-up (faster to start)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cases = extraction_cases() + varied_cases()
    if args.quick:
        cases = cases[:4] + varied_cases()[:4]
        args.throughput_schemas = 2
    cases = cases[: args.schemas]
    print(f"{len(cases)} schemas", flush=True)

    if args.mask_only:
        fill, total_cost = mask_costs_random_walk(cases)
        print("2. mask cost per sequence per position (random walks through each schema's grammar):")
        for label, xs in (("llguidance mask", fill), ("mask + unpack + apply", total_cost)):
            print(f"  {label}: p50 {np.percentile(xs, 50) * 1e3:.3f} ms, p99 {np.percentile(xs, 99) * 1e3:.3f} ms over {len(xs)} positions")
        return

    def make(forced: bool) -> Engine:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=8, adaptive=not args.fixed_k, forced_drafts=forced)
        return Engine(EngineConfig(dtype=args.dtype, speculative=spec), log=False)

    plain, forced = make(False), make(True)
    engines = {"off": (plain, True), "forced": (forced, True), "ngram": (plain, False), "ngram+forced": (forced, False)}
    fixed = extraction_cases()[: args.throughput_schemas]

    def run(engine, spec_off, schema=True):
        return lambda c: timed(engine, params(c[1] if schema else None, 0.0, 0, spec_off, args.max_tokens), chat(c[1], c[2]))

    if args.throughput_only:
        print(f"3. throughput, single stream, greedy, {len(fixed)} fixed-key extraction schemas, ABBA x{args.repeats}:", flush=True)
        throughput([("speculation off: forced drafts off -> on", run(plain, True), run(forced, True))], fixed, args.repeats)
        return
    # Most telling first, so that a run cut short still answers the main questions.
    print("1. validity (jsonschema), greedy, all schemas of a cell batched:", flush=True)
    results, greedy = validity(engines, cases, args.max_tokens, 0.0)
    same = all(greedy[m] == greedy["off"] for m in greedy)
    print(f"  => fp32 greedy identical across modes: {same}", flush=True)

    print("2. mask cost per sequence per position (greedy outputs replayed):", flush=True)
    fill, total_cost = mask_costs(plain, cases, greedy["off"])
    for label, xs in (("llguidance mask", fill), ("mask + unpack + apply", total_cost)):
        print(f"  {label}: p50 {np.percentile(xs, 50) * 1e3:.3f} ms, p99 {np.percentile(xs, 99) * 1e3:.3f} ms over {len(xs)} positions", flush=True)

    print(f"3. throughput, single stream, greedy, {len(fixed)} fixed-key extraction schemas, ABBA x{args.repeats}:", flush=True)
    throughput([("speculation off: forced drafts off -> on", run(plain, True), run(forced, True))], fixed, args.repeats)

    print("4. validity, temperature 0.8:", flush=True)
    sampled, _ = validity(engines, cases, args.max_tokens, 0.8)
    valid = sum(r[0] for r in list(results.values()) + list(sampled.values()))
    total = sum(r[1] for r in list(results.values()) + list(sampled.values()))
    print(f"  => {valid}/{total} valid ({100 * valid / total:.1f}%) over {len(cases)} schemas x 4 modes x 2 temperatures", flush=True)

    print("5. more throughput pairs:", flush=True)
    throughput(
        [
            ("ngram: forced drafts off -> on", run(plain, False), run(forced, False)),
            ("no schema -> schema (forced drafts and speculation off)", run(plain, True, schema=False), run(plain, True)),
        ],
        fixed,
        args.repeats,
    )


if __name__ == "__main__":
    main()
