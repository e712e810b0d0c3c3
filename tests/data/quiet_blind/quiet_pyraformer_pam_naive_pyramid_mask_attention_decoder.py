"""Pyraformer (ant-research/Pyraformer) long-range forecasting model, PAM-Naive path, shrunk.

Ported from pyraformer/Layers.py (get_mask, get_subsequent_mask, Bottleneck_Construct,
EncoderLayer, DecoderLayer, Decoder), pyraformer/SubLayers.py (MultiHeadAttention),
pyraformer/Modules.py (ScaledDotProductAttention) and pyraformer/Pyraformer_LR.py
(Encoder, Model with decoder='attention', truncate=False).

The encoder runs dense attention over the concatenated pyramid (fine scale + coarser
scales made by strided convolutions).  get_mask builds a bool mask, True = masked,
filled with -1e9 before the softmax: each node sees its neighbours within inner_size//2
on its own scale, its children on the finer scale and its parent on the coarser scale;
the last coarse node also owns the fine nodes left over by the floor division.
The attention decoder's first layer cross-attends the whole pyramid unmasked; the second
layer attends [pyramid ; decoder tokens] with get_subsequent_mask (decoder step i sees the
whole pyramid and decoder steps 0..i).

Checks: the mask against an independent pyramid-graph definition, every attention output
against a per-query loop over only the allowed keys, and the decoder's causality by
recomputing each prefix of the decoder input on its own.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.linear import Linear

torch.manual_seed(0)


# ---------------------------------------------------------------- Layers.py masks
def get_mask(input_size, window_size, inner_size, device):
    """Get the attention mask of PAM-Naive"""
    all_size = []
    all_size.append(input_size)
    for i in range(len(window_size)):
        layer_size = math.floor(all_size[i] / window_size[i])
        all_size.append(layer_size)

    seq_length = sum(all_size)
    mask = torch.zeros(seq_length, seq_length, device=device)

    # get intra-scale mask
    inner_window = inner_size // 2
    for layer_idx in range(len(all_size)):
        start = sum(all_size[:layer_idx])
        for i in range(start, start + all_size[layer_idx]):
            left_side = max(i - inner_window, start)
            right_side = min(i + inner_window + 1, start + all_size[layer_idx])
            mask[i, left_side:right_side] = 1

    # get inter-scale mask
    for layer_idx in range(1, len(all_size)):
        start = sum(all_size[:layer_idx])
        for i in range(start, start + all_size[layer_idx]):
            left_side = (start - all_size[layer_idx - 1]) + (i - start) * window_size[layer_idx - 1]
            if i == (start + all_size[layer_idx] - 1):
                right_side = start
            else:
                right_side = (start - all_size[layer_idx - 1]) + (i - start + 1) * window_size[layer_idx - 1]
            mask[i, left_side:right_side] = 1
            mask[left_side:right_side, i] = 1

    mask = (1 - mask).bool()

    return mask, all_size


def get_subsequent_mask(input_size, window_size, predict_step, truncate):
    """Get causal attention mask for decoder."""
    if truncate:
        mask = torch.zeros(predict_step, input_size + predict_step)
        for i in range(predict_step):
            mask[i][:input_size + i + 1] = 1
        mask = (1 - mask).bool().unsqueeze(0)
    else:
        all_size = []
        all_size.append(input_size)
        for i in range(len(window_size)):
            layer_size = math.floor(all_size[i] / window_size[i])
            all_size.append(layer_size)
        all_size = sum(all_size)
        mask = torch.zeros(predict_step, all_size + predict_step)
        for i in range(predict_step):
            mask[i][:all_size + i + 1] = 1
        mask = (1 - mask).bool().unsqueeze(0)

    return mask


# ---------------------------------------------------------------- Modules.py / SubLayers.py
class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature, attn_dropout=0.2):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(attn_dropout)

    def forward(self, q, k, v, mask=None):
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))
        if mask is not None:
            attn = attn.masked_fill(mask, -1e9)
        attn = self.dropout(F.softmax(attn, dim=-1))
        output = torch.matmul(attn, v)
        return output, attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1, normalize_before=True):
        super().__init__()
        self.normalize_before = normalize_before
        self.n_head = n_head
        self.d_k = d_k
        self.d_v = d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_v, bias=False)
        nn.init.xavier_uniform_(self.w_qs.weight)
        nn.init.xavier_uniform_(self.w_ks.weight)
        nn.init.xavier_uniform_(self.w_vs.weight)
        self.fc = nn.Linear(d_v * n_head, d_model)
        nn.init.xavier_uniform_(self.fc.weight)
        self.attention = ScaledDotProductAttention(temperature=d_k ** 0.5, attn_dropout=dropout)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        d_k, d_v, n_head = self.d_k, self.d_v, self.n_head
        sz_b, len_q, len_k, len_v = q.size(0), q.size(1), k.size(1), v.size(1)
        residual = q
        if self.normalize_before:
            q = self.layer_norm(q)
        q = self.w_qs(q).view(sz_b, len_q, n_head, d_k)
        k = self.w_ks(k).view(sz_b, len_k, n_head, d_k)
        v = self.w_vs(v).view(sz_b, len_v, n_head, d_v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is not None:
            if len(mask.size()) == 3:
                mask = mask.unsqueeze(1)  # For head axis broadcasting.
        output, attn = self.attention(q, k, v, mask=mask)
        output = output.transpose(1, 2).contiguous().view(sz_b, len_q, -1)
        output = self.dropout(self.fc(output))
        output += residual
        if not self.normalize_before:
            output = self.layer_norm(output)
        return output, attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_in, d_hid, dropout=0.1, normalize_before=True):
        super().__init__()
        self.normalize_before = normalize_before
        self.w_1 = nn.Linear(d_in, d_hid)
        self.w_2 = nn.Linear(d_hid, d_in)
        self.layer_norm = nn.LayerNorm(d_in, eps=1e-6)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        residual = x
        if self.normalize_before:
            x = self.layer_norm(x)
        x = F.gelu(self.w_1(x))
        x = self.dropout(x)
        x = self.w_2(x)
        x = self.dropout(x)
        x = x + residual
        if not self.normalize_before:
            x = self.layer_norm(x)
        return x


class EncoderLayer(nn.Module):
    def __init__(self, d_model, d_inner, n_head, d_k, d_v, dropout=0.1, normalize_before=True):
        super().__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout,
                                           normalize_before=normalize_before)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner, dropout=dropout,
                                               normalize_before=normalize_before)

    def forward(self, enc_input, slf_attn_mask=None):
        enc_output, enc_slf_attn = self.slf_attn(enc_input, enc_input, enc_input, mask=slf_attn_mask)
        enc_output = self.pos_ffn(enc_output)
        return enc_output, enc_slf_attn


class DecoderLayer(nn.Module):
    def __init__(self, d_model, d_inner, n_head, d_k, d_v, dropout=0.1, normalize_before=True):
        super().__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout,
                                           normalize_before=normalize_before)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner, dropout=dropout,
                                               normalize_before=normalize_before)

    def forward(self, Q, K, V, slf_attn_mask=None):
        enc_output, enc_slf_attn = self.slf_attn(Q, K, V, mask=slf_attn_mask)
        enc_output = self.pos_ffn(enc_output)
        return enc_output, enc_slf_attn


class ConvLayer(nn.Module):
    def __init__(self, c_in, window_size):
        super().__init__()
        self.downConv = nn.Conv1d(in_channels=c_in, out_channels=c_in,
                                  kernel_size=window_size, stride=window_size)
        self.norm = nn.BatchNorm1d(c_in)
        self.activation = nn.ELU()

    def forward(self, x):
        return self.activation(self.norm(self.downConv(x)))


class Bottleneck_Construct(nn.Module):
    """Bottleneck convolution CSCM"""
    def __init__(self, d_model, window_size, d_inner):
        super().__init__()
        self.conv_layers = nn.ModuleList([ConvLayer(d_inner, w) for w in window_size])
        self.up = Linear(d_inner, d_model)
        self.down = Linear(d_model, d_inner)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, enc_input):
        temp_input = self.down(enc_input).permute(0, 2, 1)
        all_inputs = []
        for i in range(len(self.conv_layers)):
            temp_input = self.conv_layers[i](temp_input)
            all_inputs.append(temp_input)
        all_inputs = torch.cat(all_inputs, dim=2).transpose(1, 2)
        all_inputs = self.up(all_inputs)
        all_inputs = torch.cat([enc_input, all_inputs], dim=1)
        all_inputs = self.norm(all_inputs)
        return all_inputs


class DataEmbedding(nn.Module):
    """Value embedding + positional + time-feature embedding (shrunk embed.DataEmbedding)."""
    def __init__(self, c_in, d_model, n_mark=2, max_len=64):
        super().__init__()
        self.value = nn.Conv1d(c_in, d_model, kernel_size=3, padding=1, padding_mode="circular")
        self.mark = nn.Linear(n_mark, d_model)
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(max_len).float().unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x, x_mark):
        v = self.value(x.permute(0, 2, 1)).transpose(1, 2)
        return v + self.pe[:, : x.size(1)] + self.mark(x_mark)


class Opt:
    input_size = 13          # 13 -> 6 -> 3 -> 1 : remainders at every scale
    window_size = [2, 2, 3]
    inner_size = 3
    predict_step = 4
    d_model = 16
    d_inner_hid = 24
    n_head = 2
    d_k = 8
    d_v = 8
    d_bottleneck = 8
    n_layer = 2
    dropout = 0.1
    enc_in = 3
    truncate = False


class Encoder(nn.Module):
    def __init__(self, opt):
        super().__init__()
        self.mask, self.all_size = get_mask(opt.input_size, opt.window_size, opt.inner_size, "cpu")
        self.layers = nn.ModuleList([
            EncoderLayer(opt.d_model, opt.d_inner_hid, opt.n_head, opt.d_k, opt.d_v,
                         dropout=opt.dropout, normalize_before=False)
            for _ in range(opt.n_layer)])
        self.enc_embedding = DataEmbedding(opt.enc_in, opt.d_model)
        self.conv_layers = Bottleneck_Construct(opt.d_model, opt.window_size, opt.d_bottleneck)

    def forward(self, x_enc, x_mark_enc, trace=None):
        seq_enc = self.enc_embedding(x_enc, x_mark_enc)
        mask = self.mask.repeat(len(seq_enc), 1, 1).to(x_enc.device)
        seq_enc = self.conv_layers(seq_enc)
        for i in range(len(self.layers)):
            if trace is not None:
                trace.append(("enc", self.layers[i].slf_attn, seq_enc, seq_enc, mask))
            seq_enc, _ = self.layers[i](seq_enc, mask)
        return seq_enc


class Decoder(nn.Module):
    def __init__(self, opt, mask):
        super().__init__()
        self.mask = mask
        self.layers = nn.ModuleList([
            DecoderLayer(opt.d_model, opt.d_inner_hid, opt.n_head, opt.d_k, opt.d_v,
                         dropout=opt.dropout, normalize_before=False),
            DecoderLayer(opt.d_model, opt.d_inner_hid, opt.n_head, opt.d_k, opt.d_v,
                         dropout=opt.dropout, normalize_before=False)])
        self.dec_embedding = DataEmbedding(opt.enc_in, opt.d_model)

    def forward(self, x_dec, x_mark_dec, refer, trace=None):
        dec_enc = self.dec_embedding(x_dec, x_mark_dec)
        if trace is not None:
            trace.append(("dec0", self.layers[0].slf_attn, dec_enc, refer, None))
        dec_enc, _ = self.layers[0](dec_enc, refer, refer)
        refer_enc = torch.cat([refer, dec_enc], dim=1)
        mask = self.mask.repeat(len(dec_enc), 1, 1).to(dec_enc.device)
        if trace is not None:
            trace.append(("dec1", self.layers[1].slf_attn, dec_enc, refer_enc, mask))
        dec_enc, _ = self.layers[1](dec_enc, refer_enc, refer_enc, slf_attn_mask=mask)
        return dec_enc


class Model(nn.Module):
    def __init__(self, opt):
        super().__init__()
        self.input_size = opt.input_size
        self.encoder = Encoder(opt)
        mask = get_subsequent_mask(opt.input_size, opt.window_size, opt.predict_step, opt.truncate)
        self.decoder = Decoder(opt, mask)
        self.predictor = nn.Linear(opt.d_model, opt.enc_in, bias=False)

    def forward(self, x_enc, x_mark_enc, x_dec, x_mark_dec, pretrain, trace=None):
        enc_output = self.encoder(x_enc, x_mark_enc, trace)
        dec_enc = self.decoder(x_dec, x_mark_dec, enc_output, trace)
        if pretrain:
            dec_enc = torch.cat([enc_output[:, :self.input_size], dec_enc], dim=1)
        return self.predictor(dec_enc), dec_enc


# ---------------------------------------------------------------- independent references
def reference_pyramid_allowed(input_size, window_size, inner_size):
    """allowed[i, j] from the pyramid graph: same-scale neighbours, parent, children."""
    sizes = [input_size]
    for w in window_size:
        sizes.append(sizes[-1] // w)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    nodes = [(s, l) for s in range(len(sizes)) for l in range(sizes[s])]

    def parent(s, l):  # the coarse node of (s, l) on scale s + 1
        return (s + 1, min(l // window_size[s], sizes[s + 1] - 1))

    n = len(nodes)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for a, (sa, la) in enumerate(nodes):
        for b, (sb, lb) in enumerate(nodes):
            ok = sa == sb and abs(la - lb) <= inner_size // 2
            if sa + 1 == sb and parent(sa, la) == (sb, lb):
                ok = True
            if sb + 1 == sa and parent(sb, lb) == (sa, la):
                ok = True
            allowed[a, b] = ok
    return allowed, sizes


def loop_attention(mha, q_in, kv_in, allowed):
    """MultiHeadAttention (post-norm) with one softmax per query over its allowed keys only."""
    B, Lq, _ = q_in.shape
    H, dk = mha.n_head, mha.d_k
    q = mha.w_qs(q_in).view(B, Lq, H, dk)
    k = mha.w_ks(kv_in).view(B, kv_in.size(1), H, dk)
    v = mha.w_vs(kv_in).view(B, kv_in.size(1), H, mha.d_v)
    out = torch.zeros(B, Lq, H, mha.d_v)
    for b in range(B):
        for i in range(Lq):
            keys = [j for j in range(kv_in.size(1)) if allowed is None or allowed[i, j]]
            for h in range(H):
                s = torch.stack([(q[b, i, h] / dk ** 0.5) @ k[b, j, h] for j in keys])
                p = torch.softmax(s, dim=0)
                out[b, i, h] = sum(p[t] * v[b, keys[t], h] for t in range(len(keys)))
    o = mha.fc(out.reshape(B, Lq, -1)) + q_in
    return mha.layer_norm(o)


def main():
    opt = Opt()
    model = Model(opt).eval()

    # 1. the mask against the pyramid graph
    mask, all_size = get_mask(opt.input_size, opt.window_size, opt.inner_size, "cpu")
    allowed, sizes = reference_pyramid_allowed(opt.input_size, opt.window_size, opt.inner_size)
    mask_ok = all_size == sizes and torch.equal(~mask, allowed)
    rows_ok = bool((~mask).any(-1).all())
    print("pyramid sizes", all_size, "| mask matches pyramid graph:", mask_ok,
          "| every node keeps a key:", rows_ok)

    # 2. every attention call against the per-query loop over allowed keys
    B = 2
    x_enc = torch.randn(B, opt.input_size, opt.enc_in)
    m_enc = torch.randn(B, opt.input_size, 2)
    x_dec = torch.randn(B, opt.predict_step, opt.enc_in)
    m_dec = torch.randn(B, opt.predict_step, 2)
    trace = []
    with torch.no_grad():
        pred, dec_out = model(x_enc, m_enc, x_dec, m_dec, pretrain=False, trace=trace)
        n_pyr = sum(all_size)
        worst = 0.0
        for name, mha, q_in, kv_in, m in trace:
            got, _ = mha(q_in, kv_in, kv_in, mask=m)
            allowed_qk = None if m is None else ~m[0]
            if name == "dec1":
                ref_allowed = torch.zeros(opt.predict_step, n_pyr + opt.predict_step, dtype=torch.bool)
                for i in range(opt.predict_step):
                    ref_allowed[i, : n_pyr + i + 1] = True
                assert torch.equal(allowed_qk, ref_allowed)
            elif name == "enc":
                assert torch.equal(allowed_qk, allowed)
            ref = loop_attention(mha, q_in, kv_in, allowed_qk)
            worst = max(worst, (got - ref).abs().max().item())
        attn_ok = worst < 1e-5
        print("attention calls checked:", len(trace), "| max diff vs per-query loop: %.2e" % worst,
              "| match:", attn_ok)

        # 3. decoder causality: step i depends only on decoder inputs 0..i (and the pyramid)
        enc_output = model.encoder(x_enc, m_enc)
        causal_worst = 0.0
        full = model.decoder(x_dec, m_dec, enc_output)
        for i in range(opt.predict_step):
            x2 = x_dec.clone()
            m2 = m_dec.clone()
            x2[:, i + 1:] = torch.randn_like(x2[:, i + 1:]) * 5
            m2[:, i + 1:] = torch.randn_like(m2[:, i + 1:]) * 5
            # DataEmbedding's circular conv mixes neighbouring steps, so compare on the
            # embedded decoder input: feed the same embedding for steps <= i.
            emb_full = model.decoder.dec_embedding(x_dec, m_dec)
            emb_new = model.decoder.dec_embedding(x2, m2)
            emb_new[:, : i + 1] = emb_full[:, : i + 1]
            d, _ = model.decoder.layers[0](emb_new, enc_output, enc_output)
            r = torch.cat([enc_output, d], dim=1)
            d, _ = model.decoder.layers[1](d, r, r, slf_attn_mask=model.decoder.mask.repeat(B, 1, 1))
            causal_worst = max(causal_worst, (d[:, : i + 1] - full[:, : i + 1]).abs().max().item())
        causal_ok = causal_worst < 1e-5
        print("decoder prefix recompute max diff: %.2e | match: %s" % (causal_worst, causal_ok))

    ok = mask_ok and rows_ok and attn_ok and causal_ok and torch.isfinite(pred).all().item()
    print("pred shape", tuple(pred.shape))
    print("MATCH" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
