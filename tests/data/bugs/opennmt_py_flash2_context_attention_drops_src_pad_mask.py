# Citation: OpenNMT/OpenNMT-py PR #2484 (commit 160cc113, "flash2 does not support context attention"),
#   the flash2 branch having come with PR #2481 (commit 4706d563, "Flash attention 2 support").
# Upstream: onmt/modules/multi_headed_attn.py MultiHeadedAttention.forward, step 2
#   ("When standard pos. enc. or rotary, use flash attention"), the branch taken by every
#   attention that is not the decoder's self-attention (encoder self-attention and the decoder's
#   context attention), with the source padding mask built in onmt/encoders/transformer.py
#   TransformerEncoder.forward and onmt/decoders/transformer.py TransformerDecoder.forward
#   (~sequence_mask(src_len)).
# Bug: when flash-attn 2 was importable (self.flash2) that branch called
#   flash_attn_func(q, k, v, dropout_p=..., causal=False), which takes no mask at all, so the
#   `mask` argument (the source key padding mask) was dropped: encoder tokens and decoder
#   cross-attention attended to the padded source positions of a right-padded batch.
# Fix: that branch always calls F.scaled_dot_product_attention(query, key, value, ~mask,
#   self.dropout_p, is_causal=False); flash_attn_func stays only for decoder self-attention.
#   Upstream flash2 also requires a CUDA device of capability >= 8; here flash_attn_func is a
#   plain-torch stand-in with flash-attn's signature and layout, so the branch runs on CPU.
import math
import sys

import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)
torch.set_num_threads(1)

UNK, PAD, BOS, EOS = 0, 1, 2, 3  # OpenNMT-py vocab: <unk>, <blank>, <s>, </s>
VOCAB = 16


def sequence_mask(lengths, max_len=None):
    """Creates a boolean mask from sequence lengths."""
    batch_size = lengths.numel()
    max_len = max_len or lengths.max()
    return (
        torch.arange(0, max_len, device=lengths.device)
        .type_as(lengths)
        .repeat(batch_size, 1)
        .lt(lengths.unsqueeze(1))
    )


def shape(x, dim_per_head):
    return x.view(x.size(0), x.size(1), -1, dim_per_head).transpose(1, 2)


