"""Draft vocabulary maps (d2t offsets, t2d mask), padding, coverage and caching."""
from collections import Counter

import pytest
import torch

from draftsmith.data import vocab


def test_top_n_sorted_with_offsets():
    counts = Counter({7: 10, 3: 9, 11: 1, 5: 5})
    d2t, t2d, report = vocab.build_vocab(counts, vocab_size=16, draft_vocab_size=3)
    used = d2t + torch.arange(3)
    assert used.tolist() == [3, 5, 7]                 # the 3 most frequent, ascending
    assert t2d.nonzero().flatten().tolist() == [3, 5, 7]
    assert report["coverage"] == pytest.approx(24 / 25)


def test_padding_when_data_has_fewer_tokens():
    d2t, t2d, report = vocab.build_vocab(Counter({4: 3, 9: 1}), vocab_size=12, draft_vocab_size=5)
    used = (d2t + torch.arange(5)).tolist()
    assert len(set(used)) == 5 and {4, 9} <= set(used) and used == sorted(used)
    assert t2d.sum() == 5 and report["num_padded"] == 3


def test_rejects_draft_vocab_larger_than_target():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        vocab.build_vocab(Counter({1: 1}), vocab_size=4, draft_vocab_size=8)


def test_counts_only_loss_masked_tokens():
    counts = vocab.count_tokens([[1, 2, 3, 4]], [[0, 1, 1, 0]])
    assert counts == Counter({2: 1, 3: 1})


def test_cache_is_keyed_by_data_hash(tmp_path):
    data = {"input_ids": [[1, 2, 2, 3]], "loss_mask": [[1, 1, 1, 1]]}
    a = vocab.load_or_build(tmp_path, "hashA", data, 8, 2)
    other = {"input_ids": [[5, 5, 6]], "loss_mask": [[1, 1, 1]]}
    b = vocab.load_or_build(tmp_path, "hashB", other, 8, 2)
    assert (a[0] + torch.arange(2)).tolist() == [1, 2] and (b[0] + torch.arange(2)).tolist() == [5, 6]
    assert vocab.load_or_build(tmp_path, "hashA", other, 8, 2)[0].tolist() == a[0].tolist()  # cached
