# MTSWebServices/RecTools#197 ("Bert4rec"; review thread on rectools/models/bert4rec.py, 2024-11-02; the fixed form
# landed as rectools/models/nn/transformers/torch_backbone.py in commit 91bfe73).
# Bug: `encode_sessions` builds the causal `attn_mask` when `use_causal_attn` (SASRec's shifted-sequence task), then
# on the next lines assigns `attn_mask` again from the left-padded sessions' padding mask, tiled with
# `.repeat(n_heads, L, 1)`: the causal mask is lost (every item sees later items) and the (B * n_heads, L, L) mask is
# laid head-major where nn.MultiheadAttention reads it batch-major, so one user's heads get another user's padding.
# Fix: causal mask and key padding mask kept apart and, when both are used, merged by `_merge_masks`
# (view(B, 1, L, L).expand(-1, n_heads, ...).reshape(-1, L, L), diagonal zeroed).
import sys
import typing as tp

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class PointWiseFeedForward(nn.Module):
    def __init__(self, n_factors: int, n_factors_ff: int, dropout_rate: float, activation: nn.Module) -> None:
        super().__init__()
        self.ff_linear_1 = nn.Linear(n_factors, n_factors_ff)
        self.ff_dropout_1 = nn.Dropout(dropout_rate)
        self.ff_activation = activation
        self.ff_linear_2 = nn.Linear(n_factors_ff, n_factors)

    def forward(self, seqs: torch.Tensor) -> torch.Tensor:
        output = self.ff_activation(self.ff_linear_1(seqs))
        return self.ff_linear_2(self.ff_dropout_1(output))


class SASRecTransformerLayer(nn.Module):
    def __init__(self, n_factors: int, n_heads: int, dropout_rate: float):
        super().__init__()
        self.multi_head_attn = nn.MultiheadAttention(n_factors, n_heads, dropout_rate, batch_first=True)
        self.q_layer_norm = nn.LayerNorm(n_factors)
        self.ff_layer_norm = nn.LayerNorm(n_factors)
        self.feed_forward = PointWiseFeedForward(n_factors, n_factors, dropout_rate, nn.ReLU())
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, seqs, attn_mask, key_padding_mask):
        q = self.q_layer_norm(seqs)
        mha_output, _ = self.multi_head_attn(
            q, seqs, seqs, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False
        )
        seqs = q + mha_output
        ff_input = self.ff_layer_norm(seqs)
        seqs = self.feed_forward(ff_input)
        seqs = self.dropout(seqs)
        seqs += ff_input
        return seqs


class SASRecTransformerLayers(nn.Module):
    def __init__(self, n_blocks: int, n_factors: int, n_heads: int, dropout_rate: float):
        super().__init__()
        self.n_blocks = n_blocks
        self.transformer_blocks = nn.ModuleList(
            [SASRecTransformerLayer(n_factors, n_heads, dropout_rate) for _ in range(self.n_blocks)]
        )
        self.last_layernorm = nn.LayerNorm(n_factors, eps=1e-8)

    def forward(self, seqs, timeline_mask, attn_mask, key_padding_mask):
        for i in range(self.n_blocks):
            seqs *= timeline_mask  # [batch_size, session_max_len, n_factors]
            seqs = self.transformer_blocks[i](seqs, attn_mask, key_padding_mask)
        seqs *= timeline_mask
        seqs = self.last_layernorm(seqs)
        return seqs


class LearnableInversePositionalEncoding(nn.Module):
    def __init__(self, session_max_len: int, n_factors: int):
        super().__init__()
        self.pos_emb = nn.Embedding(session_max_len, n_factors)

    def forward(self, sessions: torch.Tensor) -> torch.Tensor:
        batch_size, session_max_len, _ = sessions.shape
        positions = self.pos_emb.weight[:session_max_len].flip(0)  # left padding: last item gets position 0
        return sessions + positions.unsqueeze(0).expand(batch_size, -1, -1)


