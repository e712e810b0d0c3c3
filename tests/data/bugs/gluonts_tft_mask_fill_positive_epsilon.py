# awslabs/gluonts#1401 (commit 2215c7c7a): TFT SelfAttention filled masked scores (future steps, unobserved keys) with
# +1e-9 instead of -1e9, so after softmax the causal and key masks had no effect. (MXNet upstream, ported to torch.)
import math
import sys
from typing import Optional, Tuple

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
FILL = -1e9 if FIXED else 1e-9
torch.manual_seed(0)


class SelfAttention(nn.Module):
    def __init__(self, context_length: int, prediction_length: int, d_hidden: int, n_head: int = 1,
                 bias: bool = True, dropout: float = 0.0, temperature: float = 1.0):
        super().__init__()
        self.context_length = context_length
        self.prediction_length = prediction_length
        self.d_hidden = d_hidden
        self.n_head = n_head
        self.d_head = d_hidden // n_head
        self.temperature = temperature
        self.dropout = nn.Dropout(dropout)
        self.q_proj = nn.Linear(d_hidden, d_hidden, bias=bias)
        self.k_proj = nn.Linear(d_hidden, d_hidden, bias=bias)
        self.v_proj = nn.Linear(d_hidden, d_hidden, bias=bias)
        self.out_proj = nn.Linear(d_hidden, d_hidden, bias=bias)

    def _split_head(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], x.shape[1], self.n_head, self.d_head).transpose(1, 2)

    def _merge_head(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(x.shape[0], -1, self.d_hidden)

    def _compute_qkv(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cx = x[:, -self.prediction_length:]
        q = self._split_head(self.q_proj(cx))
        k = self._split_head(self.k_proj(x))
        v = self._split_head(self.v_proj(x))
        return q, k, v

    def _apply_mask(self, score: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        k_idx = torch.arange(score.shape[-1])[None, None, None, :]
        q_idx = (torch.arange(score.shape[-2]) + self.context_length)[None, None, :, None]
        unidir_mask = (k_idx <= q_idx).expand_as(score)
        score = torch.where(unidir_mask, score, torch.ones_like(score) * FILL)
        if key_mask is not None:
            key_mask = key_mask[:, None, None, :].expand_as(score)  # head, query
            score = torch.where(key_mask, score, torch.ones_like(score) * FILL)
        return score

    def _compute_attn_score(self, q, k, mask):
        score = torch.matmul(q, k.transpose(-1, -2))
        score = self._apply_mask(score, mask)
        score = score / (math.sqrt(self.d_head) * self.temperature)
        score = torch.softmax(score, dim=-1)
        return self.dropout(score)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        q, k, v = self._compute_qkv(x)
        score = self._compute_attn_score(q, k, mask)
        return self.out_proj(self._merge_head(torch.matmul(score, v)))


class TemporalFusionDecoder(nn.Module):
    def __init__(self, context_length, prediction_length, d_hidden, n_head):
        super().__init__()
        self.prediction_length = prediction_length
        self.attention = SelfAttention(context_length, prediction_length, d_hidden, n_head)
        self.att_lnorm = nn.LayerNorm(d_hidden)
        self.output_proj = nn.Linear(d_hidden, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        att = self.attention(x, mask)
        y = self.att_lnorm(x[:, -self.prediction_length:] + att)
        return self.output_proj(y).squeeze(-1)


CONTEXT, PRED, D = 8, 4, 16
decoder = TemporalFusionDecoder(CONTEXT, PRED, D, n_head=2).eval()
temporal_features = torch.randn(2, CONTEXT + PRED, D)  # LSTM encoder/decoder outputs, past then future
past_observed_values = torch.ones(2, CONTEXT)
past_observed_values[1, :3] = 0.  # second series: short history, left-padded
mask = torch.cat([past_observed_values, torch.ones(2, PRED)], dim=1).bool()

with torch.no_grad():
    out = decoder(temporal_features, mask)
    changed = temporal_features.clone()
    changed[:, -1] += 5.0  # change only the last forecast step
    changed[1, :3] += 5.0  # and the unobserved (padded) history of series 1
    out2 = decoder(changed, mask)
print(f"fixed={FIXED} change of the first forecast step after editing future/padded inputs: "
      f"{(out2[:, 0] - out[:, 0]).abs().max().item():.3e}")
