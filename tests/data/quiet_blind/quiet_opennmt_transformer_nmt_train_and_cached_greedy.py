# Citation: OpenNMT/OpenNMT-py onmt/decoders/transformer.py, onmt/encoders/transformer.py, onmt/modules/multi_headed_attn.py, onmt/utils/misc.py @v3.5.1
#   (written from the 3.x release; the index only held an older snapshot @0421281d)
# Encoder: mask = ~sequence_mask(src_len) (True = pad) -> (B,1,S), scores.masked_fill(mask, -1e18). Decoder:
# src_pad_mask (B,1,S) for context attention; _compute_dec_mask adds tgt_pad_mask (B,1,T) and the triu(1) future
# mask (1,T,T) into a (B,T,T) bool mask for self-attention when T > 1. At translate time, greedy steps feed one
# token with a layer cache (self-attn mask None: every cached key is a real earlier token).
import math

import torch
import torch.nn as nn

torch.manual_seed(0)
PAD, BOS, EOS = 1, 2, 3


def sequence_mask(lengths, max_len=None):
    batch_size = lengths.numel()
    max_len = max_len or lengths.max()
    return torch.arange(0, max_len, device=lengths.device).type_as(lengths).repeat(batch_size, 1).lt(
        lengths.unsqueeze(1))


class MultiHeadedAttention(nn.Module):
    def __init__(self, head_count, model_dim, attn_type=None):
        super().__init__()
        self.dim_per_head = model_dim // head_count
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, model_dim)
        self.linear_values = nn.Linear(model_dim, model_dim)
        self.linear_query = nn.Linear(model_dim, model_dim)
        self.final_linear = nn.Linear(model_dim, model_dim)
        self.attn_type = attn_type
        self.layer_cache = (False, {"keys": torch.tensor([]), "values": torch.tensor([])})

    def shape(self, x):
        return x.view(x.size(0), -1, self.head_count, self.dim_per_head).transpose(1, 2)

    def unshape(self, x):
        return x.transpose(1, 2).contiguous().view(x.size(0), -1, self.head_count * self.dim_per_head)

    def forward(self, key, value, query, mask=None, step=None):
        if self.layer_cache[0]:
            if self.attn_type == "self":
                query, key, value = self.linear_query(query), self.linear_keys(query), self.linear_values(query)
                key, value = self.shape(key), self.shape(value)
                if self.layer_cache[1]["keys"].numel() != 0:
                    key = torch.cat((self.layer_cache[1]["keys"], key), dim=2)
                    value = torch.cat((self.layer_cache[1]["values"], value), dim=2)
                self.layer_cache[1]["keys"], self.layer_cache[1]["values"] = key, value
            elif self.attn_type == "context":
                query = self.linear_query(query)
                if self.layer_cache[1]["keys"].numel() == 0:
                    key, value = self.shape(self.linear_keys(key)), self.shape(self.linear_values(value))
                    self.layer_cache[1]["keys"], self.layer_cache[1]["values"] = key, value
                else:
                    key, value = self.layer_cache[1]["keys"], self.layer_cache[1]["values"]
        else:
            key, value, query = self.linear_keys(key), self.linear_values(value), self.linear_query(query)
            key, value = self.shape(key), self.shape(value)
        query = self.shape(query)
        query = query / math.sqrt(self.dim_per_head)
        scores = torch.matmul(query, key.transpose(2, 3)).float()
        if mask is not None:
            mask = mask.unsqueeze(1)  # [B, 1, 1|T, S]
            scores = scores.masked_fill(mask, -1e18)
        attn = torch.softmax(scores, dim=-1).to(query.dtype)
        context = self.unshape(torch.matmul(attn, value))
        return self.final_linear(context), attn


class FFN(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.layer_norm = nn.LayerNorm(d, eps=1e-6)
        self.w_1, self.w_2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x):
        return self.w_2(torch.relu(self.w_1(self.layer_norm(x)))) + x


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d, heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d, attn_type="self")
        self.layer_norm = nn.LayerNorm(d, eps=1e-6)
        self.feed_forward = FFN(d, d_ff)

    def forward(self, layer_in, mask):
        norm = self.layer_norm(layer_in)
        context, _ = self.self_attn(norm, norm, norm, mask=mask)
        return self.feed_forward(context + layer_in)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d, heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d, attn_type="self")
        self.context_attn = MultiHeadedAttention(heads, d, attn_type="context")
        self.layer_norm_1 = nn.LayerNorm(d, eps=1e-6)
        self.layer_norm_2 = nn.LayerNorm(d, eps=1e-6)
        self.feed_forward = FFN(d, d_ff)

    def _compute_dec_mask(self, tgt_pad_mask, future):
        tgt_len = tgt_pad_mask.size(-1)
        if not future:  # apply future_mask, result mask in (B, T, T)
            future_mask = torch.ones([tgt_len, tgt_len], device=tgt_pad_mask.device, dtype=torch.uint8)
            future_mask = future_mask.triu_(1).view(1, tgt_len, tgt_len)
            future_mask = future_mask.bool()
            dec_mask = torch.gt(tgt_pad_mask + future_mask, 0)
        else:  # only mask padding, result mask in (B, 1, T)
            dec_mask = tgt_pad_mask
        return dec_mask

    def forward(self, layer_in, enc_out, src_pad_mask, tgt_pad_mask, step=None, future=False):
        dec_mask = None
        if layer_in.size(1) > 1:
            # masking is necessary when sequence length is greater than one
            dec_mask = self._compute_dec_mask(tgt_pad_mask, future)
        norm_layer_in = self.layer_norm_1(layer_in)
        self_attn, _ = self.self_attn(norm_layer_in, norm_layer_in, norm_layer_in, mask=dec_mask, step=step)
        query = self_attn + layer_in
        norm_query = self.layer_norm_2(query)
        mid, attns = self.context_attn(enc_out, enc_out, norm_query, mask=src_pad_mask)
        return self.feed_forward(mid + query), attns