class TransformerTorchBackbone(nn.Module):
    def __init__(self, n_items, n_factors, n_heads, n_blocks, session_max_len, dropout_rate,
                 use_causal_attn=True, use_key_padding_mask=True):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, n_factors, padding_idx=0)
        self.pos_encoding_layer = LearnableInversePositionalEncoding(session_max_len, n_factors)
        self.emb_dropout = nn.Dropout(dropout_rate)
        self.transformer_layers = SASRecTransformerLayers(n_blocks, n_factors, n_heads, dropout_rate)
        self.use_causal_attn = use_causal_attn
        self.use_key_padding_mask = use_key_padding_mask
        self.n_heads = n_heads

    @staticmethod
    def _convert_mask_to_float(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(mask, dtype=query.dtype).masked_fill_(mask, float("-inf"))

    def _merge_masks(self, attn_mask, key_padding_mask, query):
        batch_size, seq_len, _ = query.shape
        key_padding_mask_expanded = self._convert_mask_to_float(key_padding_mask, query).view(batch_size, 1, seq_len)
        attn_mask_expanded = (
            self._convert_mask_to_float(attn_mask, query).view(1, seq_len, seq_len).expand(batch_size, -1, -1)
        )
        merged_mask = attn_mask_expanded + key_padding_mask_expanded
        res = (
            merged_mask.view(batch_size, 1, seq_len, seq_len)
            .expand(-1, self.n_heads, -1, -1)
            .reshape(-1, seq_len, seq_len)
        )
        torch.diagonal(res, dim1=1, dim2=2).zero_()
        return res

    def encode_sessions(self, sessions: torch.Tensor, item_embs: torch.Tensor) -> torch.Tensor:
        session_max_len = sessions.shape[1]
        attn_mask = None
        key_padding_mask = None
        if not FIXED:
            if self.use_causal_attn:
                attn_mask = ~torch.tril(
                    torch.ones((session_max_len, session_max_len), dtype=torch.bool, device=sessions.device)
                )
            timeline_mask = sessions != 0
            attn_mask = ~timeline_mask.unsqueeze(1).repeat(self.n_heads, timeline_mask.squeeze(-1).shape[1], 1)
            timeline_mask = timeline_mask.unsqueeze(-1)
            seqs = item_embs[sessions]  # [batch_size, session_max_len, n_factors]
            seqs = self.pos_encoding_layer(seqs)
            seqs = self.emb_dropout(seqs)
        else:
            timeline_mask = (sessions != 0).unsqueeze(-1)  # [batch_size, session_max_len, 1]
            seqs = item_embs[sessions]
            seqs = self.pos_encoding_layer(seqs)
            seqs = self.emb_dropout(seqs)
            if self.use_causal_attn:
                attn_mask = ~torch.tril(
                    torch.ones((session_max_len, session_max_len), dtype=torch.bool, device=sessions.device)
                )
            if self.use_key_padding_mask:
                key_padding_mask = sessions == 0
                if attn_mask is not None:
                    attn_mask = self._merge_masks(attn_mask, key_padding_mask, seqs)
                    key_padding_mask = None
        seqs = self.transformer_layers(seqs, timeline_mask, attn_mask, key_padding_mask)
        return seqs

    def forward(self, sessions: torch.Tensor) -> tp.Tuple[torch.Tensor, torch.Tensor]:
        item_embs = self.item_emb.weight
        session_embs = self.encode_sessions(sessions, item_embs)
        return item_embs, session_embs


def collate_fn_train(batch, session_max_len):
    """Right truncation, left padding to session_max_len (shifted sequence: x -> y)."""
    x = torch.zeros((len(batch), session_max_len), dtype=torch.long)
    y = torch.zeros((len(batch), session_max_len), dtype=torch.long)
    for i, ses in enumerate(batch):
        x[i, -len(ses) + 1:] = torch.tensor(ses[:-1])
        y[i, -len(ses) + 1:] = torch.tensor(ses[1:])
    return x, y


def main():
    torch.manual_seed(0)
    session_max_len, n_items = 6, 20
    model = TransformerTorchBackbone(n_items, n_factors=16, n_heads=2, n_blocks=2,
                                     session_max_len=session_max_len, dropout_rate=0.0)
    model.eval()
    sessions = [[3, 7, 1, 9, 4, 12, 5], [8, 2, 11]]
    x, y = collate_fn_train(sessions, session_max_len)
    with torch.no_grad():
        item_embs, session_embs = model(x)
        logits = session_embs @ item_embs.T  # [batch, len, n_items]
        valid = y != 0
        loss = nn.functional.cross_entropy(logits[valid], y[valid])
        last = logits[:, -1, :]
        top = last.topk(3, dim=-1).indices
    print("train loss:", round(loss.item(), 6))
    print("next-item top-3 per user:", top.tolist())
    print("user 0 step-1 logits:", [round(v, 4) for v in logits[0, 1, :5].tolist()])


if __name__ == "__main__":
    main()
