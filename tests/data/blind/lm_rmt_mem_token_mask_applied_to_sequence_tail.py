# booydar/LM-RMT commit d9718a1 ("fix corner cases in attn mask"): MemTransformerLM (Recurrent Memory
# Transformer on Transformer-XL) always set the write-memory rows of dec_attn_mask, even with
# mem_at_end=False, so the last num_mem_tokens *sequence* tokens attended to each other (future
# included) and were cut off from the XL cache.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class PositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super().__init__()
        self.register_buffer('inv_freq', 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb)))

    def forward(self, pos_seq):
        sinusoid_inp = torch.ger(pos_seq, self.inv_freq)
        return torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)[:, None, :]


class MultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.q_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.kv_net = nn.Linear(d_model, 2 * n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.scale = 1 / (d_head ** 0.5)

    def forward(self, h, attn_mask=None, mems=None):
        c = torch.cat([mems, h], 0) if mems is not None else h
        head_q = self.q_net(h)
        head_k, head_v = torch.chunk(self.kv_net(c), 2, -1)
        head_q = head_q.view(h.size(0), h.size(1), self.n_head, self.d_head)
        head_k = head_k.view(c.size(0), c.size(1), self.n_head, self.d_head)
        head_v = head_v.view(c.size(0), c.size(1), self.n_head, self.d_head)
        # [qlen x klen x bsz x n_head]
        attn_score = torch.einsum('ibnd,jbnd->ijbn', (head_q, head_k))
        attn_score.mul_(self.scale)
        if attn_mask is not None and attn_mask.any().item():
            attn_score.masked_fill_(attn_mask[:, :, :, None].bool(), -float('inf'))
        attn_prob = F.softmax(attn_score, dim=1)
        attn_vec = torch.einsum('ijbn,jbnd->ibnd', (attn_prob, head_v))
        attn_vec = attn_vec.contiguous().view(attn_vec.size(0), attn_vec.size(1), self.n_head * self.d_head)
        return self.layer_norm(h + self.o_net(attn_vec))


class DecoderLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner):
        super().__init__()
        self.dec_attn = MultiHeadAttn(n_head, d_model, d_head)
        self.CoreNet = nn.Sequential(nn.Linear(d_model, d_inner), nn.ReLU(), nn.Linear(d_inner, d_model))
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, dec_inp, dec_attn_mask=None, mems=None):
        output = self.dec_attn(dec_inp, attn_mask=dec_attn_mask, mems=mems)
        return self.layer_norm(output + self.CoreNet(output))


class MemTransformerLM(nn.Module):
    def __init__(self, n_token=64, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, mem_len=8,
                 num_mem_tokens=2, read_mem_from_cache=False, mem_at_end=False):
        super().__init__()
        self.word_emb = nn.Embedding(n_token, d_model)
        self.d_model, self.mem_len, self.n_layer = d_model, mem_len, n_layer
        self.num_mem_tokens = num_mem_tokens
        self.read_mem_from_cache = read_mem_from_cache
        self.mem_at_end = mem_at_end
        self.mem_tokens = nn.Parameter(torch.randn(num_mem_tokens, d_model))
        self.layers = nn.ModuleList([DecoderLayer(n_head, d_model, d_head, d_inner) for _ in range(n_layer)])
        self.pos_emb = PositionalEmbedding(d_model)
        self.out = nn.Linear(d_model, n_token)

    def _update_mems(self, hids, mems, mlen, qlen):
        end_idx = mlen + qlen
        beg_idx = max(0, end_idx - self.mem_len)
        return [torch.cat([m, h], dim=0)[beg_idx:end_idx].detach() for m, h in zip(mems, hids)]

    def _forward(self, dec_inp, mems=None):
        word_emb = self.word_emb(dec_inp)
        mlen = mems[0].size(0) if mems is not None else 0
        mem_tokens = self.mem_tokens.reshape(self.num_mem_tokens, 1, -1).repeat(1, dec_inp.shape[1], 1)
        word_emb = torch.cat((mem_tokens, word_emb), dim=0)
        if self.mem_at_end:
            word_emb = torch.cat((word_emb, mem_tokens), dim=0)

        qlen = word_emb.shape[0]
        klen = mlen + qlen
        dec_attn_mask = torch.triu(word_emb.new_ones(qlen, klen), diagonal=1 + mlen).byte()
        if FIXED:
            if self.num_mem_tokens != 0:
                dec_attn_mask[:self.num_mem_tokens, mlen:mlen + self.num_mem_tokens] = 0
                dec_attn_mask[:self.num_mem_tokens, :mlen] = 1 - int(self.read_mem_from_cache)
                if self.mem_at_end:
                    dec_attn_mask[-self.num_mem_tokens:, -self.num_mem_tokens:] = 0
                    dec_attn_mask[-self.num_mem_tokens:, :mlen] = 1 - int(self.read_mem_from_cache)
        else:
            dec_attn_mask[-self.num_mem_tokens:, -self.num_mem_tokens:] = 0
            dec_attn_mask[:self.num_mem_tokens, mlen:mlen + self.num_mem_tokens] = 0
            dec_attn_mask[:self.num_mem_tokens, :mlen] = 1 - int(self.read_mem_from_cache)
            dec_attn_mask[-self.num_mem_tokens:, :mlen] = 1 - int(self.read_mem_from_cache)
        dec_attn_mask = dec_attn_mask[:, :, None]

        # attn_type == 2: absolute positions
        pos_seq = torch.arange(klen - 1, -1, -1.0)
        pos_emb = self.pos_emb(pos_seq)
        core_out = word_emb + pos_emb[-qlen:]
        hids = [core_out]
        for i, layer in enumerate(self.layers):
            mems_i = None if mems is None else mems[i]
            if mems_i is not None and i == 0:
                mems_i = mems_i + pos_emb[:mlen]
            core_out = layer(core_out, dec_attn_mask=dec_attn_mask, mems=mems_i)
            hids.append(core_out)
        new_mems = self._update_mems(hids, mems, mlen, qlen) if mems is not None else None
        return core_out, new_mems

    def forward(self, data, *mems):
        if not mems:
            mems = [torch.empty(0, data.size(1), self.d_model) for _ in range(self.n_layer + 1)]
        hidden, new_mems = self._forward(data, mems=mems)
        pred_hid = hidden[-data.size(0):]
        return self.out(pred_hid), new_mems


torch.manual_seed(0)
model = MemTransformerLM().eval()
tgt_len, bsz = 6, 2
data = torch.randint(0, 64, (3 * tgt_len, bsz))  # [len x bsz], as in Transformer-XL


def run(data):
    mems, logits = [], []
    for seg in data.split(tgt_len, dim=0):
        out, mems = model(seg, *mems)
        logits.append(out)
    return torch.cat(logits, 0)


with torch.no_grad():
    a = run(data)
    data2 = data.clone()
    data2[-1] = (data2[-1] + 1) % 64  # change only the very last token
    b = run(data2)
# the logits at the second-to-last position must not depend on the last token
print(f"{'fixed' if FIXED else 'buggy'}: change of logits at position -2 when only the last token changes = "
      f"{(a[-2] - b[-2]).abs().max().item():.3e}")
