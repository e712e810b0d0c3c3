"""OpenNMT-py: an AAN (average attention) decoder scores a batch after translating another.

Citation: OpenNMT/OpenNMT-py commit 7b53999d ("fix avg attn cache", squash-merged as 0d46218d, PR #2366),
onmt/decoders/transformer.py TransformerDecoder.forward; code ported from its parent (v3.1.x):
onmt/modules/multi_headed_attn.py, onmt/modules/average_attn.py, onmt/utils/misc.py sequence_mask.

Bug: translating sets every decoder layer's `context_attn.layer_cache = (True, {keys, values})` (_init_cache at
step 0) and fills it with the source's encoder keys. When the decoder is next run with step=None (training, or
validation scoring after an in-training translation), forward() resets the caches only in the scaled-dot branch;
with self_attn_type="average" the context attention keeps (True, <old keys>) and attends to the previous batch's
encoder memory under the new batch's source padding mask.
Fix: reset `layer.context_attn.layer_cache = (False, ...)` for every layer, AAN or not.
"""
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def sequence_mask(lengths, max_len=None):
    batch_size = lengths.numel()
    max_len = max_len or lengths.max()
    return (torch.arange(0, max_len, device=lengths.device)
            .type_as(lengths)
            .repeat(batch_size, 1)
            .lt(lengths.unsqueeze(1)))


def shape(x, dim_per_head):
    return x.view(x.size(0), x.size(1), -1, dim_per_head).transpose(1, 2)


def unshape(x):
    return x.transpose(1, 2).contiguous().view(x.size(0), -1, x.size(1) * x.size(3))


class MultiHeadedAttention(nn.Module):
    def __init__(self, head_count, model_dim, attn_type=None):
        super().__init__()
        self.dim_per_head = model_dim // head_count
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, model_dim, bias=False)
        self.linear_values = nn.Linear(model_dim, model_dim, bias=False)
        self.linear_query = nn.Linear(model_dim, model_dim, bias=False)
        self.softmax = nn.Softmax(dim=-1)
        self.final_linear = nn.Linear(model_dim, model_dim, bias=False)
        self.attn_type = attn_type
        self.layer_cache = (False, {'keys': torch.tensor([]), 'values': torch.tensor([])})

    def forward(self, key, value, query, mask=None, step=0):
        # as a reminder at training layer_cache[0] remains False
        if self.layer_cache[0]:
            if self.attn_type == "self":
                query, key, value = self.linear_query(query), self.linear_keys(query), self.linear_values(query)
                query = shape(query, self.dim_per_head)
                key = shape(key, self.dim_per_head)
                value = shape(value, self.dim_per_head)
                if self.layer_cache[1]['keys'].numel() != 0:
                    key = torch.cat((self.layer_cache[1]['keys'], key), dim=2)
                if self.layer_cache[1]['values'].numel() != 0:
                    value = torch.cat((self.layer_cache[1]['values'], value), dim=2)
                self.layer_cache[1]['keys'] = key
                self.layer_cache[1]['values'] = value
            elif self.attn_type == "context":
                query = self.linear_query(query)
                query = shape(query, self.dim_per_head)
                if self.layer_cache[1]['keys'].numel() == 0:
                    key, value = self.linear_keys(key), self.linear_values(value)
                    key = shape(key, self.dim_per_head)
                    value = shape(value, self.dim_per_head)
                else:
                    key, value = self.layer_cache[1]['keys'], self.layer_cache[1]['values']
                self.layer_cache[1]['keys'] = key
                self.layer_cache[1]['values'] = value
        else:
            key = shape(self.linear_keys(key), self.dim_per_head)
            value = shape(self.linear_values(value), self.dim_per_head)
            query = shape(self.linear_query(query), self.dim_per_head)
        query = query / math.sqrt(self.dim_per_head)
        # batch x num_heads x query_len x key_len
        scores = torch.matmul(query, key.transpose(2, 3)).float()
        if mask is not None:
            mask = mask.expand(-1, self.head_count, -1, -1)
            scores = scores.masked_fill(mask, -1e18)
        attn = self.softmax(scores).to(query.dtype)
        context = unshape(torch.matmul(attn, value))
        return self.final_linear(context), attn


