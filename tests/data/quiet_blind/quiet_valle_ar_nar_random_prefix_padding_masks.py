"""VALL-E training forward (AR + NAR stages, prefix_mode=2), ported small from lifeiteng/vall-e.

Citation: lifeiteng/vall-e @034f0698e1947a82a14ada748ddb7792d3db4e3d valle/models/valle.py
  (VALLE.forward: x_mask / y_mask from make_pad_mask, xy_padding_mask, x_attn_mask, y_attn_mask,
   the merged (bsz * num_heads, src_len, src_len) float -inf mask for the AR decoder, and the NAR
   random-prefix branch with xy_padding_mask = cat([x_mask, F.pad(y_mask, (prefix, 0), False)]));
  valle/modules/transformer.py (TransformerEncoderLayer with (x, stage_embedding) tuples,
   AdaptiveLayerNorm, LayerNorm, TransformerEncoder); valle/modules/embedding.py
   (TokenEmbedding, SinePositionalEmbedding); icefall.utils.make_pad_mask.
  valle's MultiheadAttention (modules/activation.py, a copy of torch's) is torch.nn.MultiheadAttention here.

The batch is right-padded twice over: text x (x_lens) and audio y (y_lens).  AR stage: text
tokens see all (real) text, audio tokens see all text and audio up to themselves; key padding of
both parts is OR-ed in per head.  NAR stage: [text | acoustic prompt segment | audio] attended both
ways, with padding keys after the text (in the middle of the row) and after the audio.

Check: every real position's logits and the NAR loss equal an independent computation of each
sample alone, unpadded, with a per-query loop over the keys it may see.
"""
import copy
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

NUM_TEXT_TOKENS = 20     # 128
NUM_AUDIO_TOKENS = 24    # 1024


def make_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    """icefall.utils.make_pad_mask: True at padded positions."""
    assert lengths.ndim == 1, lengths.ndim
    max_len = max(max_len, lengths.max())
    n = lengths.size(0)
    seq_range = torch.arange(0, max_len, device=lengths.device)
    expaned_lengths = seq_range.unsqueeze(0).expand(n, max_len)
    return expaned_lengths >= lengths.unsqueeze(-1)


class TokenEmbedding(nn.Module):
    def __init__(self, dim_model, vocab_size, dropout=0.0):
        super().__init__()
        self.vocab_size = vocab_size
        self.dim_model = dim_model
        self.dropout = torch.nn.Dropout(p=dropout)
        self.word_embeddings = nn.Embedding(self.vocab_size, self.dim_model)

    @property
    def weight(self):
        return self.word_embeddings.weight

    def forward(self, x):
        return self.dropout(self.word_embeddings(x))


class SinePositionalEmbedding(nn.Module):
    def __init__(self, dim_model, dropout=0.0, scale=False, alpha=False):
        super().__init__()
        self.dim_model = dim_model
        self.x_scale = math.sqrt(dim_model) if scale else 1.0
        self.alpha = nn.Parameter(torch.ones(1), requires_grad=alpha)
        self.dropout = torch.nn.Dropout(p=dropout)
        self.pe = None
        self.extend_pe(torch.tensor(0.0).expand(1, 400))

    def extend_pe(self, x):
        if self.pe is not None and self.pe.size(1) >= x.size(1):
            return
        pe = torch.zeros(x.size(1), self.dim_model)
        position = torch.arange(0, x.size(1), dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, self.dim_model, 2, dtype=torch.float32) * -(math.log(10000.0) / self.dim_model)
        )
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.pe = pe.unsqueeze(0)

    def forward(self, x):
        self.extend_pe(x)
        output = x.unsqueeze(-1) if x.ndim == 2 else x
        output = output * self.x_scale + self.alpha * self.pe[:, : x.size(1)]
        return self.dropout(output)


class LayerNorm(nn.LayerNorm):
    def forward(self, input, embedding=None):
        if isinstance(input, tuple):
            input, embedding = input
            return (super().forward(input), embedding)
        assert embedding is None
        return super().forward(input)


