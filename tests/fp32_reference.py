"""The bundled model's fp32 greedy answers to chat prompts, with the top-1 margin (log-probability of the
first token over the second's) at each position: printed as JSON, one object per prompt, with the text
after each token. Run in a process of its own, so the test that reads it keeps no second model.
Usage: python tests/fp32_reference.py MAX_TOKENS PROMPT..."""

from __future__ import annotations

import json
import sys

import torch

from specstream import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams, SpeculativeConfig, load_model, resolve_model


def main(max_tokens: int, prompts: list[str]) -> None:
    engine = Engine(EngineConfig(dtype="float32", compile=False, speculative=SpeculativeConfig(method="off")), log=False)
    plain = load_model(resolve_model(DEFAULT_MODEL), torch.float32)  # transformers' own forward, for the margins
    out = []
    for prompt in prompts:
        want = engine.generate([[{"role": "user", "content": prompt}]], SamplingParams(max_tokens=max_tokens, temperature=0))[0]
        ids = torch.tensor([want.prompt_token_ids + want.token_ids])
        with torch.inference_mode():
            logp = plain(ids).logits[0, len(want.prompt_token_ids) - 1 : -1].float().log_softmax(-1)
        top2 = logp.topk(2, dim=-1).values
        texts = [engine.tokenizer.decode(want.token_ids[: i + 1]).rstrip("\ufffd") for i in range(len(want.token_ids))]
        out.append({"margins": (top2[:, 0] - top2[:, 1]).tolist(), "texts": texts})
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
