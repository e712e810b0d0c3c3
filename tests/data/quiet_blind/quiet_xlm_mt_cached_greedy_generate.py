"""XLM (facebookresearch/XLM) encoder-decoder NMT, shrunk to tiny sizes.

Port of xlm/model/transformer.py @cccf13bdb283c786964fe19c40e85608fc57ad0d:
get_masks(), MultiHeadAttention (layer_id-keyed cache, boolean keep-mask turned
into masked_fill(-inf)), TransformerModel.fwd (time-major input, cache['slen']
offset, src_mask over the padded source for encoder attention) and
TransformerModel.generate (greedy, <EOS> as <BOS>, finished rows continue with
<PAD> and stop growing gen_len).  The MT training step follows
xlm/trainer.py mt_step (pred_mask = alen < len2 - 1).

Checks against independent references: each sentence run alone without padding,
and a cache-free full-prefix recompute loop for generation.
"""
import itertools
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

N_MAX_POSITIONS = 64


def Embedding(num_embeddings, embedding_dim, padding_idx=None):
    m = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
    nn.init.normal_(m.weight, mean=0, std=embedding_dim ** -0.5)
    if padding_idx is not None:
        nn.init.constant_(m.weight[padding_idx], 0)
    return m


def Linear(in_features, out_features, bias=True):
    return nn.Linear(in_features, out_features, bias)


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def get_masks(slen, lengths, causal):
    """Generate hidden states mask, and optionally an attention mask."""
    assert lengths.max().item() <= slen
    bs = lengths.size(0)
    alen = torch.arange(slen, dtype=torch.long, device=lengths.device)
    mask = alen < lengths[:, None]
    # attention mask is the same as mask, or triangular inferior attention (causal)
    if causal:
        attn_mask = alen[None, None, :].repeat(bs, slen, 1) <= alen[None, :, None]
    else:
        attn_mask = mask
    assert mask.size() == (bs, slen)
    assert causal is False or attn_mask.size() == (bs, slen, slen)
    return mask, attn_mask


class PredLayer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.n_words = params.n_words
        self.pad_index = params.pad_index
        self.proj = Linear(params.emb_dim, params.n_words, bias=True)

    def forward(self, x, y, get_scores=False):
        assert (y == self.pad_index).sum().item() == 0
        scores = self.proj(x).view(-1, self.n_words)
        loss = F.cross_entropy(scores, y, reduction="mean")
        return scores, loss

    def get_scores(self, x):
        assert x.dim() == 2
        return self.proj(x)


class MultiHeadAttention(nn.Module):
    NEW_ID = itertools.count()

    def __init__(self, n_heads, dim, dropout):
        super().__init__()
        self.layer_id = next(MultiHeadAttention.NEW_ID)
        self.dim = dim
        self.n_heads = n_heads
        self.dropout = dropout
        assert self.dim % self.n_heads == 0
        self.q_lin = Linear(dim, dim)
        self.k_lin = Linear(dim, dim)
        self.v_lin = Linear(dim, dim)
        self.out_lin = Linear(dim, dim)

    def forward(self, input, mask, kv=None, cache=None):
        # Input is (bs, qlen, dim); Mask is (bs, klen) (non-causal) or (bs, klen, klen)
        bs, qlen, dim = input.size()
        if kv is None:
            klen = qlen if cache is None else cache["slen"] + qlen
        else:
            klen = kv.size(1)
        n_heads = self.n_heads
        dim_per_head = dim // n_heads
        mask_reshape = (bs, 1, qlen, klen) if mask.dim() == 3 else (bs, 1, 1, klen)

        def shape(x):
            return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)

        q = shape(self.q_lin(input))
        if kv is None:
            k = shape(self.k_lin(input))
            v = shape(self.v_lin(input))
        elif cache is None or self.layer_id not in cache:
            k = v = kv
            k = shape(self.k_lin(k))
            v = shape(self.v_lin(v))

        if cache is not None:
            if self.layer_id in cache:
                if kv is None:
                    k_, v_ = cache[self.layer_id]
                    k = torch.cat([k_, k], dim=2)
                    v = torch.cat([v_, v], dim=2)
                else:
                    k, v = cache[self.layer_id]
            cache[self.layer_id] = (k, v)

        q = q / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))                      # (bs, n_heads, qlen, klen)
        mask = (mask == 0).view(mask_reshape).expand_as(scores)          # True = blocked
        scores.masked_fill_(mask, -float("inf"))
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        weights = F.dropout(weights, p=self.dropout, training=self.training)
        context = torch.matmul(weights, v)
        context = unshape(context)
        return self.out_lin(context)