def cumulative_average_mask(batch_size, t_len, device=None):
    triangle = torch.tril(torch.ones(t_len, t_len, dtype=torch.float, device=device))
    weights = torch.ones(1, t_len, dtype=torch.float, device=device) \
        / torch.arange(1, t_len + 1, dtype=torch.float, device=device)
    mask = triangle * weights.transpose(0, 1)
    return mask.unsqueeze(0).expand(batch_size, t_len, t_len)


def cumulative_average(layer_in, layer_cache, mask=None, step=None):
    if layer_cache[0]:
        average_attention = (layer_in + step * layer_cache[1]['prev_g']) / (step + 1)
        layer_cache[1]['prev_g'] = average_attention
        return average_attention
    else:
        return torch.matmul(mask.to(layer_in.dtype), layer_in)


class AverageAttention(nn.Module):
    def __init__(self, model_dim):
        super().__init__()
        self.model_dim = model_dim
        self.gating_layer = nn.Linear(model_dim * 2, model_dim * 2)
        self.layer_cache = False, {'prev_g': torch.tensor([])}

    def forward(self, layer_in, mask=None, step=None):
        batch_size = layer_in.size(0)
        t_len = layer_in.size(1)
        mask = cumulative_average_mask(batch_size, t_len, layer_in.device) if not self.layer_cache[0] else None
        average_out = cumulative_average(layer_in, self.layer_cache, mask, step)
        gating_out = self.gating_layer(torch.cat((layer_in, average_out), -1))
        input_gate, forget_gate = torch.chunk(gating_out, 2, dim=2)
        gating_out = torch.sigmoid(input_gate) * layer_in + torch.sigmoid(forget_gate) * average_out
        return gating_out, average_out


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, x):
        return self.w_2(torch.relu(self.w_1(self.layer_norm(x)))) + x


class Embeddings(nn.Module):
    def __init__(self, dim, vocab, pad_idx, max_len=64):
        super().__init__()
        self.word_padding_idx = pad_idx
        self.emb = nn.Embedding(vocab, dim, padding_idx=pad_idx)
        pe = torch.zeros(max_len, dim)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, dim, 2, dtype=torch.float) * -(math.log(10000.0) / dim))
        pe[:, 0::2] = torch.sin(position.float() * div_term)
        pe[:, 1::2] = torch.cos(position.float() * div_term)
        self.register_buffer("pe", pe)
        self.dim = dim

    def forward(self, source, step=None):
        emb = self.emb(source[:, :, 0]) * math.sqrt(self.dim)
        if step is None:
            return emb + self.pe[: emb.size(1)].unsqueeze(0)
        return emb + self.pe[step].view(1, 1, -1)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d_model, attn_type="self")
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, layer_in, mask):
        layer_in_norm = self.layer_norm(layer_in)
        context, _ = self.self_attn(layer_in_norm, layer_in_norm, layer_in_norm, mask=mask)
        return self.feed_forward(context + layer_in)


class TransformerEncoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, embeddings):
        super().__init__()
        self.embeddings = embeddings
        self.transformer = nn.ModuleList([TransformerEncoderLayer(d_model, heads, d_ff) for _ in range(num_layers)])
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, src, src_len=None):
        enc_out = self.embeddings(src)
        mask = ~sequence_mask(src_len).unsqueeze(1)
        mask = mask.unsqueeze(1)
        mask = mask.expand(-1, -1, mask.size(3), -1)
        for layer in self.transformer:
            enc_out = layer(enc_out, mask)
        return self.layer_norm(enc_out), None, src_len


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff, self_attn_type="scaled-dot"):
        super().__init__()
        self.self_attn_type = self_attn_type
        if self_attn_type == "scaled-dot":
            self.self_attn = MultiHeadedAttention(heads, d_model, attn_type="self")
        elif self_attn_type == "average":
            self.self_attn = AverageAttention(d_model)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff)
        self.layer_norm_1 = nn.LayerNorm(d_model, eps=1e-6)
        self.context_attn = MultiHeadedAttention(heads, d_model, attn_type="context")
        self.layer_norm_2 = nn.LayerNorm(d_model, eps=1e-6)

    def _compute_dec_mask(self, tgt_pad_mask, future):
        tgt_len = tgt_pad_mask.size(-1)
        if not future:
            future_mask = torch.ones([tgt_len, tgt_len], device=tgt_pad_mask.device, dtype=torch.uint8)
            future_mask = future_mask.triu_(1).view(1, tgt_len, tgt_len).bool()
            dec_mask = torch.gt(tgt_pad_mask + future_mask, 0)
        else:
            dec_mask = tgt_pad_mask
        return dec_mask

    def _forward_self_attn(self, layer_in_norm, dec_mask, step):
        if self.self_attn_type == "scaled-dot":
            return self.self_attn(layer_in_norm, layer_in_norm, layer_in_norm, mask=dec_mask, step=step)
        elif self.self_attn_type == "average":
            return self.self_attn(layer_in_norm, mask=dec_mask, step=step)

    def forward(self, layer_in, enc_out, src_pad_mask, tgt_pad_mask, step=None, future=False):
        dec_mask = None
        src_pad_mask = src_pad_mask.unsqueeze(1)  # [B,1,1,slen]
        if layer_in.size(1) > 1:
            dec_mask = self._compute_dec_mask(tgt_pad_mask, future)
            dec_mask = dec_mask.unsqueeze(1)
            dec_mask = dec_mask.expand(-1, -1, dec_mask.size(3), -1)
            src_pad_mask = src_pad_mask.expand(-1, -1, dec_mask.size(3), -1)
        layer_in_norm = self.layer_norm_1(layer_in)
        query, _ = self._forward_self_attn(layer_in_norm, dec_mask, step)
        query = query + layer_in
        query_norm = self.layer_norm_2(query)
        mid, attns = self.context_attn(enc_out, enc_out, query_norm, mask=src_pad_mask)
        layer_out = self.feed_forward(mid + query)
        return layer_out, attns


class TransformerDecoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, embeddings, self_attn_type="average"):
        super().__init__()
        self.embeddings = embeddings
        self.state = {}
        self.transformer_layers = nn.ModuleList(
            [TransformerDecoderLayer(d_model, heads, d_ff, self_attn_type) for _ in range(num_layers)])
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def init_state(self, src, enc_out, enc_final_hs):
        self.state["src"] = src

    def map_state(self, fn):
        self.state["src"] = fn(self.state["src"], 0)

    def forward(self, tgt, enc_out=None, step=None, **kwargs):
        if step == 0:
            self._init_cache(enc_out)
        elif step is None:
            for layer in self.transformer_layers:
                if isinstance(layer.self_attn, AverageAttention):
                    layer.self_attn.layer_cache = False, {'prev_g': torch.tensor([])}
                else:
                    layer.self_attn.layer_cache = (False, {'keys': torch.tensor([]), 'values': torch.tensor([])})
                    if not FIXED:
                        layer.context_attn.layer_cache = (False, {'keys': torch.tensor([]),
                                                                  'values': torch.tensor([])})
                if FIXED:
                    layer.context_attn.layer_cache = (False, {'keys': torch.tensor([]), 'values': torch.tensor([])})

        tgt_words = tgt[:, :, 0]
        dec_out = self.embeddings(tgt, step=step)
        pad_idx = self.embeddings.word_padding_idx
        src_lens = kwargs["src_len"]
        src_max_len = self.state["src"].shape[1]
        src_pad_mask = ~sequence_mask(src_lens, src_max_len)  # [B x slen]
        src_pad_mask = src_pad_mask.unsqueeze(1)  # [B x 1 x slen]
        tgt_pad_mask = tgt_words.data.eq(pad_idx).unsqueeze(1)  # [B, 1, T_tgt]
        for layer in self.transformer_layers:
            dec_out, attn = layer(dec_out, enc_out, src_pad_mask, tgt_pad_mask, step=step)
        dec_out = self.layer_norm(dec_out)
        return dec_out, {"std": attn[:, 0, :, :].contiguous()}

    def _init_cache(self, enc_out):
        batch_size = enc_out.size(0)
        depth = enc_out.size(-1)
        for layer in self.transformer_layers:
            layer.context_attn.layer_cache = (True, {'keys': torch.tensor([], device=enc_out.device),
                                                     'values': torch.tensor([], device=enc_out.device)})
            if isinstance(layer.self_attn, AverageAttention):
                layer.self_attn.layer_cache = True, {'prev_g': torch.zeros(
                    (batch_size, 1, depth), device=enc_out.device).to(enc_out.dtype)}
            else:
                layer.self_attn.layer_cache = (True, {'keys': torch.tensor([], device=enc_out.device),
                                                      'values': torch.tensor([], device=enc_out.device)})


