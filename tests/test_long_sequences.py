"""Linear-memory training for long samples: the blocked TTT attention, the blocked vocabulary loss,
the streamed teacher and step checkpointing give the same loss and gradients as the whole-sequence
computation, and keep no tensor that grows with T x T or T x V for backward."""
import math

import pytest
import torch
from transformers import LlamaConfig

from draftsmith.heads import objective, ttt
from draftsmith.heads.registry import head_spec
from draftsmith.heads.ttt import TTTAttention
from draftsmith.recipe import HeadConfig
from draftsmith.train.batches import StreamedTeacher, teacher_targets

V, H = 64, 32
BLOCK_KINDS = ("dflash", "peagle")


def _dense_ttt_attention(qs, ks, vs):
    """The pattern from its definition: a materialized mask, step-0 keys causal, later steps diagonal."""
    q, T = qs[-1], qs[-1].shape[2]
    allowed = torch.zeros(T, T * len(ks), dtype=torch.bool)
    allowed[:, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    for j in range(1, len(ks)):
        allowed[:, j * T:(j + 1) * T] = torch.eye(T, dtype=torch.bool)
    keys = torch.cat(ks, 2).repeat_interleave(q.shape[1] // ks[0].shape[1], 1)
    values = torch.cat(vs, 2).repeat_interleave(q.shape[1] // vs[0].shape[1], 1)
    scores = (q @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values


def _attention_grads(budget, steps=4, T=23):
    gen = torch.Generator().manual_seed(0)
    leaves = [[torch.randn(2, n, T, 8, generator=gen, requires_grad=True) for n in (4, 2, 2)] for _ in range(steps)]
    attend, outs = TTTAttention(budget), []
    for i, (q, k, v) in enumerate(leaves):
        outs.append(attend.at(i)(q, k, v))
    weights = torch.randn(steps, *outs[0].shape, generator=gen)
    sum((w * o).sum() for w, o in zip(weights, outs)).backward()
    return outs, [t.grad for step in leaves for t in step], leaves


@pytest.mark.parametrize("budget", [2 * 4 * 5 * 27, 2 * 4 * 1 * 27])   # query blocks of 5, of 1
def test_blocked_ttt_attention_equals_dense_forward_and_gradients(budget):
    outs, grads, leaves = _attention_grads(budget)
    ref_leaves = [[t.detach().clone().requires_grad_() for t in step] for step in leaves]
    ref_outs = [_dense_ttt_attention(*[[s[j] for s in ref_leaves[:i + 1]] for j in range(3)]) for i in range(len(ref_leaves))]
    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    _, whole_grads, _ = _attention_grads(None)   # one block: no checkpoint
    assert len(grads) == len(whole_grads) == 12
    for g, w in zip(grads, whole_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def _head(kind, vocab=V):
    tc = LlamaConfig(vocab_size=vocab, hidden_size=H, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096)
    cfg = HeadConfig(kind=kind, ttt_steps=3, draft_vocab_size=vocab) if kind != "medusa" else HeadConfig(kind=kind)
    if kind in BLOCK_KINDS:  # block drafters: 4-slot blocks / 3 depths, a mask token, every position an anchor
        cfg = HeadConfig(kind=kind, block_size=4, num_layers=2, mask_token_id=0, num_anchors=64, draft_vocab_size=vocab)
    head = head_spec(kind).model.from_target(tc, cfg, [1, 3, 4] if kind in ("eagle3",) + BLOCK_KINDS else [6])
    torch.manual_seed(1)
    for p in head.parameters():
        p.data.normal_(0, 0.2)
    return head


def _batch(head, T=40, B=2, streamed=False):
    gen, V = torch.Generator().manual_seed(2), head.config["vocab_size"]
    width = head.fc.in_features if head.kind in ("eagle3",) + BLOCK_KINDS else H
    teacher = torch.randn(B, T, H, generator=gen)
    lm_head = torch.randn(V, H, generator=gen) * 0.5
    has = torch.ones(B, T, dtype=torch.bool)
    has[1, -7:] = False                                     # padding: no teacher, no loss
    batch = {"input_ids": torch.randint(0, V, (B, T), generator=gen), "position_ids": torch.arange(T).expand(B, T),
             "aux": torch.randn(B, T, width, generator=gen) if head.kind in ("eagle3",) + BLOCK_KINDS else teacher,
             "teacher": teacher, "has_teacher": has}
    d2t, t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    return teacher_targets(batch, lm_head, d2t, t2d, budget=1 if streamed else None)


def _loss_and_grads(head, batch):
    head.zero_grad()
    torch.manual_seed(4)  # the block drafters' random anchors and chains: the same in both runs
    loss, metrics = head.loss(batch)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["eagle3", "eagle2", "mtp", "medusa", *BLOCK_KINDS])
def test_blocked_loss_streamed_teacher_and_checkpointing_match_whole(kind, monkeypatch):
    head = _head(kind)
    head.eval()  # EAGLE-2's input noise off: both runs see the same features
    whole_loss, whole_metrics, whole_grads = _loss_and_grads(head, _batch(head))
    monkeypatch.setattr(ttt, "SCORE_BUDGET", 2 * 4 * 7 * 45)     # query blocks of 7
    monkeypatch.setattr(objective, "LOSS_BUDGET", 2 * V * 6)     # position blocks of 6
    head.checkpoint_steps = True
    batch = _batch(head, streamed=True)
    assert isinstance(batch["target_probs"], StreamedTeacher)
    loss, metrics, grads = _loss_and_grads(head, batch)
    torch.testing.assert_close(loss, whole_loss, atol=1e-5, rtol=1e-5)
    for name in whole_metrics:
        torch.testing.assert_close(metrics[name].float(), whole_metrics[name].float(), atol=1e-5, rtol=1e-5)
    assert grads.keys() == whole_grads.keys() and len(grads) > 3
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_streamed_teacher_equals_materialized_on_a_draft_vocabulary():
    gen = torch.Generator().manual_seed(3)
    B, T, Vd = 2, 17, 20
    teacher, lm_head = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen)
    has = torch.rand(B, T, generator=gen) > 0.3
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=gen)[:Vd]] = True
    d2t = torch.nonzero(t2d).squeeze(1) - torch.arange(Vd)
    whole = teacher_targets({"teacher": teacher, "has_teacher": has}, lm_head, d2t, t2d)
    streamed = teacher_targets({"teacher": teacher, "has_teacher": has}, lm_head, d2t, t2d, budget=B * T * Vd - 1)
    assert isinstance(streamed["target_probs"], StreamedTeacher) and streamed["target_probs"].shape == (B, T, Vd)
    for lo, hi in [(0, T), (3, 9), (16, 17)]:
        torch.testing.assert_close(streamed["target_probs"][:, lo:hi], whole["target_probs"][:, lo:hi])
    assert torch.equal(streamed["target_valid"], whole["target_valid"])
    assert torch.equal(streamed["target_argmax"], whole["target_argmax"])


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_nothing_quadratic_or_vocabulary_wide_is_kept_for_backward(kind, monkeypatch):
    """Every tensor autograd saves is recorded: with blocks and step checkpointing none holds T x T scores
    or T x V logits (without them, both are saved: the check can fail)."""
    T, vocab = 96, 160
    head = _head(kind, vocab)

    def largest_saved(blocked: bool):
        if blocked:
            monkeypatch.setattr(ttt, "SCORE_BUDGET", 2 * 4 * 8 * (T + 3))
            monkeypatch.setattr(objective, "LOSS_BUDGET", 2 * V * 8)
        head.checkpoint_steps = blocked
        batch = _batch(head, T=T, streamed=blocked)
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            loss, _ = head.loss(batch)
        loss.backward()
        return max(sizes)

    quadratic = 2 * 4 * T * T // 2
    widest = 2 * T * 3 * H                              # the widest activation: the three target features
    assert largest_saved(False) >= min(quadratic, 2 * (T - 3) * vocab) > widest
    assert largest_saved(True) <= widest


@pytest.mark.parametrize("world, batch_size", [(1, 4), (2, 3)])
def test_length_grouped_batches_hold_every_sample_once_with_less_padding(world, batch_size):
    from draftsmith.train.batches import epoch_order
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.rand(600, generator=gen) ** 3 * 4000 + 16).long().tolist()   # long-tailed, as reasoning traces
    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)
    for epoch in range(2):
        plain = [epoch_order(600, 1, epoch, r, world, batch_size) for r in range(world)]
        grouped = [epoch_order(600, 1, epoch, r, world, batch_size, lengths) for r in range(world)]
        assert grouped == [epoch_order(600, 1, epoch, r, world, batch_size, lengths) for r in range(world)]  # resumable
        assert [len(g) for g in grouped] == [len(p) for p in plain]            # the same steps per epoch
        seen = sorted(i for rank in grouped for b in rank for i in b)
        assert seen == sorted(i for rank in plain for b in rank for i in b) and len(set(seen)) == len(seen)
        assert padding([b for rank in grouped for b in rank]) < 0.2 * padding([b for rank in plain for b in rank])
        # the ranks of one step hold samples of similar lengths (equally busy)
        if world == 2:
            step_gap = [abs(max(lengths[i] for i in a) - max(lengths[i] for i in b)) for a, b in zip(*grouped)]
            plain_gap = [abs(max(lengths[i] for i in a) - max(lengths[i] for i in b)) for a, b in zip(*plain)]
            assert sum(step_gap) < 0.2 * sum(plain_gap)
