"""Compare grammar engines for structured output on this machine: llguidance, xgrammar,
outlines-core.

For each engine, on the default model's tokenizer (SmolLM2, 49152 tokens):
- tokenizer set-up time (once per model);
- schema coverage: which of a set of JSON schemas (common features and harder ones: $ref,
  anyOf, pattern, format, length bounds) compile;
- compile time per schema (median over the schemas that compile);
- per-token mask cost: walk a valid instance of each schema token by token, computing the
  token mask before each token (median and p99 microseconds over all tokens).

The engines are peers, not Loom dependencies (Loom ships llguidance); install the other two
outside the project environment, e.g.
    .venv/bin/pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
        outlines-core==0.2.14
    .venv/bin/python benchmarks/bench_grammar.py --out benchmarks/results/grammar-<date>.json
An engine that is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from loom.loader.resolve import resolve_model
from loom.tokenizer.tokenizer import Tokenizer

# (name, schema, a valid instance). The first ones use what every engine should support.
CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("flat", {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "age"]},
     {"name": "Ada Lovelace", "age": 36}),
    ("nested", {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["id", "tags"]}}, "required": ["user"]},
     {"user": {"id": 7, "tags": ["a", "b", "c"]}}),
    ("enum", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
              "ok": {"type": "boolean"}}, "required": ["color", "ok"]},
     {"color": "green", "ok": True}),
    ("numbers", {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "n": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["x", "n"]},
     {"x": 1.25, "n": 42}),
    ("array-bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                      "maxItems": 4}, [1, 2, 3]),
    ("optional", {"type": "object", "properties": {"a": {"type": "string"},
                  "b": {"type": "integer"}, "c": {"type": "null"}}, "required": ["a"],
                  "additionalProperties": False}, {"a": "x", "b": 2}),
    ("ref", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
             "y": {"type": "integer"}}, "required": ["x", "y"]}}, "type": "object",
             "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
             "required": ["from", "to"]}, {"from": {"x": 1, "y": 2}, "to": {"x": 3, "y": 4}}),
    ("anyOf", {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"},
               {"type": "string"}]}}, "required": ["v"]}, {"v": "seven"}),
    ("pattern", {"type": "object", "properties": {"zip": {"type": "string",
                 "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}, {"zip": "02139"}),
    ("string-len", {"type": "object", "properties": {"code": {"type": "string",
                    "minLength": 3, "maxLength": 6}}, "required": ["code"]}, {"code": "abcd"}),
    ("format", {"type": "object", "properties": {"when": {"type": "string",
                "format": "date-time"}}, "required": ["when"]},
     {"when": "2026-11-30T12:00:00Z"}),
    ("recursive", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"]}}, "$ref": "#/$defs/node"},
     {"v": 1, "kids": [{"v": 2, "kids": []}]}),
]


def _token_bytes(tokenizer: Tokenizer) -> dict[bytes, list[int]]:
    """Each token's bytes (byte-level BPE decoded), for outlines-core's Vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    unicode_to_byte = {u: b for b, u in bytes_to_unicode().items()}
    special = set(tokenizer.hf.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for token, tid in tokenizer.hf.get_vocab().items():
        if tid in special:
            continue
        try:
            raw = bytes(unicode_to_byte[ch] for ch in token)
        except KeyError:
            raw = token.encode()
        out.setdefault(raw, []).append(tid)
    return out


class LLGuidance:
    name = "llguidance"

    def setup(self, tokenizer: Tokenizer) -> None:
        import llguidance

        # As Loom builds it (llguidance.torch is not imported: its torch.compile decorator
        # alone costs seconds at import).
        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
            eos_token=list(tokenizer.eos_token_ids))
        self.bitmask = torch.full((1, (tokenizer.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def compile(self, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tok, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def mask(self, m: Any) -> None:
        m.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def setup(self, tokenizer: Tokenizer) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf, vocab_size=tokenizer.vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(self, schema: dict) -> Any:
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def mask(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def setup(self, tokenizer: Tokenizer) -> None:
        import outlines_core as oc

        self.oc = oc
        self.vocab = oc.Vocabulary(tokenizer.eos_token_ids[0], _token_bytes(tokenizer))
        self.bitmask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def mask(self, g: Any) -> None:
        g.write_mask_into(self.bitmask.data_ptr(), self.bitmask.numel(), 4)

    def accept(self, g: Any, token: int) -> bool:
        g.advance(token)
        return True


def run_engine(engine: Any, tokenizer: Tokenizer) -> dict[str, Any]:
    try:
        t0 = time.perf_counter()
        engine.setup(tokenizer)
        setup_s = time.perf_counter() - t0
    except ImportError as e:
        return {"installed": False, "error": str(e)}
    compile_ms: list[float] = []
    mask_us: list[float] = []
    cases: dict[str, str] = {}
    for name, schema, instance in tqdm(CASES, desc=engine.name, unit="schema"):
        try:
            t0 = time.perf_counter()
            matcher = engine.compile(schema)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        except Exception as e:  # noqa: BLE001 - coverage is what we measure
            cases[name] = f"compile error: {str(e).splitlines()[0][:120]}"
            continue
        ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        ok = True
        try:
            for token in ids:
                t0 = time.perf_counter()
                engine.mask(matcher)
                mask_us.append((time.perf_counter() - t0) * 1e6)
                if not engine.accept(matcher, token):
                    ok = False
                    break
        except Exception as e:  # noqa: BLE001
            cases[name] = f"walk error: {str(e).splitlines()[0][:120]}"
            continue
        cases[name] = "ok" if ok else "rejected a valid instance"
    mask_us.sort()
    return {
        "installed": True,
        "tokenizer_setup_s": round(setup_s, 3),
        "schemas_ok": sum(v == "ok" for v in cases.values()),
        "schemas_total": len(CASES),
        "compile_ms_median": round(statistics.median(compile_ms), 2) if compile_ms else None,
        "compile_ms_max": round(max(compile_ms), 2) if compile_ms else None,
        "mask_us_median": round(statistics.median(mask_us), 1) if mask_us else None,
        "mask_us_p99": round(mask_us[int(0.99 * (len(mask_us) - 1))], 1) if mask_us else None,
        "cases": cases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_source(resolve_model(args.model))
    results = {e.name: run_engine(e, tokenizer) for e in (LLGuidance(), XGrammar(), OutlinesCore())}
    print(f"{'engine':14} {'setup s':>8} {'schemas':>8} {'compile ms':>11} {'mask us p50':>12} "
          f"{'mask us p99':>12}")
    for name, r in results.items():
        if not r["installed"]:
            print(f"{name:14} not installed ({r['error']})")
            continue
        print(f"{name:14} {r['tokenizer_setup_s']:8.2f} {r['schemas_ok']:>4}/{r['schemas_total']:<3} "
              f"{r['compile_ms_median']!s:>11} {r['mask_us_median']!s:>12} {r['mask_us_p99']!s:>12}")
        for case, status in r["cases"].items():
            if status != "ok":
                print(f"    {case}: {status}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