class NMTModel(nn.Module):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def forward(self, src, tgt, src_len, bptt=False, with_align=False):
        dec_in = tgt[:, :-1, :]
        enc_out, enc_final_hs, src_len = self.encoder(src, src_len)
        if not bptt:
            self.decoder.init_state(src, enc_out, enc_final_hs)
        dec_out, attns = self.decoder(dec_in, enc_out, src_len=src_len, with_align=with_align)
        return dec_out, attns


PAD, BOS, EOS = 1, 2, 3
VOCAB, D, HEADS, DFF, LAYERS = 24, 32, 4, 64, 2


def translate_batch(model, generator, src, src_len, max_length=6):
    """Greedy decoding as onmt.translate.Translator runs it (no early removal of finished rows)."""
    enc_out, enc_final_hs, src_len = model.encoder(src, src_len)
    model.decoder.init_state(src, enc_out, enc_final_hs)
    alive = torch.full((src.size(0), 1), BOS, dtype=torch.long)
    for step in range(max_length):
        decoder_input = alive[:, -1].view(-1, 1, 1)
        dec_out, dec_attn = model.decoder(decoder_input, enc_out, src_len=src_len, step=step)
        log_probs = generator(dec_out.squeeze(1))
        alive = torch.cat([alive, log_probs.argmax(-1, keepdim=True)], 1)
    return alive[:, 1:]


def main():
    torch.manual_seed(0)
    src_emb = Embeddings(D, VOCAB, PAD)
    tgt_emb = Embeddings(D, VOCAB, PAD)
    encoder = TransformerEncoder(LAYERS, D, HEADS, DFF, src_emb)
    decoder = TransformerDecoder(LAYERS, D, HEADS, DFF, tgt_emb, self_attn_type="average")
    model = NMTModel(encoder, decoder)
    generator = nn.Sequential(nn.Linear(D, VOCAB), nn.LogSoftmax(dim=-1))
    model.eval()
    generator.eval()

    # validation batch: translated (in-training validation with a translator, or a translate-then-score script)
    valid_src = torch.tensor([[5, 9, 7, 11, 4, 3], [12, 6, 8, 3, PAD, PAD]]).unsqueeze(-1)
    valid_len = torch.tensor([6, 4])
    # next batch scored with teacher forcing (step=None)
    src = torch.tensor([[14, 10, 15, 6, 9, 3], [8, 17, 3, PAD, PAD, PAD]]).unsqueeze(-1)
    src_len = torch.tensor([6, 3])
    tgt = torch.tensor([[BOS, 7, 9, 13, 3, PAD], [BOS, 19, 5, 3, PAD, PAD]]).unsqueeze(-1)

    with torch.no_grad():
        hyps = translate_batch(model, generator, valid_src, valid_len)
        print("valid hyps:", hyps.tolist())
        dec_out, attns = model(src, tgt, src_len)
        log_probs = generator(dec_out)
        gold = tgt[:, 1:, 0]
        loss = nn.NLLLoss(ignore_index=PAD, reduction="sum")(log_probs.reshape(-1, VOCAB), gold.reshape(-1))
        n_words = gold.ne(PAD).sum()
    print("scored batch: loss/word %.6f, ppl %.4f" % (loss.item() / n_words.item(), math.exp(loss.item() / n_words.item())))
    print("first row context attention, step 0:", [round(x, 4) for x in attns["std"][0, 0].tolist()])


if __name__ == "__main__":
    main()
