# Follows facebookresearch/fairseq: utils.make_positions (pad-skipping positions for left-padded sources), MultiheadAttention
# incremental state with reorder_incremental_state (cached k/v .index_select(0, new_order)), TransformerEncoder.reorder_encoder_out
# (encoder_padding_mask, True = pad, index_select'ed per beam) and SequenceGenerator's new_order/beam bookkeeping.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, H, V, PAD, EOS, BEAM = 32, 4, 12, 1, 2, 3


def make_positions(tensor, padding_idx):
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D, padding_idx=PAD), nn.Embedding(40, D, padding_idx=PAD)
        self.enc_attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.self_attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.out = nn.Linear(D, V)

    def encode(self, src):
        x = self.emb(src) + self.pos(make_positions(src, PAD))
        pad = src.eq(PAD)
        x = x + self.enc_attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        return {"encoder_out": x, "encoder_padding_mask": pad}

    def reorder_encoder_out(self, enc, new_order):
        return {k: v.index_select(0, new_order) for k, v in enc.items()}

    def decode_step(self, prev_tokens, enc, state):
        # incremental: only the last token is fed; its self-attn keys/values are appended to the cache
        step = prev_tokens.shape[1]
        x = self.emb(prev_tokens[:, -1:]) + self.pos(torch.full((prev_tokens.shape[0], 1), step + PAD))
        W, b = self.self_attn.in_proj_weight, self.self_attn.in_proj_bias
        k_new, v_new = F.linear(x, W[D:2 * D], b[D:2 * D]), F.linear(x, W[2 * D:], b[2 * D:])
        state["prev_key"] = k_new if "prev_key" not in state else torch.cat([state["prev_key"], k_new], 1)
        state["prev_value"] = v_new if "prev_value" not in state else torch.cat([state["prev_value"], v_new], 1)
        q = F.linear(x, W[:D], b[:D])
        a = F.scaled_dot_product_attention(*(t.view(t.shape[0], -1, H, D // H).transpose(1, 2)
                                             for t in (q, state["prev_key"], state["prev_value"])))
        x = x + self.self_attn.out_proj(a.transpose(1, 2).reshape(x.shape))
        x = x + self.cross_attn(x, enc["encoder_out"], enc["encoder_out"],
                                key_padding_mask=enc["encoder_padding_mask"], need_weights=False)[0]
        return self.out(x[:, -1]).log_softmax(-1)

    def decode_full(self, prev_tokens, enc):  # no cache: whole prefix with a causal mask
        T = prev_tokens.shape[1]
        x = self.emb(prev_tokens) + self.pos(torch.arange(1, T + 1)[None] + PAD)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = not allowed
        x = x + self.self_attn(x, x, x, attn_mask=causal, need_weights=False)[0]
        x = x + self.cross_attn(x, enc["encoder_out"], enc["encoder_out"],
                                key_padding_mask=enc["encoder_padding_mask"], need_weights=False)[0]
        return self.out(x[:, -1]).log_softmax(-1)

    def reorder_incremental_state(self, state, new_order):
        for k in state:
            state[k] = state[k].index_select(0, new_order)


model = Model().eval()
src_lens = [6, 3]
S = max(src_lens)
src = torch.full((2, S), PAD)
for b, L in enumerate(src_lens):
    src[b, S - L:] = torch.randint(3, V, (L,))  # left_pad_source=True
bsz = 2
with torch.no_grad():
    enc = model.encode(src)
    new_order = torch.arange(bsz).view(-1, 1).repeat(1, BEAM).view(-1)
    enc = model.reorder_encoder_out(enc, new_order)
    tokens = torch.full((bsz * BEAM, 1), EOS)
    scores = torch.zeros(bsz * BEAM)
    state, diff = {}, 0.0
    for step in range(5):
        lprobs = model.decode_step(tokens, enc, state)
        # reference: each hypothesis recomputed from scratch, with its source unpadded
        for r in range(bsz * BEAM):
            b = r // BEAM
            src_b = src[b:b + 1, S - src_lens[b]:]
            ref = model.decode_full(tokens[r:r + 1], model.encode(src_b))
            diff = max(diff, (lprobs[r] - ref[0]).abs().max().item())
        cand = (scores[:, None] + lprobs).view(bsz, -1)
        if step == 0:  # all beams identical at the first step: take from beam 0 only
            cand = lprobs.view(bsz, BEAM, V)[:, 0]
        top, idx = cand.topk(BEAM, dim=-1)
        beam_idx = idx // V if step > 0 else torch.zeros_like(idx)
        tok = idx % V
        reorder = (beam_idx + torch.arange(bsz)[:, None] * BEAM).view(-1)
        model.reorder_incremental_state(state, reorder)
        tokens = torch.cat([tokens.index_select(0, reorder), tok.view(-1, 1)], 1)
        scores = top.view(-1)
print("hyps", tokens.tolist())
print("max |cached+reordered beam step - uncached recompute| =", diff)
assert diff < 1e-10