class AdaptiveLayerNorm(nn.Module):
    def __init__(self, d_model, norm):
        super().__init__()
        self.project_layer = nn.Linear(d_model, 2 * d_model)
        self.norm = norm
        self.d_model = d_model
        self.eps = self.norm.eps

    def forward(self, input, embedding=None):
        if isinstance(input, tuple):
            input, embedding = input
            weight, bias = torch.split(self.project_layer(embedding), split_size_or_sections=self.d_model, dim=-1)
            return (weight * self.norm(input) + bias, embedding)
        weight, bias = torch.split(self.project_layer(embedding), split_size_or_sections=self.d_model, dim=-1)
        return weight * self.norm(input) + bias


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.1, batch_first=True, norm_first=True,
                 adaptive_layer_norm=False):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=batch_first)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm_first = norm_first
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = F.relu
        if adaptive_layer_norm:
            self.norm1 = AdaptiveLayerNorm(d_model, LayerNorm(d_model))
            self.norm2 = AdaptiveLayerNorm(d_model, LayerNorm(d_model))
        else:
            self.norm1 = LayerNorm(d_model)
            self.norm2 = LayerNorm(d_model)

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        if src_key_padding_mask is not None:
            _skpm_dtype = src_key_padding_mask.dtype
            if _skpm_dtype != torch.bool and not torch.is_floating_point(src_key_padding_mask):
                raise AssertionError("only bool and floating types of key_padding_mask are supported")
        x, stage_embedding = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x, stage_embedding), src_mask, src_key_padding_mask)
            x = x + self._ff_block(self.norm2(x, stage_embedding))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask), stage_embedding)
            x = self.norm2(x + self._ff_block(x), stage_embedding)
        return (x, stage_embedding)

    def _sa_block(self, x, attn_mask, key_padding_mask):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class TransformerEncoder(nn.Module):
    def __init__(self, encoder_layer, num_layers, norm=None):
        super().__init__()
        self.layers = nn.ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, src, mask=None, src_key_padding_mask=None):
        output = src
        for mod in self.layers:
            output = mod(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask)
        if self.norm is not None:
            output = self.norm(output)
        return output