class TransformerFFN(nn.Module):
    def __init__(self, in_dim, dim_hidden, out_dim, dropout, gelu_activation):
        super().__init__()
        self.dropout = dropout
        self.lin1 = Linear(in_dim, dim_hidden)
        self.lin2 = Linear(dim_hidden, out_dim)
        self.act = gelu if gelu_activation else F.relu

    def forward(self, input):
        x = self.lin2(self.act(self.lin1(input)))
        return F.dropout(x, p=self.dropout, training=self.training)


class TransformerModel(nn.Module):
    def __init__(self, params, is_encoder, with_output):
        super().__init__()
        self.is_encoder = is_encoder
        self.is_decoder = not is_encoder
        self.with_output = with_output
        self.n_langs = params.n_langs
        self.n_words = params.n_words
        self.eos_index = params.eos_index
        self.pad_index = params.pad_index
        self.use_lang_emb = True
        self.dim = params.emb_dim
        self.hidden_dim = self.dim * 4
        self.n_heads = params.n_heads
        self.n_layers = params.n_layers
        self.dropout = params.dropout
        self.attention_dropout = params.attention_dropout

        self.position_embeddings = Embedding(N_MAX_POSITIONS, self.dim)
        if params.n_langs > 1 and self.use_lang_emb:
            self.lang_embeddings = Embedding(self.n_langs, self.dim)
        self.embeddings = Embedding(self.n_words, self.dim, padding_idx=self.pad_index)
        self.layer_norm_emb = nn.LayerNorm(self.dim, eps=1e-12)

        self.attentions = nn.ModuleList()
        self.layer_norm1 = nn.ModuleList()
        self.ffns = nn.ModuleList()
        self.layer_norm2 = nn.ModuleList()
        if self.is_decoder:
            self.layer_norm15 = nn.ModuleList()
            self.encoder_attn = nn.ModuleList()
        for _ in range(self.n_layers):
            self.attentions.append(MultiHeadAttention(self.n_heads, self.dim, dropout=self.attention_dropout))
            self.layer_norm1.append(nn.LayerNorm(self.dim, eps=1e-12))
            if self.is_decoder:
                self.layer_norm15.append(nn.LayerNorm(self.dim, eps=1e-12))
                self.encoder_attn.append(MultiHeadAttention(self.n_heads, self.dim, dropout=self.attention_dropout))
            self.ffns.append(TransformerFFN(self.dim, self.hidden_dim, self.dim, dropout=self.dropout,
                                            gelu_activation=params.gelu_activation))
            self.layer_norm2.append(nn.LayerNorm(self.dim, eps=1e-12))
        if self.with_output:
            self.pred_layer = PredLayer(params)
            if params.share_inout_emb:
                self.pred_layer.proj.weight = self.embeddings.weight

    def forward(self, mode, **kwargs):
        if mode == "fwd":
            return self.fwd(**kwargs)
        elif mode == "predict":
            return self.predict(**kwargs)
        raise Exception("Unknown mode: %s" % mode)

    def fwd(self, x, lengths, causal, src_enc=None, src_len=None, positions=None, langs=None, cache=None):
        slen, bs = x.size()
        assert lengths.size(0) == bs
        assert lengths.max().item() <= slen
        x = x.transpose(0, 1)
        assert (src_enc is None) == (src_len is None)
        if src_enc is not None:
            assert self.is_decoder
            assert src_enc.size(0) == bs

        # generate masks
        mask, attn_mask = get_masks(slen, lengths, causal)
        if self.is_decoder and src_enc is not None:
            src_mask = torch.arange(src_len.max(), dtype=torch.long, device=lengths.device) < src_len[:, None]

        if positions is None:
            positions = x.new(slen).long()
            positions = torch.arange(slen, out=positions).unsqueeze(0)
        else:
            assert positions.size() == (slen, bs)
            positions = positions.transpose(0, 1)
        if langs is not None:
            assert langs.size() == (slen, bs)
            langs = langs.transpose(0, 1)

        # do not recompute cached elements
        if cache is not None:
            _slen = slen - cache["slen"]
            x = x[:, -_slen:]
            positions = positions[:, -_slen:]
            if langs is not None:
                langs = langs[:, -_slen:]
            mask = mask[:, -_slen:]
            attn_mask = attn_mask[:, -_slen:]

        tensor = self.embeddings(x)
        tensor = tensor + self.position_embeddings(positions).expand_as(tensor)
        if langs is not None and self.use_lang_emb:
            tensor = tensor + self.lang_embeddings(langs)
        tensor = self.layer_norm_emb(tensor)
        tensor = F.dropout(tensor, p=self.dropout, training=self.training)
        tensor *= mask.unsqueeze(-1).to(tensor.dtype)

        for i in range(self.n_layers):
            attn = self.attentions[i](tensor, attn_mask, cache=cache)
            attn = F.dropout(attn, p=self.dropout, training=self.training)
            tensor = tensor + attn
            tensor = self.layer_norm1[i](tensor)
            if self.is_decoder and src_enc is not None:
                attn = self.encoder_attn[i](tensor, src_mask, kv=src_enc, cache=cache)
                attn = F.dropout(attn, p=self.dropout, training=self.training)
                tensor = tensor + attn
                tensor = self.layer_norm15[i](tensor)
            tensor = tensor + self.ffns[i](tensor)
            tensor = self.layer_norm2[i](tensor)
            tensor *= mask.unsqueeze(-1).to(tensor.dtype)

        if cache is not None:
            cache["slen"] += tensor.size(1)
        return tensor.transpose(0, 1)

    def predict(self, tensor, pred_mask, y, get_scores):
        masked_tensor = tensor[pred_mask.unsqueeze(-1).expand_as(tensor)].view(-1, self.dim)
        return self.pred_layer(masked_tensor, y, get_scores)

    def generate(self, src_enc, src_len, tgt_lang_id, max_len=200):
        bs = len(src_len)
        assert src_enc.size(0) == bs
        generated = src_len.new(max_len, bs)
        generated.fill_(self.pad_index)
        generated[0].fill_(self.eos_index)            # <EOS> is used as <BOS>
        positions = src_len.new(max_len).long()
        positions = torch.arange(max_len, out=positions).unsqueeze(1).expand(max_len, bs)
        langs = src_len.new(max_len).long().fill_(tgt_lang_id)
        langs = langs.unsqueeze(1).expand(max_len, bs)
        cur_len = 1
        gen_len = src_len.clone().fill_(1)
        unfinished_sents = src_len.clone().fill_(1)
        cache = {"slen": 0}
        while cur_len < max_len:
            tensor = self.forward("fwd", x=generated[:cur_len], lengths=gen_len, positions=positions[:cur_len],
                                  langs=langs[:cur_len], causal=True, src_enc=src_enc, src_len=src_len, cache=cache)
            assert tensor.size() == (1, bs, self.dim)
            tensor = tensor.data[-1, :, :].type_as(src_enc)
            scores = self.pred_layer.get_scores(tensor)
            next_words = torch.topk(scores, 1)[1].squeeze(1)
            generated[cur_len] = next_words * unfinished_sents + self.pad_index * (1 - unfinished_sents)
            gen_len.add_(unfinished_sents)
            unfinished_sents.mul_(next_words.ne(self.eos_index).long())
            cur_len = cur_len + 1
            if unfinished_sents.max() == 0:
                break
        if cur_len == max_len:
            generated[-1].masked_fill_(unfinished_sents.bool(), self.eos_index)
        assert (generated == self.eos_index).sum() == 2 * bs
        return generated[:cur_len], gen_len


