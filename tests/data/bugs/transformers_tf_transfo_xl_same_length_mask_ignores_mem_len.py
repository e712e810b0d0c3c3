# Citation: huggingface/transformers#15665 "Fix dec_attn_mask in TFTransfoXLMainLayer" (ydshieh, merged 2022-02).
# Upstream file: src/transformers/models/transfo_xl/modeling_tf_transfo_xl.py,
#   TFTransfoXLMainLayer.call (the `dec_attn_mask` block), applied in
#   TFRelPartialLearnableMultiHeadAttn.call (`attn_score * (1 - m) - 1e30 * m`).
# Ported from TensorFlow to torch (tf.linalg.band_part written out as `band_part`), tiny sizes,
# adaptive embedding / adaptive softmax replaced by a plain embedding and a full softmax head.
#
# Bug: with `same_length=True` (the TransfoXLConfig default) the TF layer built the Transformer-XL
# mask the way the original TF repo did: `mask_l - mask_dia` over the first `qlen` key columns,
# never looking at `self.mem_len`. Each query then also sees the memory slot on its own diagonal
# (one key more than the PyTorch TransfoXLModel, which masks `tril(all_ones, -mask_shift_len)`
# computed from `klen - self.mem_len`), so TF and PT outputs differ over the cached memories.
# Fix: build the mask as `1 - band_part(ones(qlen, klen), -1, mlen)` and, when same_length, add the
# lower band from `mask_shift_len` (derived from `klen - self.mem_len`), matching the PyTorch model.

import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def band_part(x, num_lower, num_upper):
    """tf.linalg.band_part: keep x[i, j] where (num_lower < 0 or i - j <= num_lower)
    and (num_upper < 0 or j - i <= num_upper), zero elsewhere."""
    m, n = x.shape
    i = torch.arange(m)[:, None]
    j = torch.arange(n)[None, :]
    keep = torch.ones(m, n, dtype=torch.bool)
    if num_lower >= 0:
        keep &= (i - j) <= num_lower
    if num_upper >= 0:
        keep &= (j - i) <= num_upper
    return torch.where(keep, x, torch.zeros_like(x))


class TransfoXLConfig:
    def __init__(self, **kw):
        self.vocab_size = 40
        self.d_embed = 16
        self.d_model = 16
        self.n_head = 2
        self.d_head = 8
        self.d_inner = 32
        self.n_layer = 2
        self.tgt_len = 6
        self.mem_len = 8
        self.clamp_len = 1000
        self.same_length = True  # TransfoXLConfig default
        self.untie_r = True
        self.pre_lnorm = False
        self.dropout = 0.0
        self.dropatt = 0.0
        self.layer_norm_epsilon = 1e-5
        self.init_std = 0.02
        self.__dict__.update(kw)


class TFPositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super().__init__()
        self.inv_freq = 1 / (10000 ** (torch.arange(0, demb, 2.0) / demb))

    def forward(self, pos_seq, bsz=None):
        sinusoid_inp = torch.einsum("i,j->ij", pos_seq, self.inv_freq)
        pos_emb = torch.cat([torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)], -1)
        if bsz is not None:
            return pos_emb[:, None, :].expand(-1, bsz, -1)
        return pos_emb[:, None, :]


class TFPositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout, pre_lnorm=False, layer_norm_epsilon=1e-5):
        super().__init__()
        self.layer_1 = nn.Linear(d_model, d_inner)
        self.layer_2 = nn.Linear(d_inner, d_model)
        self.drop = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.pre_lnorm = pre_lnorm

    def forward(self, inp):
        if self.pre_lnorm:
            core_out = self.drop(self.layer_2(self.drop(F.relu(self.layer_1(self.layer_norm(inp))))))
            return core_out + inp
        core_out = self.drop(self.layer_2(self.drop(F.relu(self.layer_1(inp)))))
        return self.layer_norm(inp + core_out)


class TFRelPartialLearnableMultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout, dropatt=0.0, pre_lnorm=False, layer_norm_epsilon=1e-5):
        super().__init__()
        self.n_head = n_head
        self.d_model = d_model
        self.d_head = d_head
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.scale = 1 / (d_head ** 0.5)
        self.pre_lnorm = pre_lnorm
        self.r_r_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.1)
        self.r_w_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.1)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)

    def _rel_shift(self, x):
        x_size = list(x.shape)
        x = F.pad(x, (0, 0, 0, 0, 1, 0))  # pad dim 1 on the left
        x = x.reshape(x_size[1] + 1, x_size[0], x_size[2], x_size[3])
        x = x[1:]
        return x.reshape(x_size)

    def forward(self, w, r, attn_mask, mems, head_mask=None):
        qlen, rlen, bsz = w.shape[0], r.shape[0], w.shape[1]

        if mems is not None:
            cat = torch.cat([mems.to(w.dtype), w], 0)
            w_heads = self.qkv_net(self.layer_norm(cat) if self.pre_lnorm else cat)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
            w_head_q = w_head_q[-qlen:]
        else:
            w_heads = self.qkv_net(self.layer_norm(w) if self.pre_lnorm else w)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)

        klen = w_head_k.shape[0]
        w_head_q = w_head_q.reshape(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.reshape(klen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.reshape(klen, bsz, self.n_head, self.d_head)
        r_head_k = r_head_k.reshape(rlen, self.n_head, self.d_head)

        rw_head_q = w_head_q + self.r_w_bias
        AC = torch.einsum("ibnd,jbnd->ijbn", rw_head_q, w_head_k)
        rr_head_q = w_head_q + self.r_r_bias
        BD = torch.einsum("ibnd,jnd->ijbn", rr_head_q, r_head_k)
        BD = self._rel_shift(BD)

        attn_score = (AC + BD) * self.scale

        if attn_mask is not None:
            attn_mask_t = attn_mask[:, :, None, None].to(attn_score.dtype)
            attn_score = attn_score * (1.0 - attn_mask_t) - 1e30 * attn_mask_t

        attn_prob = torch.softmax(attn_score, dim=1)
        attn_prob = self.dropatt(attn_prob)
        if head_mask is not None:
            attn_prob = attn_prob * head_mask

        attn_vec = torch.einsum("ijbn,jbnd->ibnd", attn_prob, w_head_v)
        attn_vec = attn_vec.reshape(attn_vec.shape[0], attn_vec.shape[1], self.n_head * self.d_head)
        attn_out = self.drop(self.o_net(attn_vec))
        if self.pre_lnorm:
            return [w + attn_out]
        return [self.layer_norm(w + attn_out)]


class TFRelPartialLearnableDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dec_attn = TFRelPartialLearnableMultiHeadAttn(
            config.n_head, config.d_model, config.d_head, config.dropout,
            dropatt=config.dropatt, pre_lnorm=config.pre_lnorm, layer_norm_epsilon=config.layer_norm_epsilon,
        )
        self.pos_ff = TFPositionwiseFF(config.d_model, config.d_inner, config.dropout,
                                       pre_lnorm=config.pre_lnorm, layer_norm_epsilon=config.layer_norm_epsilon)

    def forward(self, dec_inp, r, dec_attn_mask, mems, head_mask=None):
        attn_outputs = self.dec_attn(dec_inp, r, dec_attn_mask, mems, head_mask)
        return [self.pos_ff(attn_outputs[0])] + attn_outputs[1:]


class TFTransfoXLMainLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.n_token = config.vocab_size
        self.d_model = config.d_model
        self.word_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.emb_scale = config.d_model ** 0.5
        self.drop = nn.Dropout(config.dropout)
        self.n_layer = config.n_layer
        self.mem_len = config.mem_len
        self.layers = nn.ModuleList([TFRelPartialLearnableDecoderLayer(config) for _ in range(config.n_layer)])
        self.same_length = config.same_length
        self.clamp_len = config.clamp_len
        self.pos_emb = TFPositionalEmbedding(self.d_model)

    def init_mems(self, bsz):
        if self.mem_len > 0:
            return [torch.zeros(self.mem_len, bsz, self.d_model) for _ in range(self.n_layer)]
        return None

    def _update_mems(self, hids, mems, mlen, qlen):
        if mems is None:
            return None
        assert len(hids) == len(mems), "len(hids) != len(mems)"
        new_mems = []
        end_idx = mlen + max(0, qlen)
        beg_idx = max(0, end_idx - self.mem_len)
        for i in range(len(hids)):
            cat = torch.cat([mems[i].to(hids[i].dtype), hids[i]], dim=0)
            new_mems.append(cat[beg_idx:end_idx].detach())
        return new_mems

    def forward(self, input_ids, mems=None):
        # [bsz, len] -> [len, bsz]
        input_ids = input_ids.transpose(0, 1)
        qlen, bsz = input_ids.shape

        if mems is None:
            mems = self.init_mems(bsz)

        word_emb = self.word_emb(input_ids) * self.emb_scale

        mlen = mems[0].shape[0] if mems is not None else 0
        klen = mlen + qlen

        if not FIXED:
            attn_mask = torch.ones(qlen, qlen)
            mask_u = band_part(attn_mask, 0, -1)
            mask_dia = band_part(attn_mask, 0, 0)
            attn_mask_pad = torch.zeros(qlen, mlen)
            dec_attn_mask = torch.cat([attn_mask_pad, mask_u - mask_dia], 1)
            if self.same_length:
                mask_l = band_part(attn_mask, -1, 0)
                dec_attn_mask = torch.cat(
                    [dec_attn_mask[:, :qlen] + mask_l - mask_dia, dec_attn_mask[:, qlen:]], 1
                )
        else:
            dec_attn_mask = 1 - band_part(torch.ones(qlen, klen, dtype=torch.int32), -1, mlen)
            if self.same_length:
                mask_len = klen - self.mem_len
                if mask_len > 0:
                    mask_shift_len = qlen - mask_len
                else:
                    mask_shift_len = qlen
                if mask_shift_len >= 1:
                    dec_attn_mask += 1 - band_part(
                        torch.ones(qlen, klen, dtype=torch.int32), mask_shift_len - 1, -1
                    )
                else:
                    dec_attn_mask += band_part(torch.ones(qlen, klen, dtype=torch.int32), -1, -mask_shift_len)

        hids = []
        pos_seq = torch.arange(klen - 1, -1, -1.0)
        if self.clamp_len > 0:
            pos_seq = torch.clamp(pos_seq, max=self.clamp_len)
        pos_emb = self.pos_emb(pos_seq)

        core_out = self.drop(word_emb)
        pos_emb = self.drop(pos_emb)
        for i, layer in enumerate(self.layers):
            hids.append(core_out)
            mems_i = None if mems is None else mems[i]
            core_out = layer(core_out, pos_emb, dec_attn_mask, mems_i)[0]
        core_out = self.drop(core_out)

        new_mems = self._update_mems(hids, mems, mlen, qlen)
        return core_out.transpose(0, 1), new_mems


class TFTransfoXLLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = TFTransfoXLMainLayer(config)
        self.crit = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, input_ids, mems=None, labels=None):
        hidden, new_mems = self.transformer(input_ids, mems=mems)
        logits = self.crit(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return logits, loss, new_mems


def main():
    torch.manual_seed(0)
    config = TransfoXLConfig()
    model = TFTransfoXLLMHeadModel(config).eval()

    # A long token stream per batch row, read as consecutive segments of tgt_len with the
    # memories carried from segment to segment (how Transformer-XL is evaluated).
    bsz, n_seg = 2, 3
    stream = torch.randint(0, config.vocab_size, (bsz, n_seg * config.tgt_len + 1))

    mems = None
    total = 0.0
    with torch.no_grad():
        for s in range(n_seg):
            lo = s * config.tgt_len
            inp = stream[:, lo:lo + config.tgt_len]
            tgt = stream[:, lo + 1:lo + 1 + config.tgt_len]
            logits, loss, mems = model(inp, mems=mems, labels=tgt)
            total += loss.item()
            print(f"segment {s}: loss {loss.item():.6f}  logits[0,-1,:4] {[round(v, 4) for v in logits[0, -1, :4].tolist()]}")
    print(f"mean loss over segments: {total / n_seg:.6f}")
    print(f"ppl: {math.exp(total / n_seg):.4f}")


if __name__ == "__main__":
    main()
