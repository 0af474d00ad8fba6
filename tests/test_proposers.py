"""Proposers: n-gram prompt lookup."""

from specstream.spec_decode.ngram import NgramProposer


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    p = NgramProposer(1, 3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 6, 2, 3, 4]
    # suffix [2, 3, 4] last occurred at index 6 -> followed by 7, 8, 6
    assert p.lookup(tokens, 3) == [7, 8, 6]


def test_ngram_falls_back_to_shorter_suffix():
    p = NgramProposer(1, 3)
    assert p.lookup([5, 6, 7, 1, 2, 9, 7], 2) == [1, 2]


def test_ngram_respects_min_n_and_k():
    assert NgramProposer(2, 3).lookup([5, 6, 7, 1, 2, 9, 7], 2) == []
    assert NgramProposer(1, 2).lookup([1, 2, 3, 4, 1], 2) == [2, 3]


def test_ngram_without_any_match_proposes_nothing():
    assert NgramProposer(1, 4).lookup([1, 2, 3, 4], 5) == []
