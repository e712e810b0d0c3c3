# torch-rechub (datawhalechina/torch-rechub#244, commits 97ff7b2 + afcef7f): HSTULayer masked only the
# causal upper triangle before silu(scores), never the PAD keys; with the left-padded HSTU data every real
# item attends to the PAD positions on its left, so predictions depend on the PAD embedding.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class HSTULayer(nn.Module):
    def __init__(self, d_model=512, n_heads=8, dqk=64, dv=64, dropout=0.1, use_rel_pos_bias=True):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.dqk = dqk
        self.dv = dv
        self.dropout_rate = dropout
        self.use_rel_pos_bias = use_rel_pos_bias
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        proj1_out_dim = 2 * n_heads * dqk + 2 * n_heads * dv
        self.proj1 = nn.Linear(d_model, proj1_out_dim)
        self.proj2 = nn.Linear(n_heads * dv, d_model)
        ffn_hidden_dim = 4 * d_model
        self.ffn = nn.Sequential(nn.Linear(d_model, ffn_hidden_dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn_hidden_dim, d_model), nn.Dropout(dropout))
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, rel_pos_bias=None, padding_mask=None):
        batch_size, seq_len, _ = x.shape
        residual = x
        x = self.norm1(x)
        proj_out = self.proj1(x)
        q = proj_out[..., :self.n_heads * self.dqk].reshape(batch_size, seq_len, self.n_heads, self.dqk)
        k = proj_out[..., self.n_heads * self.dqk:2 * self.n_heads * self.dqk].reshape(batch_size, seq_len, self.n_heads, self.dqk)
        u = proj_out[..., 2 * self.n_heads * self.dqk:2 * self.n_heads * self.dqk + self.n_heads * self.dv].reshape(batch_size, seq_len, self.n_heads, self.dv)
        v = proj_out[..., 2 * self.n_heads * self.dqk + self.n_heads * self.dv:].reshape(batch_size, seq_len, self.n_heads, self.dv)
        # Apply L2 normalization to Q and K (HSTU specific)
        q = F.normalize(q, p=2, dim=-1)
        k = F.normalize(k, p=2, dim=-1)
        q = q.transpose(1, 2)  # (B, H, L, dqk)
        k = k.transpose(1, 2)  # (B, H, L, dqk)
        u = u.transpose(1, 2)  # (B, H, L, dv)
        v = v.transpose(1, 2)  # (B, H, L, dv)
        scores = torch.matmul(q, k.transpose(-2, -1))
        if rel_pos_bias is not None:
            scores = scores + rel_pos_bias
        # Add causal mask (prevent attending to future positions)
        causal_mask = torch.tril(torch.ones(seq_len, seq_len, device=x.device, dtype=torch.bool))
        if FIXED:
            valid_mask = causal_mask.unsqueeze(0).unsqueeze(0)  # (1, 1, L, L)
            if padding_mask is not None:
                # Mask out padded KEY positions
                key_mask = padding_mask.unsqueeze(1).unsqueeze(1)  # (B, 1, 1, L)
                valid_mask = valid_mask & key_mask
            scores = scores.masked_fill(~valid_mask, -1e4)
        else:
            # Use a large negative number for masking compatible with SiLU
            scores = scores.masked_fill(~causal_mask.unsqueeze(0).unsqueeze(0), -1e4)
        # SiLU activation over attention scores (HSTU specific)
        attn_weights = F.silu(scores)
        attn_weights = self.dropout(attn_weights)
        attn_output = torch.matmul(attn_weights, v)
        attn_output = attn_output.transpose(1, 2)  # (B, L, H, dv)
        u = u.transpose(1, 2)  # (B, L, H, dv)
        gated_output = attn_output * torch.sigmoid(u)
        gated_output = gated_output.reshape(batch_size, seq_len, self.n_heads * self.dv)
        output = self.proj2(gated_output)
        output = self.dropout(output)
        output = output + residual
        residual = output
        output = self.norm2(output)
        output = self.ffn(output)
        output = output + residual
        return output


class HSTUBlock(nn.Module):
    def __init__(self, d_model=512, n_heads=8, n_layers=4, dqk=64, dv=64, dropout=0.1, use_rel_pos_bias=True):
        super().__init__()
        self.layers = nn.ModuleList([HSTULayer(d_model=d_model, n_heads=n_heads, dqk=dqk, dv=dv, dropout=dropout, use_rel_pos_bias=use_rel_pos_bias) for _ in range(n_layers)])

    def forward(self, x, rel_pos_bias=None, padding_mask=None):
        for layer in self.layers:
            if FIXED:
                x = layer(x, rel_pos_bias=rel_pos_bias, padding_mask=padding_mask)
            else:
                x = layer(x, rel_pos_bias=rel_pos_bias)
        return x


