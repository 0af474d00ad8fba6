"""Predicted outputs (OpenAI's `prediction`): drafts taken from text the caller expects the answer to contain.

A request may carry a prediction: most of its answer known ahead, as when a model is asked to change a few
lines of a file it is given (the file is the prediction). The prediction's tokens are drafts like any other:
verified by the target in one forward, accepted where the target agrees, so the output is the target's own,
greedy or sampled (one-hot drafts under rejection sampling), whatever the prediction says. A wrong prediction
costs the rows it adds to the steps it drafts in, no more.

Alignment. Prediction.position is where the prediction goes on once the output so far has followed it: 0
before any output, then moved on by each output token equal to the prediction's next one. A token that differs
loses the place. Most edits replace, insert or delete a few tokens, and the output then goes on as the
prediction did a little after where it left it: so the place is first looked for within NEAR tokens after that
point, as the first occurrence there of the output's last 2 tokens, or of its last one. Failing that, it is
found where the output's last ALIGN tokens occur anywhere in the prediction: the first occurrence at or after
where the output left it (an edit keeps the prediction's order), else the latest one before. While the place is
lost, or the prediction is spent, the sequence drafts as the server's method has it.

Pricing. The k policy grants a sequence its drafts (policy.KPolicy) from the acceptance it expects of them; for
a sequence whose prediction has a place, that is the prediction's own record (draft_hint): a prior (PRIOR,
with PRIOR_WEIGHT rounds' weight: a prediction is usually a near copy) corrected by its rounds so far, each a
geometric observation as the k policy's are (its drafts kept, then one rejection unless all were). The drafts
are the prediction's tokens from its place, up to the k granted. Like every draft they need speculation on:
with the method "off", or a request's num_speculative_tokens of 0, a prediction is accepted and not used.
"""

from __future__ import annotations

from collections.abc import Callable

from specstream.sequence import Acceptance, Sequence
from specstream.spec_decode.proposer import Draft, Proposer

ALIGN = 3  # output tokens that must occur anywhere in the prediction to find its place again
NEAR = 16  # prediction tokens after where the output left it in which 1 or 2 of its tokens find the place again
PRIOR = 0.9  # a prediction's expected acceptance before its first round
PRIOR_WEIGHT = 2.0
METHOD = "prediction"  # Draft.method of a prediction's drafts (metrics, the per-chunk stats)


class Prediction:
    """One sequence's prediction: its tokens, its place against the output so far, its rounds' record."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.position: int | None = 0  # the prediction's next token, where the output follows it; None: lost
        self.left = 0  # where the output last followed it (the search for a lost place starts here)
        self.seen = 0  # output tokens followed so far
        self.drafted: tuple[int, int] | None = None  # the last draft not yet followed: (its start, its length)
        self.record = Acceptance()  # its rounds (undecayed)
        self._ends: dict[tuple[int, ...], list[int]] | None = None  # ALIGN-token windows -> where each ends

    def follow(self, output: list[int]) -> None:
        """Take the output tokens appended since the last call: move the place on, lose it, or find it again;
        the last draft's round goes into the record."""
        new = output[self.seen :]
        self.seen = len(output)
        if self.drafted is not None:
            start, length = self.drafted
            kept = 0
            while kept < min(length, len(new)) and self.tokens[start + kept] == new[kept]:
                kept += 1
            self.record.record(length, kept, 1.0)
            self.drafted = None
        for tok in new:
            if self.position is not None and self.position < len(self.tokens) and self.tokens[self.position] == tok:
                self.position += 1
                self.left = self.position
            else:
                self.position = None
        if self.position is None and new:
            self.position = self._near(output)
        if self.position is None and len(output) >= ALIGN:
            self.position = self._find(tuple(output[-ALIGN:]))

    def draft(self, k: int) -> list[int]:
        """Up to k of the prediction's tokens from its place (none where the place is lost or spent)."""
        if self.position is None or k <= 0:
            return []
        tokens = self.tokens[self.position : self.position + k]
        if tokens:
            self.drafted = (self.position, len(tokens))
        return tokens

    def available(self) -> int:
        """How many tokens a draft could take now."""
        return 0 if self.position is None else len(self.tokens) - self.position

    def acceptance(self) -> float:
        return self.record.estimate(PRIOR, PRIOR_WEIGHT)

    def _near(self, output: list[int]) -> int | None:
        """The place just past the first occurrence of the output's last 2 tokens (else its last one) within NEAR
        tokens after where the output left the prediction."""
        near = self.tokens[self.left : self.left + NEAR]
        for n in (2, 1):
            if len(output) < n:
                continue
            tail = output[-n:]
            for i in range(len(near) - n + 1):
                if near[i : i + n] == tail:
                    return self.left + i + n
        return None

    def _find(self, window: tuple[int, ...]) -> int | None:
        if self._ends is None:  # built once, at the first lost place: a prediction followed throughout needs none
            self._ends = {}
            for end in range(ALIGN, len(self.tokens) + 1):
                self._ends.setdefault(tuple(self.tokens[end - ALIGN : end]), []).append(end)
        ends = self._ends.get(window)
        if not ends:
            return None
        after = [e for e in ends if e >= self.left]
        return after[0] if after else ends[-1]


def prediction_hint(
    inner: Callable[[Sequence], tuple[float, int] | None],
) -> Callable[[Sequence], tuple[float, int] | None]:
    """The k policy's draft_hint: a sequence's prediction where it has a place (its acceptance, the tokens it
    holds), else the proposer's own hint (inner)."""

    def hint(seq: Sequence) -> tuple[float, int] | None:
        prediction = seq.prediction
        if prediction is not None:
            prediction.follow(seq.output_ids)
            if prediction.available():
                return prediction.acceptance(), prediction.available()
        return inner(seq)

    return hint


def propose_with_predictions(proposer: Proposer, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
    """Each sequence's draft: its prediction's where it has a place and tokens left, the proposer's for the rest
    (one propose over them, in order)."""
    drafts: list[Draft | None] = [None] * len(seqs)
    for i, (seq, k) in enumerate(zip(seqs, ks)):
        if seq.prediction is not None and k > 0:
            seq.prediction.follow(seq.output_ids)
            tokens = seq.prediction.draft(k)
            if tokens:
                drafts[i] = Draft(tokens, method=METHOD)
    rest = [i for i, d in enumerate(drafts) if d is None]
    if len(rest) == len(seqs):
        return proposer.propose(seqs, ks)
    if rest:
        for i, draft in zip(rest, proposer.propose([seqs[i] for i in rest], [ks[i] for i in rest])):
            drafts[i] = draft
    return drafts  # type: ignore[return-value]