def unshape(x):
    return x.transpose(1, 2).contiguous().view(x.size(0), -1, x.size(1) * x.size(3))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """Plain-torch stand-in for flash_attn.flash_attn_func: q (B, Sq, H, D), k/v (B, Sk, H, D),
    no mask argument; causal aligned to the bottom-right corner (flash-attn >= 2.1)."""
    Sq, Sk, D = q.size(1), k.size(1), q.size(-1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if causal:
        keep = torch.ones(Sq, Sk, dtype=torch.bool).tril(diagonal=Sk - Sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    attn = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        attn = F.dropout(attn, p=dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", attn, v.float()).to(q.dtype)


class MultiHeadedAttention(nn.Module):
    def __init__(self, head_count, model_dim, dropout=0.1, is_decoder=True,
                 max_relative_positions=0, attn_type=None):
        super().__init__()
        self.dim_per_head = model_dim // head_count
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, model_dim, bias=False)
        self.linear_values = nn.Linear(model_dim, model_dim, bias=False)
        self.linear_query = nn.Linear(model_dim, model_dim, bias=False)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.final_linear = nn.Linear(model_dim, model_dim, bias=False)
        self.is_decoder = is_decoder
        self.max_relative_positions = max_relative_positions
        self.attn_type = attn_type
        self.layer_cache = (False, {"keys": torch.tensor([]), "values": torch.tensor([])})
        self.dropout_p = dropout
        # upstream: importlib.import_module("flash_attn"); flash_attn_func found -> self.flash2 = True
        self.flash_attn_func = flash_attn_func
        self.flash2 = True

    def forward(self, key, value, query, mask=None, step=0, return_attn=False):
        # 1) Project key, value, and query.
        if self.layer_cache[0]:
            if self.attn_type == "self":
                query, key, value = (
                    self.linear_query(query),
                    self.linear_keys(query),
                    self.linear_values(query),
                )
                query = shape(query, self.dim_per_head)
                key = shape(key, self.dim_per_head)
                value = shape(value, self.dim_per_head)
                if self.layer_cache[1]["keys"].numel() != 0:
                    key = torch.cat((self.layer_cache[1]["keys"], key), dim=2)
                if self.layer_cache[1]["values"].numel() != 0:
                    value = torch.cat((self.layer_cache[1]["values"], value), dim=2)
                self.layer_cache[1]["keys"] = key
                self.layer_cache[1]["values"] = value
            elif self.attn_type == "context":
                query = self.linear_query(query)
                query = shape(query, self.dim_per_head)
                if self.layer_cache[1]["keys"].numel() == 0:
                    key, value = self.linear_keys(key), self.linear_values(value)
                    key = shape(key, self.dim_per_head)
                    value = shape(value, self.dim_per_head)
                else:
                    key, value = self.layer_cache[1]["keys"], self.layer_cache[1]["values"]
                self.layer_cache[1]["keys"] = key
                self.layer_cache[1]["values"] = value
        else:
            key = shape(self.linear_keys(key), self.dim_per_head)
            value = shape(self.linear_values(value), self.dim_per_head)
            query = shape(self.linear_query(query), self.dim_per_head)

        # 2) When standard pos. enc. or rotary, use flash attention
        flash2 = self.flash2
        if self.max_relative_positions in [-1, 0] and not return_attn:
            if self.is_decoder and self.attn_type == "self":
                if flash2:
                    attn_output = self.flash_attn_func(
                        query.transpose(1, 2),
                        key.transpose(1, 2),
                        value.transpose(1, 2),
                        dropout_p=self.dropout_p,
                        causal=mask is not None,
                    ).transpose(1, 2)
                else:
                    attn_output = F.scaled_dot_product_attention(
                        query, key, value, None, self.dropout_p, is_causal=mask is not None
                    )
            else:
                if flash2 and not FIXED:
                    attn_output = self.flash_attn_func(
                        query.transpose(1, 2),
                        key.transpose(1, 2),
                        value.transpose(1, 2),
                        dropout_p=self.dropout_p,
                        causal=False,
                    ).transpose(1, 2)
                else:
                    attn_output = F.scaled_dot_product_attention(
                        query, key, value, ~mask, self.dropout_p, is_causal=False
                    )
            x = unshape(attn_output)
            attn_output = self.final_linear(x)
            return attn_output, None
        else:
            query = query / math.sqrt(self.dim_per_head)
            scores = torch.matmul(query, key.transpose(2, 3))
            scores = scores.float()
            if mask is not None:
                mask = mask.expand(-1, self.head_count, -1, -1)
                scores = scores.masked_fill(mask, -1e18)
            attn = self.softmax(scores).to(query.dtype)
            drop_attn = self.dropout(attn)
            context_original = torch.matmul(drop_attn, value)
            context = unshape(context_original)
            attn_output = self.final_linear(context)
            return attn_output, attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout_1 = nn.Dropout(dropout)
        self.dropout_2 = nn.Dropout(dropout)

    def forward(self, x):
        norm_x = self.layer_norm(x)
        inter = self.dropout_1(torch.relu(self.w_1(norm_x)))
        inter = self.dropout_2(self.w_2(inter))
        return inter + x


class Embeddings(nn.Module):
    def __init__(self, dim, vocab, word_padding_idx, max_len=64):
        super().__init__()
        self.word_padding_idx = word_padding_idx
        self.word_lut = nn.Embedding(vocab, dim, padding_idx=word_padding_idx)
        pe = torch.zeros(max_len, dim)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, dim, 2, dtype=torch.float) * -(math.log(10000.0) / dim))
        pe[:, 0::2] = torch.sin(position.float() * div_term)
        pe[:, 1::2] = torch.cos(position.float() * div_term)
        self.register_buffer("pe", pe.unsqueeze(1))
        self.dim = dim

    def forward(self, source, step=None):
        emb = self.word_lut(source[:, :, 0])
        pe = self.pe.transpose(0, 1)
        emb = emb * math.sqrt(self.dim)
        step = step or 0
        return emb + pe[:, step: emb.size(1) + step, :]


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff, dropout, attention_dropout):
        super().__init__()
        self.self_attn = MultiHeadedAttention(
            heads, d_model, dropout=attention_dropout, is_decoder=False, attn_type="self"
        )
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout = nn.Dropout(dropout)

    def forward(self, layer_in, mask):
        norm_layer_in = self.layer_norm(layer_in)
        context, _ = self.self_attn(norm_layer_in, norm_layer_in, norm_layer_in, mask=mask)
        layer_out = self.dropout(context) + layer_in
        layer_out = self.feed_forward(layer_out)
        return layer_out


class TransformerEncoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, dropout, attention_dropout, embeddings):
        super().__init__()
        self.embeddings = embeddings
        self.transformer = nn.ModuleList(
            [TransformerEncoderLayer(d_model, heads, d_ff, dropout, attention_dropout)
             for _ in range(num_layers)]
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, src, src_len=None):
        enc_out = self.embeddings(src)
        mask = ~sequence_mask(src_len).unsqueeze(1)
        mask = mask.unsqueeze(1)
        mask = mask.expand(-1, -1, mask.size(3), -1)
        for layer in self.transformer:
            enc_out = layer(enc_out, mask)
        enc_out = self.layer_norm(enc_out)
        return enc_out, None, src_len


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff, dropout, attention_dropout):
        super().__init__()
        self.self_attn = MultiHeadedAttention(
            heads, d_model, dropout=attention_dropout, attn_type="self"
        )
        self.context_attn = MultiHeadedAttention(
            heads, d_model, dropout=attention_dropout, attn_type="context"
        )
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.layer_norm_1 = nn.LayerNorm(d_model, eps=1e-6)
        self.layer_norm_2 = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout = nn.Dropout(dropout)

    def _compute_dec_mask(self, tgt_pad_mask, future):
        tgt_len = tgt_pad_mask.size(-1)
        if not future:
            future_mask = torch.ones([tgt_len, tgt_len], device=tgt_pad_mask.device, dtype=torch.uint8)
            future_mask = future_mask.triu_(1).view(1, tgt_len, tgt_len).bool()
            dec_mask = torch.gt(tgt_pad_mask + future_mask, 0)
        else:
            dec_mask = tgt_pad_mask
        return dec_mask

    def forward(self, layer_in, enc_out, src_pad_mask, tgt_pad_mask, step=None,
                future=False, return_attn=False):
        dec_mask = None
        src_pad_mask = src_pad_mask.unsqueeze(1)  # [B,1,1,slen]
        if layer_in.size(1) > 1:
            # masking is necessary when sequence length is greater than one
            dec_mask = self._compute_dec_mask(tgt_pad_mask, future)
            dec_mask = dec_mask.unsqueeze(1)
            dec_mask = dec_mask.expand(-1, -1, dec_mask.size(3), -1)
            src_pad_mask = src_pad_mask.expand(-1, -1, dec_mask.size(3), -1)
        norm_layer_in = self.layer_norm_1(layer_in)
        self_attn, _ = self.self_attn(
            norm_layer_in, norm_layer_in, norm_layer_in, mask=dec_mask, step=step,
        )
        query = self.dropout(self_attn) + layer_in
        norm_query = self.layer_norm_2(query)
        ctx_attn, attns = self.context_attn(
            enc_out, enc_out, norm_query, mask=src_pad_mask, return_attn=return_attn
        )
        layer_out = self.feed_forward(self.dropout(ctx_attn) + query)
        return layer_out, attns


class TransformerDecoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, dropout, attention_dropout, embeddings):
        super().__init__()
        self.embeddings = embeddings
        self.state = {}
        self.transformer_layers = nn.ModuleList(
            [TransformerDecoderLayer(d_model, heads, d_ff, dropout, attention_dropout)
             for _ in range(num_layers)]
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def init_state(self, src, enc_out, enc_final_hs):
        self.state["src"] = src

    def _init_cache(self, enc_out):
        for layer in self.transformer_layers:
            layer.context_attn.layer_cache = (True, {"keys": torch.tensor([]), "values": torch.tensor([])})
            layer.self_attn.layer_cache = (True, {"keys": torch.tensor([]), "values": torch.tensor([])})

    def forward(self, tgt, enc_out=None, step=None, **kwargs):
        if step == 0:
            self._init_cache(enc_out)
        elif step is None:
            for layer in self.transformer_layers:
                layer.self_attn.layer_cache = (False, {"keys": torch.tensor([]), "values": torch.tensor([])})
                layer.context_attn.layer_cache = (False, {"keys": torch.tensor([]), "values": torch.tensor([])})
        emb = self.embeddings(tgt, step=step)
        dec_out = emb
        pad_idx = self.embeddings.word_padding_idx
        src_lens = kwargs["src_len"]
        src_max_len = self.state["src"].shape[1]
        src_pad_mask = ~sequence_mask(src_lens, src_max_len)  # [B x slen]
        src_pad_mask = src_pad_mask.unsqueeze(1)  # [B x 1 x slen]
        tgt_pad_mask = tgt[:, :, 0].eq(pad_idx).unsqueeze(1)  # [B, 1, T_tgt]
        attn = None
        for layer in self.transformer_layers:
            dec_out, attn = layer(dec_out, enc_out, src_pad_mask, tgt_pad_mask, step=step)
        dec_out = self.layer_norm(dec_out)
        return dec_out, {"std": attn}


class NMTModel(nn.Module):
    def __init__(self, encoder, decoder, generator):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.generator = generator

    def forward(self, src, tgt, src_len):
        dec_in = tgt[:, :-1, :]
        enc_out, enc_final_hs, src_len = self.encoder(src, src_len)
        self.decoder.init_state(src, enc_out, enc_final_hs)
        dec_out, attns = self.decoder(dec_in, enc_out, src_len=src_len)
        return dec_out, attns


def build_model(d_model=32, heads=4, d_ff=64, layers=2):
    src_emb = Embeddings(d_model, VOCAB, PAD)
    tgt_emb = Embeddings(d_model, VOCAB, PAD)
    encoder = TransformerEncoder(layers, d_model, heads, d_ff, 0.0, 0.0, src_emb)
    decoder = TransformerDecoder(layers, d_model, heads, d_ff, 0.0, 0.0, tgt_emb)
    generator = nn.Sequential(nn.Linear(d_model, VOCAB), nn.LogSoftmax(dim=-1))
    return NMTModel(encoder, decoder, generator)


def make_batch(g, batch_size, min_len=2, max_len=7):
    """Task: the target is the source reversed. Right-padded, sorted by length (as onmt batches)."""
    lens = torch.randint(min_len, max_len + 1, (batch_size,), generator=g)
    lens, _ = lens.sort(descending=True)
    S = int(lens.max())
    src = torch.full((batch_size, S), PAD)
    tgt = torch.full((batch_size, S + 2), PAD)
    for i, n in enumerate(lens.tolist()):
        toks = torch.randint(4, VOCAB, (n,), generator=g)
        src[i, :n] = toks
        tgt[i, 0] = BOS
        tgt[i, 1:n + 1] = toks.flip(0)
        tgt[i, n + 1] = EOS
    return src.unsqueeze(-1), tgt.unsqueeze(-1), lens


def greedy_translate(model, src, src_len, max_length=9):
    enc_out, enc_final_hs, src_len = model.encoder(src, src_len)
    model.decoder.init_state(src, enc_out, enc_final_hs)
    B = src.size(0)
    decoder_in = torch.full((B, 1, 1), BOS)
    out = []
    for step in range(max_length):
        dec_out, _ = model.decoder(decoder_in, enc_out, step=step, src_len=src_len)
        log_probs = model.generator(dec_out.squeeze(1))
        decoder_in = log_probs.argmax(-1).view(B, 1, 1)
        out.append(decoder_in.view(B))
    return torch.stack(out, 1)


def main():
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    criterion = nn.NLLLoss(ignore_index=PAD, reduction="sum")
    g = torch.Generator().manual_seed(1)
    for it in range(100):
        src, tgt, src_len = make_batch(g, 32)
        dec_out, _ = model(src, tgt, src_len)
        scores = model.generator(dec_out)
        gold = tgt[:, 1:, 0]
        loss = criterion(scores.reshape(-1, VOCAB), gold.reshape(-1))
        n_tok = gold.ne(PAD).sum()
        opt.zero_grad()
        (loss / n_tok).backward()
        opt.step()
        if it % 25 == 0 or it == 99:
            print(f"step {it:3d}  train nll/token {loss.item() / n_tok.item():.4f}")

    model.eval()
    with torch.no_grad():
        g_eval = torch.Generator().manual_seed(123)
        src, tgt, src_len = make_batch(g_eval, 64)
        dec_out, _ = model(src, tgt, src_len)
        gold = tgt[:, 1:, 0]
        loss = criterion(model.generator(dec_out).reshape(-1, VOCAB), gold.reshape(-1))
        print(f"eval nll/token {loss.item() / gold.ne(PAD).sum().item():.4f}")
        hyp = greedy_translate(model, src, src_len)
        correct = 0
        for i in range(src.size(0)):
            n = int(src_len[i])
            ref = tgt[i, 1:n + 2, 0]
            correct += int(torch.equal(hyp[i, :n + 1], ref))
        print(f"greedy exact reversals: {correct}/{src.size(0)}")
        for i in [0, 31, 63]:
            n = int(src_len[i])
            print("src", src[i, :n, 0].tolist(), "-> hyp", hyp[i, :n + 1].tolist())


if __name__ == "__main__":
    main()
