"""Transformer-XL (kimiyoung/transformer-xl) evaluated segment by segment with recurrent memory.

Follows pytorch/mem_transformer.py (MemTransformerLM._forward: `dec_attn_mask = torch.triu(
word_emb.new_ones(qlen, klen), diagonal=1+mlen).byte()[:,:,None]`, _update_mems keeping the last
mem_len hidden states; RelPartialLearnableMultiHeadAttn: AC + BD with _rel_shift, then
`attn_score.masked_fill(attn_mask[:,:,:,None], -float('inf'))`). Each segment's qlen queries attend
to all mlen cached states of the previous segments (klen = mlen + qlen, more keys than queries) and
causally inside the segment: query i sees keys j <= i + mlen. The first segment has no memory yet.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class PositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super().__init__()
        inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, pos_seq):
        sinusoid_inp = torch.ger(pos_seq, self.inv_freq)
        return torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)[:, None, :]


class RelPartialLearnableMultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head):
        super().__init__()
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.scale = 1 / (d_head ** 0.5)

    def _rel_shift(self, x):
        zero_pad = torch.zeros((x.size(0), 1, *x.size()[2:]), dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=1)
        x_padded = x_padded.view(x.size(1) + 1, x.size(0), *x.size()[2:])
        return x_padded[1:].view_as(x)

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask=None, mems=None):
        qlen, rlen, bsz = w.size(0), r.size(0), w.size(1)
        cat = torch.cat([mems, w], 0) if mems is not None else w
        w_heads = self.qkv_net(cat)
        r_head_k = self.r_net(r)
        w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
        w_head_q = w_head_q[-qlen:]
        klen = w_head_k.size(0)
        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(klen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(klen, bsz, self.n_head, self.d_head)
        r_head_k = r_head_k.view(rlen, self.n_head, self.d_head)
        AC = torch.einsum("ibnd,jbnd->ijbn", (w_head_q + r_w_bias, w_head_k))
        BD = self._rel_shift(torch.einsum("ibnd,jnd->ijbn", (w_head_q + r_r_bias, r_head_k)))
        attn_score = (AC + BD) * self.scale
        if attn_mask is not None and attn_mask.any().item():
            attn_score = attn_score.float().masked_fill(attn_mask[:, :, :, None], -float("inf")).type_as(attn_score)
        attn_prob = F.softmax(attn_score, dim=1)
        attn_vec = torch.einsum("ijbn,jbnd->ibnd", (attn_prob, w_head_v))
        attn_vec = attn_vec.contiguous().view(qlen, bsz, self.n_head * self.d_head)
        return self.layer_norm(w + self.o_net(attn_vec))


class MemTransformerLM(nn.Module):
    def __init__(self, n_token, n_layer, n_head, d_model, d_head, tgt_len, mem_len):
        super().__init__()
        self.n_layer, self.d_model, self.tgt_len, self.mem_len = n_layer, d_model, tgt_len, mem_len
        self.word_emb = nn.Embedding(n_token, d_model)
        self.pos_emb = PositionalEmbedding(d_model)
        self.r_w_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.02)
        self.r_r_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.02)
        self.layers = nn.ModuleList([RelPartialLearnableMultiHeadAttn(n_head, d_model, d_head) for _ in range(n_layer)])
        self.out = nn.Linear(d_model, n_token)

    def init_mems(self):
        return [torch.empty(0) for _ in range(self.n_layer + 1)]

    def _update_mems(self, hids, mems, qlen, mlen):
        with torch.no_grad():
            new_mems = []
            end_idx = mlen + max(0, qlen)
            beg_idx = max(0, end_idx - self.mem_len)
            for i in range(len(hids)):
                cat = torch.cat([mems[i], hids[i]], dim=0) if mems[i].numel() else hids[i]
                new_mems.append(cat[beg_idx:end_idx].detach())
        return new_mems

    def _forward(self, dec_inp, mems):
        qlen, bsz = dec_inp.size()
        word_emb = self.word_emb(dec_inp)
        mlen = mems[0].size(0) if mems[0].numel() else 0
        klen = mlen + qlen
        dec_attn_mask = torch.triu(word_emb.new_ones(qlen, klen), diagonal=1 + mlen).bool()[:, :, None]
        hids = []
        pos_seq = torch.arange(klen - 1, -1, -1.0)
        pos_emb = self.pos_emb(pos_seq)
        core_out = word_emb
        hids.append(core_out)
        for i, layer in enumerate(self.layers):
            mems_i = mems[i] if mems[i].numel() else None
            core_out = layer(core_out, pos_emb, self.r_w_bias, self.r_r_bias, attn_mask=dec_attn_mask, mems=mems_i)
            hids.append(core_out)
        return core_out, self._update_mems(hids, mems, qlen, mlen)

    def forward(self, data, *mems):
        if not mems:
            mems = self.init_mems()
        hidden, new_mems = self._forward(data, mems=mems)
        return [self.out(hidden)] + new_mems


def main():
    torch.manual_seed(0)
    tgt_len, mem_len, bsz = 6, 12, 2
    model = MemTransformerLM(n_token=40, n_layer=2, n_head=4, d_model=32, d_head=8, tgt_len=tgt_len, mem_len=mem_len).eval()
    data = torch.randint(0, 40, (4 * tgt_len + 1, bsz))  # LMOrderedIterator: time-major (len, bsz)
    mems = tuple()
    total_nll, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, tgt_len):
            inp, target = data[i:i + tgt_len], data[i + 1:i + 1 + tgt_len]
            ret = model(inp, *mems)
            logits, mems = ret[0], ret[1:]
            total_nll += F.cross_entropy(logits.view(-1, 40), target.reshape(-1), reduction="sum").item()
            n += target.numel()
    print(f"eval ppl {torch.exp(torch.tensor(total_nll / n)).item():.2f}")


if __name__ == "__main__":
    main()