class VALLE(nn.Module):
    def __init__(self, d_model, nhead, num_layers, norm_first=True, prefix_mode=2):
        super().__init__()
        self.text_embedding = TokenEmbedding(d_model, NUM_TEXT_TOKENS)
        self.ar_embedding = TokenEmbedding(d_model, NUM_AUDIO_TOKENS + 1)
        self.nar_embeddings = nn.ModuleList(
            [TokenEmbedding(d_model, NUM_AUDIO_TOKENS + 1)]
            + [TokenEmbedding(d_model, NUM_AUDIO_TOKENS) for i in range(7)]
        )
        self.text_prenet = nn.Identity()
        self.audio_prenet = nn.Identity()
        self.text_position = SinePositionalEmbedding(d_model, dropout=0.1, scale=False)
        self.audio_positions = nn.ModuleList(
            [SinePositionalEmbedding(d_model, dropout=0.1, scale=False) for i in range(8)]
        )
        self.stage_embeddings = nn.ModuleList([TokenEmbedding(d_model, 1) for i in range(8)])
        self.ar_decoder = TransformerEncoder(
            TransformerEncoderLayer(d_model, nhead, dim_feedforward=d_model * 4, dropout=0.1,
                                    batch_first=True, norm_first=norm_first),
            num_layers=num_layers,
            norm=LayerNorm(d_model) if norm_first else None,
        )
        self.num_heads = nhead
        self.nar_decoder = TransformerEncoder(
            TransformerEncoderLayer(d_model, nhead, dim_feedforward=d_model * 4, dropout=0.1,
                                    batch_first=True, norm_first=norm_first, adaptive_layer_norm=True),
            num_layers=num_layers,
            norm=AdaptiveLayerNorm(d_model, norm=nn.LayerNorm(d_model)) if norm_first else None,
        )
        self.prefix_mode = prefix_mode
        self.predict_layers = nn.ModuleList(
            [nn.Linear(d_model, NUM_AUDIO_TOKENS + 1, bias=False)]
            + [nn.Linear(d_model, NUM_AUDIO_TOKENS, bias=False) for i in range(7)]
        )
        self.predict_layers[0].weight = self.ar_embedding.weight
        for j in range(1, 7):
            self.predict_layers[j].weight = self.nar_embeddings[j + 1].weight
        self.rng = random.Random(0)

    def forward(self, x, x_lens, y, y_lens, reduction="sum"):
        assert x.ndim == 2 and x_lens.ndim == 1 and y.ndim == 3 and y_lens.ndim == 1
        assert torch.all(x_lens > 0)

        x_mask = make_pad_mask(x_lens).to(x.device)
        x = self.text_embedding(x)
        x = self.text_prenet(x)
        x = self.text_position(x)

        y_mask = make_pad_mask(y_lens).to(y.device)
        y_mask_int = y_mask.type(torch.int64)
        codes = y.type(torch.int64) * (1 - y_mask_int.unsqueeze(dim=-1))

        x_len = x_lens.max()
        y_len = y_lens.max()

        xy_padding_mask = torch.concat([x_mask, y_mask], dim=1)

        x_attn_mask = F.pad(
            torch.zeros((x_len, x_len), dtype=torch.bool, device=x.device),
            (0, y_len),
            value=True,
        )
        y_attn_mask = F.pad(
            torch.triu(torch.ones(y_len, y_len, dtype=torch.bool, device=x.device), diagonal=1),
            (x_len, 0),
            value=False,
        )
        xy_attn_mask = torch.concat([x_attn_mask, y_attn_mask], dim=0)

        # merge key padding and attention masks
        bsz, src_len = x.shape[0], x_len + y_len
        _xy_padding_mask = (
            xy_padding_mask.view(bsz, 1, 1, src_len)
            .expand(-1, self.num_heads, -1, -1)
            .reshape(bsz * self.num_heads, 1, src_len)
        )
        xy_attn_mask = xy_attn_mask.logical_or(_xy_padding_mask)

        new_attn_mask = torch.zeros_like(xy_attn_mask, dtype=x.dtype)
        new_attn_mask.masked_fill_(xy_attn_mask, float("-inf"))
        xy_attn_mask = new_attn_mask

        # AR Decoder
        def pad_y_eos(y, eos_id):
            y = F.pad(y, (0, 1)) + eos_id * F.pad(y_mask_int, (0, 1), value=1)
            return y[:, :-1], y[:, 1:]

        y, targets = pad_y_eos(codes[..., 0], eos_id=NUM_AUDIO_TOKENS)
        y_emb = self.ar_embedding(y)
        y_emb = self.audio_prenet(y_emb)
        y_pos = self.audio_positions[0](y_emb)
        xy_pos = torch.concat([x, y_pos], dim=1)
        xy_dec, _ = self.ar_decoder((xy_pos, None), mask=xy_attn_mask)
        ar_logits = self.predict_layers[0](xy_dec[:, x_len:]).permute(0, 2, 1)
        total_loss = F.cross_entropy(ar_logits, targets, reduction=reduction)

        # Non-AR Decoders
        train_stage = self.rng.choices((1, 2, 3, 4, 5, 6, 7), weights=[1.0 / 7] * 7, k=1)[0]
        prompts_len = x_len
        targets = codes[..., train_stage] + NUM_AUDIO_TOKENS * y_mask_int
        assert self.prefix_mode == 2
        # random prefix
        min_y_len = y_lens.min().item()
        prefix_start = torch.randint(0, int(0.75 * min_y_len), size=()).item()
        prefix_end = torch.randint(
            prefix_start + int(0.25 * min_y_len),
            prefix_start + int(0.30 * min_y_len) + 1,
            size=(),
        ).item()
        prefix_end = min(prefix_end, min_y_len)
        assert prefix_end > prefix_start

        y_prompts = self.nar_embeddings[0](y[:, prefix_start:prefix_end])
        y_emb = self.nar_embeddings[0](y)
        for j in range(1, 8):
            y_prompts += self.nar_embeddings[j](codes[:, prefix_start:prefix_end, j])
            if j < train_stage:
                y_emb += self.nar_embeddings[j](codes[..., j])
        y_emb = torch.concat([y_prompts, y_emb], axis=1)

        prompts_len += prefix_end - prefix_start
        xy_padding_mask = torch.concat(
            [x_mask, F.pad(y_mask, (prefix_end - prefix_start, 0), value=False)],
            dim=1,
        )
        prefix_len = 0

        y_pos = self.audio_positions[train_stage](y_emb)
        xy_pos = torch.concat([x, y_pos], dim=1)
        xy_dec, _ = self.nar_decoder(
            (xy_pos, self.stage_embeddings[train_stage].weight),
            src_key_padding_mask=xy_padding_mask,
        )
        nar_logits = self.predict_layers[train_stage](xy_dec[:, prompts_len:]).permute(0, 2, 1)
        total_length = (y_lens).sum().type(torch.float32)
        nar_loss = F.cross_entropy(
            nar_logits, targets, ignore_index=NUM_AUDIO_TOKENS, reduction=reduction
        ) * (total_length / (total_length - prefix_len * bsz))
        total_loss = total_loss + nar_loss
        draws = dict(train_stage=train_stage, prefix_start=prefix_start, prefix_end=prefix_end)
        return ar_logits, nar_logits, nar_loss, total_loss / 2.0, draws


# ------------------------------------------------------------------ independent reference
def loop_mha(mha, x, allowed):
    """x: (T, D); allowed(i) -> list of key indices query i may read."""
    D = x.shape[-1]
    H = mha.num_heads
    hs = D // H
    W, b = mha.in_proj_weight, mha.in_proj_bias
    q = x @ W[:D].T + b[:D]
    k = x @ W[D:2 * D].T + b[D:2 * D]
    v = x @ W[2 * D:].T + b[2 * D:]
    out = torch.zeros_like(x)
    for h in range(H):
        sl = slice(h * hs, (h + 1) * hs)
        for i in range(x.shape[0]):
            keys = allowed(i)
            s = torch.stack([(q[i, sl] * k[j, sl]).sum() for j in keys]) / math.sqrt(hs)
            p = torch.softmax(s, dim=0)
            out[i, sl] = sum(p[n] * v[j, sl] for n, j in enumerate(keys))
    return mha.out_proj(out)