class Embeddings(nn.Module):
    def __init__(self, vocab, d, word_padding_idx=PAD):
        super().__init__()
        self.word_padding_idx = word_padding_idx
        self.emb = nn.Embedding(vocab, d, padding_idx=word_padding_idx)
        pe = torch.zeros(64, d)
        position = torch.arange(0, 64).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float) * -(math.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div_term), torch.cos(position * div_term)
        self.register_buffer("pe", pe)
        self.d = d

    def forward(self, source, step=None):
        emb = self.emb(source[:, :, 0]) * math.sqrt(self.d)
        if step is None:
            return emb + self.pe[: emb.size(1)]
        return emb + self.pe[step]


class NMTModel(nn.Module):
    def __init__(self, vocab=30, d=32, heads=4, d_ff=64, layers=2):
        super().__init__()
        self.src_emb, self.tgt_emb = Embeddings(vocab, d), Embeddings(vocab, d)
        self.enc_layers = nn.ModuleList([TransformerEncoderLayer(d, heads, d_ff) for _ in range(layers)])
        self.enc_norm = nn.LayerNorm(d, eps=1e-6)
        self.dec_layers = nn.ModuleList([TransformerDecoderLayer(d, heads, d_ff) for _ in range(layers)])
        self.dec_norm = nn.LayerNorm(d, eps=1e-6)
        self.generator = nn.Linear(d, vocab)
        self.state = {}

    def encode(self, src, src_len):
        enc_out = self.src_emb(src)
        mask = ~sequence_mask(src_len).unsqueeze(1)
        for layer in self.enc_layers:
            enc_out = layer(enc_out, mask)
        self.state["src"] = src
        return self.enc_norm(enc_out)

    def init_cache(self, on):
        for layer in self.dec_layers:
            layer.self_attn.layer_cache = (on, {"keys": torch.tensor([]), "values": torch.tensor([])})
            layer.context_attn.layer_cache = (on, {"keys": torch.tensor([]), "values": torch.tensor([])})

    def decode(self, tgt, enc_out, src_len, step=None):
        dec_out = self.tgt_emb(tgt, step=step)
        tgt_words = tgt[:, :, 0]
        pad_idx = self.tgt_emb.word_padding_idx
        src_max_len = self.state["src"].shape[1]
        src_pad_mask = ~sequence_mask(src_len, src_max_len)  # [B x slen]
        src_pad_mask = src_pad_mask.unsqueeze(1)  # [B x 1 x slen]
        tgt_pad_mask = tgt_words.data.eq(pad_idx).unsqueeze(1)  # [B, 1, T_tgt]
        for layer in self.dec_layers:
            dec_out, attn = layer(dec_out, enc_out, src_pad_mask, tgt_pad_mask, step=step)
        return self.dec_norm(dec_out), attn

    def forward(self, src, tgt, src_len):
        dec_in = tgt[:, :-1, :]  # exclude last target from inputs
        enc_out = self.encode(src, src_len)
        self.init_cache(False)
        dec_out, attns = self.decode(dec_in, enc_out, src_len)
        return self.generator(dec_out), attns


def pad_batch(seqs):
    L = max(len(s) for s in seqs)
    out = torch.full((len(seqs), L, 1), PAD)
    for i, s in enumerate(seqs):
        out[i, :len(s), 0] = torch.tensor(s)
    return out, torch.tensor([len(s) for s in seqs])


srcs = [[5, 6, 7, 8, 9, EOS], [10, 11, EOS], [12, 13, 14, 15, EOS]]
tgts = [[BOS, 20, 21, 22, EOS], [BOS, 23, EOS], [BOS, 24, 25, 26, 27, 28, EOS]]
src, src_len = pad_batch(srcs)
tgt, _ = pad_batch(tgts)
model = NMTModel()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
crit = nn.NLLLoss(ignore_index=PAD, reduction="sum")
for step in range(3):
    logits, attns = model(src, tgt, src_len)
    loss = crit(torch.log_softmax(logits, -1).view(-1, logits.size(-1)), tgt[:, 1:, 0].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
    assert attns[1, :, :, 3:].abs().max() == 0  # context attention never looks at padded source positions

model.eval()
with torch.no_grad():
    logits, _ = model(src, tgt, src_len)
    for i in range(3):
        li, _ = model(src[i:i + 1, :len(srcs[i])], tgt[i:i + 1, :len(tgts[i])], src_len[i:i + 1])
        assert torch.allclose(li[0], logits[i, :len(tgts[i]) - 1], atol=1e-4), i
    # greedy translation with the layer cache, one token per step
    enc_out = model.encode(src, src_len)
    model.init_cache(True)
    dec_in = torch.full((3, 1, 1), BOS)
    hyp = []
    for step in range(5):
        dec_out, _ = model.decode(dec_in, enc_out, src_len, step=step)
        scores = model.generator(dec_out[:, -1])
        scores[:, PAD] = -float("inf")  # decoding never emits the pad token
        nxt = scores.argmax(-1)
        hyp.append(nxt)
        dec_in = nxt.view(3, 1, 1)
    hyp = torch.stack(hyp, 1)
    # same tokens as re-running the full prefix without the cache
    model.init_cache(False)
    prefix = torch.cat([torch.full((3, 1), BOS), hyp], 1)[:, :, None]
    full_scores = model.generator(model.decode(prefix[:, :-1], enc_out, src_len)[0])
    full_scores[:, :, PAD] = -float("inf")
    full = full_scores.argmax(-1)
    assert torch.equal(full, hyp)
print("greedy hyps", hyp.tolist())
