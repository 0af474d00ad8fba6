"""Proposers: n-gram prompt lookup."""

import random

import numpy as np

from specstream.sampling import SamplingParams
from specstream.sequence import Sequence
from specstream.spec_decode.ngram import NgramProposer, TokenArray
from specstream.spec_decode.proposer import Draft


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


def test_ngram_occurrences_are_every_earlier_match_of_the_longest_suffix_that_matched():
    """The lookup (the last token's earlier occurrences, extended backwards) against the definition, on
    random sequences over small and large vocabularies."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        low = rng.randint(1, 3)
        p = NgramProposer(low, rng.randint(low, 6))
        tokens = [rng.randint(0, rng.choice([1, 2, 4, 50])) for _ in range(rng.randint(1, 40))]
        expected: tuple[list[int], int] = ([], 0)
        for n in range(min(p.max_n, len(tokens) - 1), p.min_n - 1, -1):
            hits = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
            if hits:
                expected = (hits, n)
                break
        _, hits, n = p._occurrences(tokens)
        assert (hits.tolist(), n) == expected, (tokens, p.min_n, p.max_n)


def test_ngram_without_any_match_proposes_nothing():
    assert NgramProposer(1, 4).lookup([1, 2, 3, 4], 5) == []


def test_ngram_tree_merges_the_continuations_of_every_occurrence_best_first():
    # [2, 3] occurred at 1, 6 and 11, followed by 5 6 1, 5 7 4 and 8 0 2.
    tokens = [9, 2, 3, 5, 6, 1, 2, 3, 5, 7, 4, 2, 3, 8, 0, 2, 3]
    draft = NgramProposer(1, 2, trees=True).draft_tree(tokens, 4)
    # 5 (two of three), then the shallower 8, then among the depth-2 nodes the most recently seen first.
    assert (draft.tokens, draft.parents) == ([5, 8, 0, 7], [-1, -1, 1, 0])
    assert draft.chances == [2 / 3, 1 / 3, 1 / 3, 1 / 3]
    assert draft.method == "ngram"
    full = NgramProposer(1, 2, trees=True).draft_tree(tokens, 16)
    continuations = [tokens[h + 2 : h + 18] for h in (1, 6, 11)]
    paths = {}
    for i, parent in enumerate(full.parents):
        paths[i] = (paths[parent] if parent >= 0 else []) + [full.tokens[i]]
        # every node lies on some occurrence's continuation, and no path is drafted twice
        assert any(c[: len(paths[i])] == paths[i] for c in continuations)
    assert len({tuple(p) for p in paths.values()}) == len(full.tokens) == 16
    # Without trees, the chain after the latest occurrence, as before.
    assert NgramProposer(1, 2).lookup(tokens, 3) == [8, 0, 2]


def test_ngram_tree_of_one_occurrence_is_the_chain():
    p = NgramProposer(1, 3, trees=True)
    tokens = [1, 2, 3, 4, 5, 9, 7, 2, 3, 4]
    draft = p.draft_tree(tokens, 3)
    assert not draft.is_tree and draft.tokens == p.lookup(tokens, 3) == [5, 9, 7]
    assert p.draft_tree([1, 2, 3, 4], 5).tokens == []


def test_match_index_kept_as_tokens_grow_finds_what_a_whole_lookup_finds():
    """MatchIndex (the chain lookups of auto and n-gram, every step) gives NgramProposer.match's answer, as a
    sequence grows by one token or by several at once (a prompt, a round's accepted drafts), asked once or twice
    at a length, with small vocabularies (many matches) and large (few), and again after the list shrinks."""
    from specstream.spec_decode.ngram import MatchIndex

    rng = random.Random(0)
    for low, high in ((1, 4), (2, 5), (1, 2), (3, 3)):
        exact = NgramProposer(low, high)
        for _ in range(80):
            tokens = [rng.randrange(rng.choice([2, 4, 50])) for _ in range(rng.randrange(1, 60))]
            index = MatchIndex(low, high)
            length = 0
            while length <= len(tokens):
                for _ in range(1 + length % 2):
                    assert index.match(tokens[:length], 5) == exact.match(tokens[:length], 5), (tokens[:length], low, high)
                length += rng.choice([1, 1, 1, 2, 3, 9])
            cut = rng.randrange(len(tokens) + 1)
            assert index.match(tokens[:cut], 3) == exact.match(tokens[:cut], 3)


def test_ngram_chain_drafts_come_from_the_index_and_are_released_with_the_request():
    p = NgramProposer(1, 3)
    seq = Sequence("r", [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 6, 2, 3], SamplingParams(max_tokens=20), 0)
    (draft,) = p.propose([seq], [3])
    assert draft.tokens == [4, 7, 8] and draft.method == "ngram" and p.match_seq(seq, 2) == ([4, 7], 2)
    seq.token_ids += [4, 7]
    assert p.propose([seq], [2])[0].tokens == [8, 6]
    p.release(seq)
    assert not p._indexes


def test_token_array_follows_a_growing_sequence_and_reads_a_shorter_one_again():
    rng = random.Random(5)
    held = TokenArray()
    tokens: list[int] = []
    for _ in range(80):  # past the first buffer's 256 tokens
        tokens += [rng.randrange(50_000) for _ in range(rng.randrange(1, 9))]
        view = held.view(tokens)
        assert view.dtype == np.int64 and view.tolist() == tokens
    assert held.view(tokens[:10]).tolist() == tokens[:10]  # shorter: read again, not the old tail
    assert held.view([7, 8]).tolist() == [7, 8]


def test_ngram_drafts_the_same_from_a_sequences_kept_array_as_from_its_list():
    rng = random.Random(6)
    for trees in (False, True):
        p = NgramProposer(1, 4, trees=trees)
        seq = Sequence("r", [rng.randrange(6) for _ in range(20)], SamplingParams(max_tokens=200), 0)
        for _ in range(60):
            seq.token_ids += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            listed = p.draft_tree(list(seq.token_ids), 5) if trees else Draft(p.lookup(list(seq.token_ids), 5))
            (drafted,) = p.propose([seq], [5])
            assert (drafted.tokens, drafted.parents, drafted.chances) == (listed.tokens, listed.parents, listed.chances)
            assert p.match(p.tokens_of(seq), 5) == p.match(list(seq.token_ids), 5)
        p.release(seq)
        assert not p._arrays
