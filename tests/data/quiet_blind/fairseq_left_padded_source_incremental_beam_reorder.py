"""fairseq translation: LEFT-padded source, incremental decoder state reordered by index_select in beam search.

Follows facebookresearch/fairseq (recalled, named at the stored versions):
fairseq/models/transformer/transformer_encoder.py@e853a2d157cb5dd7ae6a8ccfc20915fc2cbeb55e
(encoder_padding_mask = src_tokens.eq(padding_idx); padded rows zeroed; reorder_encoder_out index_select),
fairseq/models/transformer/transformer_decoder.py@96b5e0a1f364925384ceca663e160c695ca57c86
(self_attn_mask only when incremental_state is None; positions[:, -1:] when incremental),
fairseq/modules/multihead_attention.py (prev_key / prev_value in incremental_state, reorder_incremental_state),
fairseq/utils.py make_positions and fairseq/sequence_generator.py (new_order from beam expansion, reorder each step).
The translation task's default is left_pad_source=True, so padding is at the START of short sources and
positions count only real tokens (cumsum of the non-pad mask, offset by padding_idx).
Masks: encoder self-attention and decoder cross-attention hide the padded source keys (key_padding_mask), every
query, including the decoder's 5 steps for a 3-token source; decoder self-attention is causal when given the whole
prefix, and unmasked when decoding one token against the cache (the cache holds only the past).
After each step the cache rows are reordered with index_select so each beam continues its own parent's keys.
"""
import math

import torch
from torch import nn
import torch.nn.functional as F

PAD, EOS = 1, 2


def make_positions(tensor, padding_idx):
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


def sinusoidal(num, dim):
    half = dim // 2
    emb = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    emb = torch.arange(num, dtype=torch.float)[:, None] * emb[None]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    emb[PAD] = 0
    return emb


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, self_attention=False):
        super().__init__()
        self.num_heads = num_heads
        self.self_attention = self_attention
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, attn_mask=None):
        # Time x Batch x Channel, as fairseq
        tgt_len, bsz, d = query.shape
        h = self.num_heads
        q = self.q_proj(query)
        k, v = self.k_proj(key), self.v_proj(value)

        def shape(x):
            return x.contiguous().view(-1, bsz, h, d // h).permute(1, 2, 0, 3)

        q, k, v = shape(q), shape(k), shape(v)
        if incremental_state is not None and self.self_attention:
            if "prev_key" in incremental_state:
                k = torch.cat([incremental_state["prev_key"], k], dim=2)
                v = torch.cat([incremental_state["prev_value"], v], dim=2)
            incremental_state["prev_key"], incremental_state["prev_value"] = k, v
        mask = None
        if attn_mask is not None:
            mask = attn_mask[None, None]
        if key_padding_mask is not None:
            kp = ~key_padding_mask[:, None, None, :]
            mask = kp if mask is None else mask & kp
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, d))


class TransformerEncoder(nn.Module):
    def __init__(self, vocab, d, heads):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d, padding_idx=PAD)
        self.embed_scale = math.sqrt(d)
        self.register_buffer("pos", sinusoidal(64, d))
        self.self_attn = MultiheadAttention(d, heads, self_attention=True)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, src_tokens):
        encoder_padding_mask = src_tokens.eq(PAD)
        x = self.embed_scale * self.embed_tokens(src_tokens) + self.pos[make_positions(src_tokens, PAD)]
        # account for padding while computing the representation
        x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))
        x = x.transpose(0, 1)
        x = self.ln1(x + self.self_attn(x, x, x, key_padding_mask=encoder_padding_mask))
        x = self.ln2(x + self.fc(x))
        return {"encoder_out": x, "encoder_padding_mask": encoder_padding_mask}

    def reorder_encoder_out(self, encoder_out, new_order):
        return {"encoder_out": encoder_out["encoder_out"].index_select(1, new_order),
                "encoder_padding_mask": encoder_out["encoder_padding_mask"].index_select(0, new_order)}