def loop_stack(decoder, x, stage_emb, allowed):
    for layer in decoder.layers:
        n1 = layer.norm1(x, stage_emb) if stage_emb is not None else layer.norm1(x)
        x = x + loop_mha(layer.self_attn, n1, allowed)
        n2 = layer.norm2(x, stage_emb) if stage_emb is not None else layer.norm2(x)
        x = x + layer._ff_block(n2)
    return decoder.norm(x, stage_emb) if stage_emb is not None else decoder.norm(x)


def reference_one(model, x_tok, y_codes, draws):
    """One sample, no padding at all."""
    m = model
    tx, ty = x_tok.shape[0], y_codes.shape[0]
    x = m.text_position(m.text_embedding(x_tok)[None])[0]
    # AR: inputs [c0 .. c_{n-1}], targets [c1 .. c_{n-1}, eos]
    y_in = y_codes[:, 0]
    y_pos = m.audio_positions[0](m.ar_embedding(y_in)[None])[0]
    xy = torch.cat([x, y_pos], 0)

    def ar_allowed(i):
        return list(range(tx)) if i < tx else list(range(i + 1))

    ar_dec = loop_stack(m.ar_decoder, xy, None, ar_allowed)
    ar_logits = m.predict_layers[0](ar_dec[tx:])

    stage, ps, pe = draws["train_stage"], draws["prefix_start"], draws["prefix_end"]
    y_prompts = m.nar_embeddings[0](y_in[ps:pe])
    y_emb = m.nar_embeddings[0](y_in)
    for j in range(1, 8):
        y_prompts = y_prompts + m.nar_embeddings[j](y_codes[ps:pe, j])
        if j < stage:
            y_emb = y_emb + m.nar_embeddings[j](y_codes[:, j])
    y_emb = torch.cat([y_prompts, y_emb], 0)
    y_pos = m.audio_positions[stage](y_emb[None])[0]
    xy = torch.cat([x, y_pos], 0)
    T = xy.shape[0]
    nar_dec = loop_stack(m.nar_decoder, xy, m.stage_embeddings[stage].weight, lambda i: list(range(T)))
    nar_logits = m.predict_layers[stage](nar_dec[tx + (pe - ps):])
    nar_loss = F.cross_entropy(nar_logits, y_codes[:, stage], reduction="sum")
    return ar_logits, nar_logits, nar_loss


def main():
    model = VALLE(d_model=32, nhead=4, num_layers=2, prefix_mode=2).eval()
    x_lens = torch.tensor([7, 4, 6])
    y_lens = torch.tensor([12, 10, 9])
    B = 3
    x = torch.randint(0, NUM_TEXT_TOKENS, (B, int(x_lens.max())))
    y = torch.randint(0, NUM_AUDIO_TOKENS, (B, int(y_lens.max()), 8))
    # collater padding values (masked anyway): text pad id 0, audio codes garbage beyond y_lens
    for b in range(B):
        x[b, x_lens[b]:] = 0
        y[b, y_lens[b]:] = NUM_AUDIO_TOKENS - 1

    with torch.no_grad():
        ar_logits, nar_logits, nar_loss, _, draws = model(x, x_lens, y, y_lens)
        print("draws:", draws)
        ok = True
        ref_nar_total = 0.0
        for b in range(B):
            xl, yl = int(x_lens[b]), int(y_lens[b])
            r_ar, r_nar, r_loss = reference_one(model, x[b, :xl], y[b, :yl], draws)
            a = torch.allclose(ar_logits[b, :, :yl].T, r_ar, atol=1e-4, rtol=1e-4)
            n = torch.allclose(nar_logits[b, :, :yl].T, r_nar, atol=1e-4, rtol=1e-4)
            print(f"sample {b}: AR logits {'match' if a else 'MISMATCH'}, NAR logits {'match' if n else 'MISMATCH'}")
            ok &= a and n
            ref_nar_total = ref_nar_total + r_loss
        l_ok = torch.allclose(nar_loss, ref_nar_total, atol=1e-3, rtol=1e-4)
        print(f"NAR loss batch {nar_loss.item():.5f} vs per-sample {float(ref_nar_total):.5f}: "
              f"{'match' if l_ok else 'MISMATCH'}")
        ok &= l_ok
    print("ALL MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
