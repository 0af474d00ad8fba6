"""Speculative decoding: the Proposer interface and its registry, the proposers (n-gram, draft model, EAGLE head, auto), the one policy that decides how much to draft, and verification."""