class TransformerDecoder(nn.Module):
    def __init__(self, vocab, d, heads):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d, padding_idx=PAD)
        self.embed_scale = math.sqrt(d)
        self.register_buffer("pos", sinusoidal(64, d))
        self.self_attn = MultiheadAttention(d, heads, self_attention=True)
        self.encoder_attn = MultiheadAttention(d, heads)
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.output_projection = nn.Linear(d, vocab, bias=False)

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        return torch.tril(torch.ones(dim, dim, dtype=torch.bool))

    def forward(self, prev_output_tokens, encoder_out, incremental_state=None):
        positions = make_positions(prev_output_tokens, PAD)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            positions = positions[:, -1:]
        x = self.embed_scale * self.embed_tokens(prev_output_tokens) + self.pos[positions]
        x = x.transpose(0, 1)
        self_attn_mask = self.buffered_future_mask(x) if incremental_state is None else None
        x = self.ln1(x + self.self_attn(x, x, x, incremental_state=incremental_state, attn_mask=self_attn_mask))
        enc = encoder_out["encoder_out"]
        x = self.ln2(x + self.encoder_attn(x, enc, enc, key_padding_mask=encoder_out["encoder_padding_mask"]))
        x = self.ln3(x + self.fc(x))
        return self.output_projection(x.transpose(0, 1))

    def reorder_incremental_state(self, incremental_state, new_order):
        for key in ("prev_key", "prev_value"):
            if key in incremental_state:
                incremental_state[key] = incremental_state[key].index_select(0, new_order)


@torch.no_grad()
def beam_search(encoder, decoder, src_tokens, beam_size, max_len):
    bsz = src_tokens.size(0)
    encoder_out = encoder(src_tokens)
    new_order = torch.arange(bsz).view(-1, 1).repeat(1, beam_size).view(-1)
    encoder_out = encoder.reorder_encoder_out(encoder_out, new_order)
    tokens = torch.full((bsz * beam_size, 1), EOS)
    scores = torch.zeros(bsz, beam_size)
    incremental_state = {}
    for step in range(max_len):
        lprobs = F.log_softmax(decoder(tokens, encoder_out, incremental_state)[:, -1], dim=-1)
        lprobs[:, PAD] = -math.inf
        if step == 0:  # all beams identical at the start: keep only beam 0's candidates
            lprobs.view(bsz, beam_size, -1)[:, 1:] = -math.inf
        cand = (scores.view(-1, 1) + lprobs).view(bsz, -1)
        top_scores, top_idx = cand.topk(beam_size, dim=-1)
        vocab = lprobs.size(-1)
        beams = top_idx // vocab
        words = top_idx % vocab
        reorder_state = (beams + torch.arange(bsz)[:, None] * beam_size).view(-1)
        decoder.reorder_incremental_state(incremental_state, reorder_state)
        tokens = torch.cat([tokens.index_select(0, reorder_state), words.view(-1, 1)], dim=1)
        scores = top_scores
    return tokens, scores, encoder_out


def main():
    torch.manual_seed(0)
    vocab, d, heads = 20, 16, 4
    encoder = TransformerEncoder(vocab, d, heads).eval()
    decoder = TransformerDecoder(vocab, d, heads).eval()
    # left_pad_source=True: the short sentence is padded at the start
    src_tokens = torch.tensor([[5, 6, 7, 8, 9, EOS], [PAD, PAD, PAD, 11, 12, EOS]])
    tokens, scores, encoder_out = beam_search(encoder, decoder, src_tokens, beam_size=2, max_len=5)

    # Independent check: rescore every final hypothesis with the full causal (non-incremental) decoder.
    with torch.no_grad():
        logits = decoder(tokens[:, :-1], encoder_out)
        lp = F.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0].sum(-1)
        assert torch.allclose(lp.view(2, 2), scores, atol=1e-4), (lp, scores)
        # The left-padded source translates as it does with no padding at all.
        alone, alone_scores, _ = beam_search(encoder, decoder, src_tokens[1:, 3:], beam_size=2, max_len=5)
    assert torch.equal(alone, tokens[2:]) and torch.allclose(alone_scores, scores[1:], atol=1e-4)
    print("fairseq beam search ok:", tokens[0].tolist())


if __name__ == "__main__":
    main()
