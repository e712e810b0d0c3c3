# NVIDIA-Merlin/Transformers4Rec commit 3d94628: the causal head_mask passed to GPT-2 (multiplied into the attention
# probabilities) was built with torch.tril(..., diagonal=-1), so each interaction could not attend to itself and the
# first one attended to nothing; the fix builds it with the diagonal kept (torch.tril(...)).
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    """GPT-2 attention as in transformers 3.x (`_attn` with the `bias` buffer and `head_mask`)."""

    def __init__(self, nx, n_ctx, n_head):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((n_ctx, n_ctx), dtype=torch.uint8)).view(1, 1, n_ctx, n_ctx))
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.n_head = n_head
        self.c_attn = nn.Linear(nx, 3 * nx)
        self.c_proj = nn.Linear(nx, nx)

    def _attn(self, q, k, v, head_mask=None):
        w = torch.matmul(q, k) / (float(v.size(-1)) ** 0.5)
        nd, ns = w.size(-2), w.size(-1)
        mask = self.bias[:, :, ns - nd: ns, :ns]
        w = torch.where(mask.bool(), w, self.masked_bias.to(w.dtype))
        w = nn.Softmax(dim=-1)(w)
        if head_mask is not None:  # Mask heads if we want to
            w = w * head_mask
        return torch.matmul(w, v)

    def forward(self, x, head_mask=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, -1).permute(0, 2, 1, 3)
        k = k.view(B, T, self.n_head, -1).permute(0, 2, 3, 1)
        v = v.view(B, T, self.n_head, -1).permute(0, 2, 1, 3)
        a = self._attn(q, k, v, head_mask).permute(0, 2, 1, 3).reshape(B, T, C)
        return self.c_proj(a)


class Block(nn.Module):
    def __init__(self, nx, n_ctx, n_head):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(nx), Attention(nx, n_ctx, n_head), nn.LayerNorm(nx)
        self.mlp = nn.Sequential(nn.Linear(nx, 4 * nx), nn.GELU(), nn.Linear(4 * nx, nx))

    def forward(self, x, head_mask=None):
        x = x + self.attn(self.ln_1(x), head_mask=head_mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, n_embd, n_positions, n_head, n_layer):
        super().__init__()
        self.wpe = nn.Embedding(n_positions, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_positions, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, inputs_embeds, head_mask):
        x = inputs_embeds + self.wpe(torch.arange(inputs_embeds.shape[1]))
        for i, block in enumerate(self.h):
            x = block(x, head_mask=head_mask[i])
        return self.ln_f(x)


class RecSysMetaModel(nn.Module):
    def __init__(self, n_items, max_seq_len, d_model=32, n_head=2, n_layer=2):
        super().__init__()
        self.embedding_tables = nn.Embedding(n_items, d_model, padding_idx=0)
        self.model = GPT2Model(d_model, max_seq_len, n_head, n_layer)
        self.n_layer = n_layer

    def forward(self, product_seq):
        # Causal LM: the input is the session without its last item; each position predicts the next item.
        inputs = product_seq[:, :-1]
        max_seq_len = product_seq.shape[1]
        pos_emb_inp = self.embedding_tables(inputs)
        # head_mask has shape n_layer x batch x n_heads x N x N
        if FIXED:
            head_mask = torch.tril(torch.ones((max_seq_len - 1, max_seq_len - 1), dtype=torch.uint8))
        else:
            head_mask = torch.tril(torch.ones((max_seq_len - 1, max_seq_len - 1), dtype=torch.uint8), diagonal=-1)
        head_mask = head_mask.view(1, 1, 1, max_seq_len - 1, max_seq_len - 1).repeat(self.n_layer, 1, 1, 1, 1)
        pos_emb_pred = self.model(inputs_embeds=pos_emb_inp, head_mask=head_mask)
        return pos_emb_pred @ self.embedding_tables.weight.t()  # next-item logits


model = RecSysMetaModel(n_items=50, max_seq_len=9).eval()
sessions = torch.tensor([[3, 17, 8, 22, 5, 41, 9, 13, 30], [7, 7, 12, 2, 19, 33, 25, 4, 11]])
with torch.no_grad():
    logits = model(sessions)
    # Reference: plain GPT-2 causal attention (its own `bias` buffer) with no head mask at all.
    ref_hidden = model.model(model.embedding_tables(sessions[:, :-1]), head_mask=[None] * model.n_layer)
    ref_logits = ref_hidden @ model.embedding_tables.weight.t()
print(f"fixed={FIXED}: max |next-item logits - causal GPT-2 reference| = {(logits - ref_logits).abs().max().item():.3e}")