class HSTUModel(nn.Module):
    # trimmed: use_rel_pos_bias=False (a constructor option), no dropout
    def __init__(self, vocab_size, d_model=512, n_heads=8, n_layers=4, dqk=64, dv=64, max_seq_len=256, dropout=0.1, use_rel_pos_bias=False, use_time_embedding=True, num_time_buckets=2048, time_bucket_fn='sqrt'):
        super().__init__()
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.use_time_embedding = use_time_embedding
        self.num_time_buckets = num_time_buckets
        self.time_bucket_fn = time_bucket_fn
        self.alpha = math.sqrt(d_model)
        self.token_embedding = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        if use_time_embedding:
            self.time_embedding = nn.Embedding(num_time_buckets + 1, d_model, padding_idx=0)
        self.hstu_block = HSTUBlock(d_model=d_model, n_heads=n_heads, n_layers=n_layers, dqk=dqk, dv=dv, dropout=dropout, use_rel_pos_bias=use_rel_pos_bias)
        self.output_projection = nn.Linear(d_model, vocab_size)
        self.dropout = nn.Dropout(dropout)
        self._init_weights()

    def _init_weights(self):
        for name, param in self.named_parameters():
            if 'weight' in name and len(param.shape) > 1:
                nn.init.xavier_uniform_(param)
            elif 'bias' in name:
                nn.init.constant_(param, 0)

    def _time_diff_to_bucket(self, time_diffs):
        time_bucket_increments = 60.0
        time_diffs = time_diffs.float() / time_bucket_increments
        time_diffs = torch.clamp(time_diffs, min=1e-6)
        if self.time_bucket_fn == 'sqrt':
            buckets = torch.sqrt(time_diffs).long()
        else:
            buckets = torch.log(time_diffs).long()
        buckets = torch.clamp(buckets, min=0, max=self.num_time_buckets - 1)
        return buckets

    def forward(self, x, time_diffs=None):
        batch_size, seq_len = x.shape
        if FIXED:
            padding_mask = x.ne(0)  # (B, L) — True for valid tokens
        token_emb = self.token_embedding(x) * self.alpha  # (B, L, D)
        positions = torch.arange(seq_len, dtype=torch.long, device=x.device)
        pos_emb = self.position_embedding(positions)  # (L, D)
        embeddings = token_emb + pos_emb.unsqueeze(0)  # (B, L, D)
        if self.use_time_embedding:
            if time_diffs is None:
                time_diffs = torch.zeros(batch_size, seq_len, dtype=torch.long, device=x.device)
            time_buckets = self._time_diff_to_bucket(time_diffs)  # (B, L)
            embeddings = embeddings + self.time_embedding(time_buckets)
        embeddings = self.dropout(embeddings)
        if FIXED:
            hstu_output = self.hstu_block(embeddings, rel_pos_bias=None, padding_mask=padding_mask)
        else:
            hstu_output = self.hstu_block(embeddings, rel_pos_bias=None)  # (B, L, D)
        logits = self.output_projection(hstu_output)  # (B, L, V)
        return logits


model = HSTUModel(vocab_size=50, d_model=32, n_heads=2, n_layers=2, dqk=16, dv=16, max_seq_len=8, dropout=0.0)
model.eval()

# preprocess_ml_hstu.py: seq_tokens = [0] * pad_len + seq_tokens; time diff is 0 at padding positions
seq_tokens = torch.tensor([[0, 0, 0, 0, 7, 12, 3, 9],
                           [0, 0, 21, 5, 8, 30, 2, 44],
                           [4, 18, 6, 25, 11, 40, 33, 15]])
seq_time_diffs = torch.tensor([[0, 0, 0, 0, 86400, 7200, 3600, 60],
                               [0, 0, 90000, 50000, 40000, 3000, 600, 120],
                               [99000, 80000, 70000, 60000, 5000, 900, 300, 30]])
real = seq_tokens.ne(0)

with torch.no_grad():
    logits = model(seq_tokens, seq_time_diffs)
    # the PAD row of token_embedding is a parameter like any other (xavier re-initialises it here);
    # move it and see whether predictions at real positions move
    model.token_embedding.weight[0].add_(torch.randn(32))
    logits2 = model(seq_tokens, seq_time_diffs)

diff = (logits2 - logits).abs().amax(-1)  # (B, L)
print("max |change| of next-item logits at real positions when only the PAD embedding changes:",
      round(float(diff[real].max()), 6))
print("per user:", [round(float(diff[b][real[b]].max()), 6) for b in range(3)])
