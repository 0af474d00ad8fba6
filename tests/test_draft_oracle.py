"""benchmarks/draft_oracle.py: how far a draft agrees with an answer, and the replay of answers round by round."""

from __future__ import annotations

import pytest
from benchmark_module import load

from specstream.kernels import suffix_tree
from specstream.spec_decode.proposer import Draft

draft_oracle = load("draft_oracle")
Answer, PICKS = draft_oracle.Answer, draft_oracle.PICKS


def test_a_draft_agrees_as_far_as_its_one_path_or_its_trees_best_path_does():
    agreed = draft_oracle.agreed
    assert agreed(Draft([5, 6, 7]), [5, 6, 9, 7]) == 2
    assert agreed(Draft([5, 6, 7]), [5, 6]) == 2  # the answer ends first
    assert agreed(Draft([4, 6]), [5, 6]) == 0
    assert agreed(Draft([]), [5]) == 0
    # A tree: 5 -> (6 -> 8, 7 -> 9); the answer goes 5, 7, 9, 1: its path through the second branch.
    tree = Draft([5, 6, 7, 8, 9], parents=[-1, 0, 0, 1, 2])
    assert agreed(tree, [5, 7, 9, 1]) == 3
    assert agreed(tree, [5, 6, 9]) == 2
    assert agreed(tree, [6]) == 0


@pytest.mark.skipif(not suffix_tree.available(), reason=f"the suffix tree could not be built: {suffix_tree.unavailable_reason()}")
def test_an_answer_that_repeats_an_earlier_one_is_drafted_from_the_suffix_cache_not_by_ngram():
    """The second answer repeats the first, which its prompt does not hold: n-gram lookup has nothing to match
    (every round emits one token), suffix decoding drafts it from the cache the first answer went into; the better
    of the two per round is at least either alone; a round's tokens never pass the answer's end."""
    answer = list(range(1000, 1060))
    done = [Answer([1, 2, 3], answer, "stop"), Answer([4, 5, 6], answer, "stop")]
    ngram, suffix, best = (draft_oracle.replay(done, 1, 16, pick, 1.0, 0.1) for pick in PICKS)
    assert ngram.tokens == suffix.tokens == best.tokens == len(answer)
    assert ngram.rounds == len(answer) and ngram.suffix_rounds == 0
    assert suffix.rounds < len(answer) / 3 and suffix.suffix_rounds > 0
    assert best.rounds <= min(ngram.rounds, suffix.rounds)
    # With a longer draft for the match it has (max_spec_factor), fewer rounds: the first rounds' matches are short.
    assert draft_oracle.replay(done, 1, 16, PICKS[1], 4.0, 0.1).rounds < suffix.rounds
    # Without the warm answer in the cache, the repeat has nothing to draft from either.
    alone = draft_oracle.replay(done[1:], 0, 16, PICKS[1], 1.0, 0.1)
    assert alone.rounds == len(answer)
