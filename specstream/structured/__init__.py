"""Structured outputs: what a request asks for (grammars, JSON schemas, logit bias) and the decoding that enforces it."""
