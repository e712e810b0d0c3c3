"""SAINT (Choi et al. 2020) as pykt-toolkit writes it: pykt/models/saint.py SAINT.forward (exercise
encoder blocks, `start_token = torch.tensor([[2]]).repeat(...)`, `in_res = torch.cat((start_token,
in_res), dim=-1)`, decoder blocks, sigmoid head), Encoder_block.forward (nn.MultiheadAttention with
`attn_mask=ut_mask(seq_len=n)`), Decoder_block.forward (self-attention with ut_mask over the shifted
responses, then `multi_de2(query=out, key=en_out, value=en_out, attn_mask=ut_mask(seq_len=n))`),
ut_mask = torch.triu(ones, diagonal=1); positions embedded, right padding masked only in the loss.

Intent: position t predicts response r_t. The encoder sees exercises e_0..e_t (the exercise being
answered is known), the decoder input at t is r_{t-1} (start token 2 at t = 0), so its causal self-
attention sees r_0..r_{t-1} only; the cross-attention is causal WITH the diagonal: decoder t sees the
encoded exercises 0..t, including e_t, which is the question, not the answer.

Checks: predictions at steps <= t never change when r_t.. flip; they DO change when e_t changes (the
diagonal is used); each right-padded learner equals itself alone, unpadded.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
NQ, D, H, SEQ = 15, 32, 4, 16


def ut_mask(seq_len):
    return torch.triu(torch.ones(seq_len, seq_len), diagonal=1).to(dtype=torch.bool)


class FFN(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))


class Encoder_block(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.first = first
        if first:
            self.embd_ex = nn.Embedding(NQ, D)
        self.multi_en, self.ffn_en = nn.MultiheadAttention(D, H), FFN()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, in_ex, in_pos):
        out = self.embd_ex(in_ex) + in_pos if self.first else in_ex
        out = out.permute(1, 0, 2)
        n = out.shape[0]
        skip_out = out = self.layer_norm1(out)
        out, _ = self.multi_en(out, out, out, attn_mask=ut_mask(seq_len=n))
        out = (out + skip_out).permute(1, 0, 2)
        out = self.layer_norm2(out)
        return self.ffn_en(out) + out


class Decoder_block(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.first = first
        if first:
            self.embd_res = nn.Embedding(3, D)          # 0, 1 and the start token 2
        self.multi_de1, self.multi_de2 = nn.MultiheadAttention(D, H), nn.MultiheadAttention(D, H)
        self.ffn_en = FFN()
        self.layer_norm1, self.layer_norm2, self.layer_norm3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, in_res, in_pos, en_out):
        out = self.embd_res(in_res) + in_pos if self.first else in_res
        out = out.permute(1, 0, 2)
        n = out.shape[0]
        skip_out = out = self.layer_norm1(out)
        out, _ = self.multi_de1(out, out, out, attn_mask=ut_mask(seq_len=n))
        skip_out = out = out + skip_out
        en_out = self.layer_norm2(en_out.permute(1, 0, 2))
        out, _ = self.multi_de2(out, en_out, en_out, attn_mask=ut_mask(seq_len=n))
        out = (out + skip_out).permute(1, 0, 2)
        out = self.layer_norm3(out)
        return self.ffn_en(out) + out


class SAINT(nn.Module):
    def __init__(self, num_en=2, num_de=2):
        super().__init__()
        self.embd_pos = nn.Embedding(SEQ, D)
        self.encoder = nn.ModuleList([Encoder_block(i == 0) for i in range(num_en)])
        self.decoder = nn.ModuleList([Decoder_block(i == 0) for i in range(num_de)])
        self.out = nn.Linear(D, 1)

    def forward(self, in_ex, in_res):          # in_ex (B, T); in_res (B, T-1): responses before the last step
        in_pos = self.embd_pos(torch.arange(in_ex.shape[1]))[None]
        for blk in self.encoder:
            in_ex = blk(in_ex, in_pos)
        start_token = torch.tensor([[2]]).repeat(in_res.shape[0], 1)
        in_res = torch.cat((start_token, in_res), dim=-1)
        for blk in self.decoder:
            in_res = blk(in_res, in_pos, en_out=in_ex)
        return torch.sigmoid(self.out(in_res)).squeeze(-1)


model = SAINT().eval()
lens = [13, 8, 3]
L = max(lens)
ex = torch.zeros(3, L, dtype=torch.long)
res = torch.zeros(3, L, dtype=torch.long)
sm = torch.zeros(3, L, dtype=torch.bool)
for b, n in enumerate(lens):
    ex[b, :n], res[b, :n], sm[b, :n] = torch.randint(0, NQ, (n,)), torch.randint(0, 2, (n,)), True

with torch.no_grad():
    pred = model(ex, res[:, :-1])
    loss = F.binary_cross_entropy(pred[sm], res[sm].double())
    d1, moved = 0.0, float("inf")
    for t in range(L):
        r2 = res.clone()
        r2[:, t:] = 1 - r2[:, t:]
        d1 = max(d1, (model(ex, r2[:, :-1])[:, :t + 1] - pred[:, :t + 1]).abs().max().item())
        e2 = ex.clone()
        e2[:, t] = (e2[:, t] + 1) % NQ
        moved = min(moved, (model(e2, res[:, :-1])[:, t] - pred[:, t]).abs().max().item())
    d2 = max((model(ex[b:b + 1, :n], res[b:b + 1, :n - 1])[0] - pred[b, :n]).abs().max().item()
             for b, n in enumerate(lens))

print(f"predictions at steps <= t when r_t.. flip: max change = {d1:.3e}")
print(f"prediction at t when e_t changes: min over t of max change = {moved:.3e} (diagonal used)")
print(f"right-padded batch vs each learner alone: max diff = {d2:.3e}; masked loss = {loss.item():.4f}")
assert d1 < 1e-12 and d2 < 1e-12 and moved > 1e-6
