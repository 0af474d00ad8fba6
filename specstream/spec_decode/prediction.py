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
point, as the first occurrence there of the output's last 2 tokens. Failing that, it is found where the
output's last ALIGN tokens occur anywhere in the prediction: the first occurrence at or after where the output
left it (an edit keeps the prediction's order), else the latest one before.

Edits. Where the place is found again near where it was lost, what the output put instead of the prediction's
tokens between is an edit, kept by the prediction's token before it (at most MAX_EDITS, each of at most
MAX_EDIT tokens). A draft replays it wherever the same tokens follow the same token again: a renamed
parameter is drafted renamed at its next use. An edit whose replay the output refuses is forgotten.

Pricing. The agreement is the chance that the output's next token follows the prediction: a prior (PRIOR, with
PRIOR_WEIGHT tokens' weight) corrected by the output's tokens, each counted as following the prediction or not
(a token while the place is lost counts as not), decayed by DECAY a token, so that it is what the last ten
tokens or so did. The k policy (policy.KPolicy) grants the sequence its drafts at that acceptance (draft_hint),
and the drafts are the prediction's tokens from its place, edits replayed, up to the k granted. Below FLOOR,
or while the place is lost or the prediction spent, the prediction drafts nothing and the server's method
drafts as it would without one: a model that rewrites rather than edits goes its own way, and then each round
of a prediction's drafts would be verified rows thrown away. The tokens that follow keep counting, so the
prediction drafts again once the output follows it again. Like every draft, a prediction's need speculation on:
with the method "off", or a request's num_speculative_tokens of 0, a prediction is accepted and not used.
"""

from __future__ import annotations

from collections.abc import Callable

from specstream.sequence import Acceptance, Sequence
from specstream.spec_decode.proposer import Draft, Proposer

ALIGN = 3  # output tokens that must occur anywhere in the prediction to find its place again
NEAR = 16  # prediction tokens after where the output left it in which its last 2 tokens find the place again
MAX_EDIT = 8  # the most tokens (removed and inserted) of an edit learned from the output
MAX_EDITS = 32  # edits kept per prediction
PRIOR = 0.9  # the chance that the output's next token follows the prediction, before any output
PRIOR_WEIGHT = 2.0
DECAY = 0.9  # per output token: the agreement is the last ten tokens' or so
FLOOR = 0.5  # below this agreement the prediction drafts nothing: the server's method drafts instead
METHOD = "prediction"  # Draft.method of a prediction's drafts (metrics, the per-chunk stats)

Edit = tuple[tuple[int, ...], tuple[int, ...]]  # (the prediction's tokens removed, the tokens the output put instead)


class Prediction:
    """One sequence's prediction: its tokens, its place against the output so far, the edits the output made to
    it, how well the output has followed it lately."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.position: int | None = 0  # the prediction's next token, where the output follows it; None: lost
        self.left = 0  # where the output last followed it (the search for a lost place starts here)
        self.seen = 0  # output tokens followed so far
        self.lost: tuple[int, int] | None = None  # where the place was lost: (in the prediction, in the output)
        self.edits: dict[int, list[Edit]] = {}  # by the prediction's token before each edit
        # the last draft, not yet followed: its tokens, the place after each (None inside an edit), their edit
        self.pending: tuple[list[int], list[int | None], list[Edit | None]] | None = None
        self.agreement = Acceptance()  # output tokens that followed the prediction, and those that did not (decayed)
        self._ends: dict[tuple[int, ...], list[int]] | None = None  # ALIGN-token windows -> where each ends

    def follow(self, output: list[int]) -> None:
        """Take the output tokens appended since the last call: move the place on (through the last draft, edits
        included), lose it, or find it again (learning the edit between); each token goes into the agreement, and
        an edit the output refused is forgotten."""
        begin = self.seen
        self.seen = len(output)
        if self.pending is not None:
            tokens, after, edits = self.pending
            self.pending = None
            new = output[begin:]
            kept = 0
            while kept < min(len(tokens), len(new)) and tokens[kept] == new[kept]:
                kept += 1
                self._agree(True)
            if kept < min(len(tokens), len(new)) and edits[kept] is not None:
                self._forget(edits[kept])
            if kept:
                self.position = after[kept - 1]
                self.left, self.lost = (self.position, None) if self.position is not None else (self.left, None)
                begin += kept
        for at in range(begin, len(output)):
            tok = output[at]
            if self.position is not None and self.position < len(self.tokens) and self.tokens[self.position] == tok:
                self.position += 1
                self.left = self.position
                self._agree(True)
                continue
            if self.position is not None:
                self.lost = (self.position, at) if self.position < len(self.tokens) else None
                self.position = None
            self._agree(False)
        if self.position is None and len(output) > begin:
            self._find_again(output)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens from the place: the prediction's, with the edits the output made to it before replayed
        where the same tokens follow the same token (a renamed name, each time it comes); none where the place is
        lost or the prediction spent."""
        if self.position is None or k <= 0:
            return []
        tokens: list[int] = []
        after: list[int | None] = []
        edits: list[Edit | None] = []
        i, replayed = self.position, False
        while len(tokens) < k and i < len(self.tokens):
            edit = None if replayed or i == 0 else self._edit_at(i)
            replayed = edit is not None  # not twice at one place (an insertion's token before stays the same)
            if edit is not None:
                removed, inserted = edit
                for j, tok in enumerate(inserted):
                    tokens.append(tok)
                    after.append(i + len(removed) if j == len(inserted) - 1 else None)
                    edits.append(edit)
                i += len(removed)
                continue
            tokens.append(self.tokens[i])
            after.append(i + 1)
            edits.append(None)
            i += 1
        if tokens:
            self.pending = (tokens[:k], after[:k], edits[:k])
        return tokens[:k]

    def available(self) -> int:
        """How many of the prediction's tokens are left after the place."""
        return 0 if self.position is None else len(self.tokens) - self.position

    def acceptance(self) -> float:
        """The chance that the output's next token follows the prediction, as the last tokens did."""
        return self.agreement.estimate(PRIOR, PRIOR_WEIGHT)

    def usable(self) -> bool:
        """Whether the prediction drafts this round: it has a place, tokens after it, and the output has followed it
        lately (FLOOR). An output gone its own way (a rewrite rather than an edit) drafts as it would without one."""
        return self.available() > 0 and self.acceptance() >= FLOOR

    def _agree(self, followed: bool) -> None:
        self.agreement.record(1, int(followed), DECAY)

    def _find_again(self, output: list[int]) -> None:
        """The place after a loss: near where the output left the prediction (the edit between learned), else by
        ALIGN tokens anywhere."""
        near = self.tokens[self.left : self.left + NEAR]
        tail = output[-2:]
        for i in range(len(near) - 1):
            if len(tail) == 2 and near[i : i + 2] == tail:
                self.position = self.left + i + 2
                self._learn(output, self.position - 2, len(output) - 2)
                return
        if len(output) >= ALIGN:
            self.position = self._find(tuple(output[-ALIGN:]))
        if self.position is not None:
            self.lost = None

    def _learn(self, output: list[int], resumed: int, upto: int) -> None:
        """The output left the prediction at self.lost and rejoined it at `resumed`, having put output[..upto] in
        between: an edit, kept (by the prediction's token before it) where it is short and forward."""
        if self.lost is None:
            return
        (start, since), self.lost = self.lost, None
        removed, inserted = tuple(self.tokens[start:resumed]), tuple(output[since:upto])
        if start == 0 or resumed < start or not 0 < len(removed) + len(inserted) <= MAX_EDIT:
            return
        if sum(len(v) for v in self.edits.values()) >= MAX_EDITS:
            return
        known = self.edits.setdefault(self.tokens[start - 1], [])
        if (removed, inserted) not in known:
            known.append((removed, inserted))

    def _edit_at(self, i: int) -> Edit | None:
        for removed, inserted in self.edits.get(self.tokens[i - 1], ()):
            if tuple(self.tokens[i : i + len(removed)]) == removed:
                return removed, inserted
        return None

    def _forget(self, edit: Edit) -> None:
        for known in self.edits.values():
            if edit in known:
                known.remove(edit)

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
            if prediction.usable():
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
            tokens = seq.prediction.draft(k) if seq.prediction.usable() else []
            if tokens:
                drafts[i] = Draft(tokens, method=METHOD)
    rest = [i for i, d in enumerate(drafts) if d is None]
    if len(rest) == len(seqs):
        return proposer.propose(seqs, ks)
    if rest:
        for i, draft in zip(rest, proposer.propose([seqs[i] for i in rest], [ks[i] for i in rest])):
            drafts[i] = draft
    return drafts  # type: ignore[return-value]
