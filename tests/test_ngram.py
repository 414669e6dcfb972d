"""The n-gram (prompt lookup) proposer."""
from maxjax.engine.ngram import propose


def test_longest_recurring_suffix_proposes_what_followed_it():
    seq = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4]
    assert propose(seq, 3) == [5, 9, 9]          # "2 3 4" recurs: it was followed by 5 9 9
    assert propose(seq, 1) == [5]


def test_the_most_recent_match_wins_and_longer_n_first():
    seq = [7, 1, 2, 8, 5, 1, 2, 6, 3, 1, 2]
    assert propose(seq, 2) == [6, 3]              # "1 2" last seen before "6 3"
    seq = [4, 1, 2, 8, 0, 9, 2, 7, 4, 1, 2]
    assert propose(seq, 1, max_n=3) == [8]        # "4 1 2" beats the later "2"


def test_no_match_or_too_short():
    assert propose([1, 2, 3, 4], 3) == []
    assert propose([5], 3) == []
    assert propose([1, 2, 1, 2], 0) == []
    assert propose([3, 1, 2, 3], 4, min_n=2) == []   # only a 1-gram recurs
    assert propose([3, 1, 2, 3], 4, min_n=1) == [1, 2, 3]


def test_a_match_near_the_end_proposes_fewer_tokens():
    assert propose([6, 6, 6], 4) == [6]
