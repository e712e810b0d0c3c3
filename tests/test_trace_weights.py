"""trace/weights.py: a softmax's weights followed (an exp of them is no softmax written by hand; a softmax over them
and a term added to them are recorded against the first softmax's mask)."""

from __future__ import annotations

import torch

import maskcli


def _scores():
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    return q @ k.transpose(-1, -2)


def test_an_exp_of_what_a_softmax_s_weights_make_is_no_softmax():
    """AKT's distance decay: exp of a value computed from the cumulative sum of masked weights, scaling the scores
    before the real softmax: one attention call (the softmax), not a second read off the exp."""
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    with maskcli.trace() as t:
        scores = _scores()
        weights = torch.softmax(scores.masked_fill(~causal, -1e32), dim=-1)
        decay = ((weights.sum(-1, keepdim=True) - weights.cumsum(-1)).clamp(min=0) * -0.5).exp()
        torch.softmax((scores * decay).masked_fill(~causal, float("-inf")), dim=-1)
    assert [call.details.get("by_hand") for call in t.calls] == [None, None]


def test_an_exp_of_scores_is_still_a_softmax_written_by_hand():
    with maskcli.trace() as t:
        scores = _scores()
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        (e / e.sum(-1, keepdim=True))
    assert [call.details.get("by_hand") for call in t.calls] == ["exp"]


def test_a_softmax_over_weights_names_the_first():
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    with maskcli.trace() as t:
        weights = torch.softmax(_scores().masked_fill(~causal, float("-inf")), dim=-1)
        torch.softmax(weights.reshape(-1, 6).reshape(2, 2, 6, 6) * 2.0, dim=-1)
    assert len(t.calls) == 2
    assert t.calls[1].details.get("over_weights") == t.calls[0].index
    assert "over_weights" not in t.calls[0].details


def test_a_term_added_to_the_weights_is_read_where_it_reaches_a_masked_key():
    """The first cell is a double loop's over the cells the causal mask hides; an epsilon added, a 0/1 product and
    weights mixed with a term masked alike are not read."""
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    for term, read in ((torch.full((6, 6), 1 / 6), True), (torch.full((6, 6), 1e-9), False),
                       (causal / causal.sum(-1, keepdim=True), False)):
        with maskcli.trace() as t:
            scores = _scores()
            weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            mixed = 0.8 * weights + 0.2 * term
            mixed @ torch.randn(2, 2, 6, 4)
        said = t.calls[0].details.get("weighted_after")
        assert (said is not None) == read
        if read:
            cell = next((b, h, i, j) for b in range(2) for h in range(2) for i in range(6) for j in range(6)
                        if not causal[i, j])
            assert tuple(said["cell"]) == cell and said["later"] and not said["padding"]
            assert said["cells"] == 2 * 2 * int((~causal).sum())


def test_a_softmax_over_some_rows_of_the_weights_names_them():
    """sparseKT's top-k: the weights sliced along their queries, a piece reshaped, thresholded and joined back in
    order (the rows of the whole again), or one piece softmaxed alone (its rows recorded, `over_rows`)."""
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    with maskcli.trace() as t:
        weights = torch.softmax(_scores().masked_fill(~causal, float("-inf")), dim=-1)
        head, tail = weights[:, :, :2, :], weights[:, :, 2:, :].reshape(-1, 6)
        tail = torch.where(tail >= 0.1, tail, torch.tensor(-1e32)).reshape(2, 2, 4, 6)
        torch.softmax(torch.cat([head, tail], dim=2), dim=-1)
        torch.softmax(weights[..., 3:, :], dim=-1)
    assert [call.details.get("over_weights") for call in t.calls] == [None, 0, 0]
    assert [call.details.get("over_rows") for call in t.calls] == [None, None, [3, 6]]
