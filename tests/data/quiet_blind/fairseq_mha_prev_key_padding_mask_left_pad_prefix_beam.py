# Follows fairseq fairseq/modules/multihead_attention.py: MultiheadAttention.forward with incremental_state,
# _append_prev_key_padding_mask and reorder_incremental_state (index_select by new_order), plus static_kv encoder
# attention with encoder_padding_mask (True = pad). Decoder self-attn prefix is left-padded (prefix_tokens).
import torch
torch.manual_seed(0); dt = torch.float64; D = 16; nh = 2; hd = D // nh
Wq, Wk, Wv, Wo, Xq, Xk, Xv, Xo = [torch.randn(D, D, dtype=dt) / 4 for _ in range(8)]

def mha(q, k, v, Wq, Wk, Wv, Wo, kpm=None, causal_mask=None):
    B, T, _ = q.shape; S = k.shape[1]
    Q = (q @ Wq).view(B, T, nh, hd).transpose(1, 2) * hd ** -0.5
    K = (k @ Wk).view(B, S, nh, hd).transpose(1, 2); V = (v @ Wv).view(B, S, nh, hd).transpose(1, 2)
    a = Q @ K.transpose(-1, -2)
    if causal_mask is not None: a = a + causal_mask
    if kpm is not None: a = a.masked_fill(kpm[:, None, None, :], float("-inf"))
    return (a.softmax(-1) @ V).transpose(1, 2).reshape(B, T, D) @ Wo

class IncMHA:
    """self-attn with fairseq-style saved prev_key/prev_value/prev_key_padding_mask"""
    def __init__(self): self.st = None
    def step(self, x, kpm_step):  # x: (B,1,D); kpm_step: (B,1) True = pad
        k, v = x @ Wk, x @ Wv
        if self.st is None:
            pk, pv, pm = k, v, kpm_step
        else:
            pk = torch.cat([self.st["prev_key"], k], 1); pv = torch.cat([self.st["prev_value"], v], 1)
            pm = torch.cat([self.st["prev_key_padding_mask"].float(), kpm_step.float()], 1).bool()  # _append_prev_key_padding_mask
        self.st = dict(prev_key=pk, prev_value=pv, prev_key_padding_mask=pm)
        B, S, _ = pk.shape
        Q = (x @ Wq).view(B, 1, nh, hd).transpose(1, 2) * hd ** -0.5
        K = pk.view(B, S, nh, hd).transpose(1, 2); V = pv.view(B, S, nh, hd).transpose(1, 2)
        a = (Q @ K.transpose(-1, -2)).masked_fill(pm[:, None, None, :], float("-inf"))
        return (a.softmax(-1) @ V).transpose(1, 2).reshape(B, 1, D) @ Wo
    def reorder(self, new_order):  # reorder_incremental_state
        self.st = {n: t.index_select(0, new_order) for n, t in self.st.items()}

bsz, beam, S, T = 2, 3, 7, 6
src_len = [7, 4]; pre_len = [3, 1]     # source right-padded; forced prefix left-padded to length 3
enc = torch.randn(bsz, S, D, dtype=dt); enc_pad = torch.arange(S)[None] >= torch.tensor(src_len)[:, None]
tgt = torch.randn(bsz * beam, T, D, dtype=dt)
P = max(pre_len)
tpad = torch.zeros(bsz * beam, T, dtype=torch.bool)
for b in range(bsz):
    tpad[b * beam:(b + 1) * beam, : P - pre_len[b]] = True       # left pad of prefix
tgt = tgt.masked_fill(tpad[..., None], 0.0)
# encoder_out expanded for beams like SequenceGenerator (new_order = arange(bsz).repeat_interleave(beam))
order0 = torch.arange(bsz).repeat_interleave(beam)
enc_b, enc_pad_b = enc.index_select(0, order0), enc_pad.index_select(0, order0)

sa = IncMHA(); outs = []
tgt_cur, tpad_cur = tgt.clone(), tpad.clone()
g = torch.Generator().manual_seed(1)
for t in range(T):
    x = tgt_cur[:, t:t + 1]
    h = x + sa.step(x, tpad_cur[:, t:t + 1])
    y = h + mha(h, enc_b, enc_b, Xq, Xk, Xv, Xo, kpm=enc_pad_b)   # static_kv encoder attn
    outs.append(y)
    # beam reorder: each hypothesis picks a random parent within its own sentence
    par = torch.stack([b * beam + torch.randint(0, beam, (beam,), generator=g) for b in range(bsz)]).view(-1)
    sa.reorder(par)
    tgt_cur = tgt_cur.index_select(0, par); tpad_cur = tpad_cur.index_select(0, par)
    outs = [o.index_select(0, par) for o in outs]

# reference: each final hypothesis alone, unpadded source, prefix padding removed, full causal recompute
md = 0.0
for r in range(bsz * beam):
    b = r // beam; sl, pl = src_len[b], pre_len[b]
    seq = tgt_cur[r:r + 1, P - pl:]            # drop left pad
    L = seq.shape[1]
    cm = torch.full((L, L), float("-inf"), dtype=dt).triu(1)
    h = seq + mha(seq, seq, seq, Wq, Wk, Wv, Wo, causal_mask=cm)
    y = h + mha(h, enc[b:b + 1, :sl], enc[b:b + 1, :sl], Xq, Xk, Xv, Xo)
    inc = torch.cat(outs, 1)[r:r + 1, P - pl:]
    md = max(md, (inc - y).abs().max().item())
# the left-pad query at t=0 sees no key (NaN row); its output is never read and its cached k/v stay finite
print("max diff", md); assert md < 1e-10
