"""checks/backward.py: a bidirectional LM's backward stream (its loss trains the previous token, no query sees the key
before it) answers trace's sees-later suspicion; an anti-causal stream no loss states stays suspicious."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import maskcli
from maskcli.checks.registry import severity


def _streams(backward_loss: bool, lengths=(6, 2)) -> list:
    """Written as AllenNLP's bidirectional LM transformer: a forward stream under tril, a backward one under its
    transpose, each over the same embedded ids; the forward loss on the next token, the backward one (where
    `backward_loss`) on the previous token. Runs over each length in `lengths` (a run of 2 tokens is too short for
    its loss to be read: its site says). The (code, severity) findings."""
    torch.manual_seed(0)
    embed, proj, head = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 24), torch.nn.Linear(8, 20)

    def stream(x, keep):
        q, k, v = proj(x).chunk(3, dim=-1)
        return (q @ k.transpose(1, 2)).masked_fill(~keep, float("-inf")).softmax(-1) @ v

    class Forward(torch.nn.Module):
        def forward(self, x, keep):
            return stream(x, keep)

    class BiLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.forward_stream, self.backward_stream = Forward(), Forward()

        def forward(self, tokens):
            x, n = embed(tokens), tokens.shape[1]
            tril = torch.ones(n, n, dtype=torch.bool).tril()
            fwd, bwd = self.forward_stream(x, tril), self.backward_stream(x, tril.T)
            loss = F.cross_entropy(head(fwd[:, :-1]).transpose(1, 2), tokens[:, 1:])
            if backward_loss:
                loss = loss + F.cross_entropy(head(bwd[:, 1:]).transpose(1, 2), tokens[:, :-1])
            return loss

    ids = torch.tensor([[3, 5, 9, 2, 14, 7], [4, 11, 6, 8, 2, 13]])
    with maskcli.trace() as t, torch.no_grad():
        model = BiLM()
        for length in lengths:
            model(ids[:, :length])
    return sorted({(f.code, severity(f)) for group in t.groups() for f in group.findings})


def test_a_backward_stream_its_loss_states_is_no_causal_slip_and_one_no_loss_states_is():
    """With the backward loss the anti-causal stream's later keys are its context, at the 2-token run too (its site
    was read so at the 6-token run); without it, the same stream is still suspicious."""
    assert [code for code, _ in _streams(backward_loss=True)] == []
    assert ("sees-later", "suspicious") in _streams(backward_loss=False)