def batch_sentences(sentences, pad_index, eos_index):
    """xlm/trainer.py / data loader batch_sentences: <EOS> w1 .. wn <EOS>, time-major, right-padded."""
    lengths = torch.LongTensor([len(s) + 2 for s in sentences])
    sent = torch.LongTensor(lengths.max().item(), lengths.size(0)).fill_(pad_index)
    sent[0] = eos_index
    for i, s in enumerate(sentences):
        if lengths[i] > 2:
            sent[1:lengths[i] - 1, i].copy_(torch.LongTensor(s))
        sent[lengths[i] - 1, i] = eos_index
    return sent, lengths


def main():
    torch.manual_seed(0)
    params = SimpleNamespace(n_langs=2, n_words=24, eos_index=1, pad_index=2, emb_dim=32, n_heads=4,
                             n_layers=2, dropout=0.1, attention_dropout=0.1, gelu_activation=True,
                             share_inout_emb=False)
    encoder = TransformerModel(params, is_encoder=True, with_output=True)
    decoder = TransformerModel(params, is_encoder=False, with_output=True)
    encoder.eval()
    decoder.eval()
    lang1_id, lang2_id = 0, 1

    src_sents = [[5, 9, 7, 11, 3, 8], [4, 12, 6], [10]]
    tgt_sents = [[6, 7, 13], [9, 5, 14, 15, 4, 3], [8]]
    x1, len1 = batch_sentences(src_sents, params.pad_index, params.eos_index)
    x2, len2 = batch_sentences(tgt_sents, params.pad_index, params.eos_index)
    langs1 = x1.clone().fill_(lang1_id)
    langs2 = x2.clone().fill_(lang2_id)
    ok = True

    with torch.no_grad():
        # ---- mt_step (teacher forcing) ----
        enc1 = encoder("fwd", x=x1, lengths=len1, langs=langs1, causal=False)
        enc1 = enc1.transpose(0, 1)
        dec2 = decoder("fwd", x=x2, lengths=len2, langs=langs2, causal=True, src_enc=enc1, src_len=len1)
        alen = torch.arange(len2.max(), dtype=torch.long)
        pred_mask = alen[:, None] < len2[None] - 1
        y = x2[1:].masked_select(pred_mask[:-1])
        scores, loss = decoder("predict", tensor=dec2, pred_mask=pred_mask, y=y, get_scores=True)

        # reference: each pair alone, unpadded
        ref_scores, ref_y = [], []
        for i in range(len(src_sents)):
            xs, ls = batch_sentences([src_sents[i]], params.pad_index, params.eos_index)
            xt, lt = batch_sentences([tgt_sents[i]], params.pad_index, params.eos_index)
            e = encoder("fwd", x=xs, lengths=ls, langs=xs.clone().fill_(lang1_id), causal=False).transpose(0, 1)
            n = int(len1[i])
            ok &= torch.allclose(e[0, :n], enc1[i, :n], atol=1e-5)
            d = decoder("fwd", x=xt, lengths=lt, langs=xt.clone().fill_(lang2_id), causal=True, src_enc=e, src_len=ls)
            ref_scores.append(decoder.pred_layer.get_scores(d[: int(lt) - 1, 0]))
            ref_y.append(xt[1:, 0])
        # pred_mask selects time-major: reorder the reference the same way
        ref_mat = torch.zeros(int(len2.max()), len(src_sents), params.n_words)
        for i, r in enumerate(ref_scores):
            ref_mat[: r.size(0), i] = r
        ref_sel = ref_mat[pred_mask.unsqueeze(-1).expand_as(ref_mat)].view(-1, params.n_words)
        ok &= torch.allclose(scores, ref_sel, atol=1e-5)
        ref_loss = F.cross_entropy(ref_sel, y)
        ok &= torch.allclose(loss, ref_loss, atol=1e-6)
        print("teacher-forced scores match per-sentence reference:", ok)

        # ---- greedy cached generation ----
        max_len = 9
        generated, gen_len = decoder.generate(enc1, len1, lang2_id, max_len=max_len)
        gen_ok = True
        for i in range(len(src_sents)):
            # reference 1: sentence alone, cached
            xs, ls = batch_sentences([src_sents[i]], params.pad_index, params.eos_index)
            e = encoder("fwd", x=xs, lengths=ls, langs=xs.clone().fill_(lang1_id), causal=False).transpose(0, 1)
            g_alone, gl_alone = decoder.generate(e, ls, lang2_id, max_len=max_len)
            n = int(gen_len[i])
            gen_ok &= int(gl_alone[0]) == n
            gen_ok &= torch.equal(g_alone[:n, 0], generated[:n, i])
            # reference 2: no cache, full prefix recomputed each step, plain loop
            seq = [params.eos_index]
            while len(seq) < max_len:
                xt = torch.LongTensor(seq)[:, None]
                d = decoder("fwd", x=xt, lengths=torch.LongTensor([len(seq)]),
                            langs=xt.clone().fill_(lang2_id), causal=True, src_enc=e, src_len=ls)
                nxt = int(decoder.pred_layer.get_scores(d[-1]).argmax(-1))
                seq.append(nxt)
                if nxt == params.eos_index:
                    break
            if seq[-1] != params.eos_index:
                seq[-1] = params.eos_index
            gen_ok &= seq == generated[:n, i].tolist()
        print("generated:", generated.t().tolist(), "gen_len:", gen_len.tolist())
        print("batched cached generation matches single / no-cache reference:", gen_ok)
        ok &= gen_ok

    print("MATCH" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
