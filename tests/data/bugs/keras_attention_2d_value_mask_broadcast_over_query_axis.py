# keras (torch backend), keras.layers.Attention: keras-team/keras#21595 (fixes keras-team/keras#21483).
# A 2D value mask [B, Tv] is turned into an additive -1e9 bias without expand_dims(axis=-2), so it
# broadcasts as [1, B, Tv]: query row q of every batch element gets batch element q's padding mask.
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(torch.nn.Module):
    """keras/src/layers/attention/attention.py, score_mode="dot", use_scale=False, on the torch backend."""

    def __init__(self, use_scale=False, score_mode="dot", dropout=0.0):
        super().__init__()
        self.use_scale = use_scale
        self.score_mode = score_mode
        self.dropout = dropout
        self.scale = None

    def _calculate_scores(self, query, key):
        if self.score_mode == "dot":
            scores = torch.matmul(query, key.permute(0, 2, 1))
            if self.scale is not None:
                scores *= self.scale
        return scores

    def _apply_scores(self, scores, value, scores_mask=None, training=False):
        if scores_mask is not None:
            padding_mask = torch.logical_not(scores_mask)
            # Bias so padding positions do not contribute to attention
            # distribution.  Note 65504. is the max float16 value.
            max_value = 65504.0 if scores.dtype == torch.float16 else 1.0e9
            if FIXED:
                if len(padding_mask.shape) == 2:
                    padding_mask = torch.unsqueeze(padding_mask, dim=-2)
            scores -= max_value * padding_mask.to(scores.dtype)

        weights = torch.softmax(scores, dim=-1)
        return torch.matmul(weights, value), weights

    def _calculate_score_mask(self, scores, v_mask, use_causal_mask):
        if use_causal_mask:
            score_shape = scores.shape
            mask_shape = (1, score_shape[-2], score_shape[-1])
            ones_mask = torch.ones(mask_shape, dtype=torch.int32)
            row_index = torch.cumsum(ones_mask, dim=-2)
            col_index = torch.cumsum(ones_mask, dim=-1)
            causal_mask = torch.greater_equal(row_index, col_index)
            if v_mask is not None:
                v_mask = torch.unsqueeze(v_mask, dim=-2)
                return torch.logical_and(v_mask, causal_mask)
            return causal_mask
        else:
            # If not using causal mask, return the value mask as is,
            # or None if the value mask is not provided.
            return v_mask

    def forward(self, inputs, mask=None, training=False, return_attention_scores=False, use_causal_mask=False):
        q = inputs[0]
        v = inputs[1]
        k = inputs[2] if len(inputs) > 2 else v
        q_mask = mask[0] if mask else None
        v_mask = mask[1] if mask else None
        scores = self._calculate_scores(query=q, key=k)
        scores_mask = self._calculate_score_mask(scores, v_mask, use_causal_mask)
        attention_output, attention_scores = self._apply_scores(
            scores=scores, value=v, scores_mask=scores_mask, training=training
        )
        if q_mask is not None:
            q_mask = torch.unsqueeze(q_mask, dim=-1)
            attention_output *= q_mask.to(attention_output.dtype)
        if return_attention_scores:
            return attention_output, attention_scores
        return attention_output


# The model of keras-team/keras#21483: Embedding(mask_zero=True) -> Dense q / k -> Attention([q, k], mask=[m, m]).
# The batch size equals the sequence length here, which is the case where the buggy broadcast does not crash.
VOCAB, D, B, T = 20, 16, 4, 4
emb = torch.nn.Embedding(VOCAB + 1, D)
dq = torch.nn.Linear(D, D)
dk = torch.nn.Linear(D, D)
att = Attention()

lengths = [4, 2, 3, 1]
ids = torch.zeros(B, T, dtype=torch.long)
for b, n in enumerate(lengths):
    ids[b, :n] = torch.randint(1, VOCAB + 1, (n,))

with torch.no_grad():
    x = emb(ids)
    mask = ids != 0
    out = att([dq(x), dk(x)], mask=[mask, mask])

    # Reference: each sequence alone, without padding.
    worst = 0.0
    for b, n in enumerate(lengths):
        xb = emb(ids[b : b + 1, :n])
        ref = att([dq(xb), dk(xb)])
        worst = max(worst, (out[b, :n] - ref[0]).abs().max().item())
print(f"max |padded batch - each sequence alone| over real tokens: {worst:.6f}")
