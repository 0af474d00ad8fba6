"""Proposers by method name (config.SPECULATIVE_METHODS): how the engine builds the one it is asked for."""

from __future__ import annotations

from specstream.spec_decode.auto import AutoProposer
from specstream.spec_decode.draft_model import DraftModelProposer
from specstream.spec_decode.eagle import EagleProposer
from specstream.spec_decode.ngram import NgramProposer
from specstream.spec_decode.proposer import NoProposer, Proposer, ProposerContext
from specstream.spec_decode.suffix import SuffixProposer

PROPOSERS: dict[str, type[Proposer]] = {
    "off": NoProposer,
    "suffix": SuffixProposer,
    "ngram": NgramProposer,
    "draft": DraftModelProposer,
    "eagle": EagleProposer,
    "auto": AutoProposer,
}


def make_proposer(ctx: ProposerContext) -> Proposer:
    """The proposer ctx.config.speculative names; no proposer where speculation is off."""
    spec = ctx.config.speculative
    return PROPOSERS[spec.method if spec.enabled else "off"].build(ctx)
