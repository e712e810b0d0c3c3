"""Levenshtein Transformer one refinement iteration: non-causal decoder, left-padded source, right-padded target.

Follows facebookresearch/fairseq fairseq/models/nat/levenshtein_transformer.py (LevenshteinTransformerDecoder
``extract_features`` / ``forward_mask_ins`` / ``forward_word_ins`` / ``forward_word_del`` and the model's
``forward_decoder`` with ``_apply_del_words`` / ``_apply_ins_masks`` / ``_apply_ins_words`` from
levenshtein_utils.py), https://github.com/facebookresearch/fairseq/tree/main/fairseq/models/nat, with fairseq's
LanguagePairDataset default ``left_pad_source=True``.

Mask meant: the decoder edits a whole draft at once, so its self-attention has NO future mask
(``self_attn_mask=None``); only target padding keys (``prev_output_tokens.eq(pad)``, right padding) are hidden.
Cross-attention hides the source padding keys, which sit on the LEFT of each source row. The encoder self-attention
is bidirectional with the same left-padding key mask.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, BOS, EOS, UNK = 1, 0, 2, 3


class FairseqLayer(nn.Module):
    def __init__(self, args, encoder_attn):
        super().__init__()
        d = args.decoder_embed_dim
        self.self_attn = nn.MultiheadAttention(d, args.decoder_attention_heads, batch_first=False)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = nn.MultiheadAttention(d, args.decoder_attention_heads) if encoder_attn else None
        self.encoder_attn_layer_norm = nn.LayerNorm(d) if encoder_attn else None
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, self_attn_padding_mask, encoder_out=None, encoder_padding_mask=None, self_attn_mask=None):
        # x is T x B x C, fairseq's layout.
        residual = x
        x, _ = self.self_attn(x, x, x, key_padding_mask=self_attn_padding_mask, attn_mask=self_attn_mask,
                              need_weights=False)
        x = self.self_attn_layer_norm(residual + x)
        if self.encoder_attn is not None:
            residual = x
            x, _ = self.encoder_attn(x, encoder_out, encoder_out, key_padding_mask=encoder_padding_mask,
                                     need_weights=False)
            x = self.encoder_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.relu(self.fc1(x)))
        return self.final_layer_norm(residual + x)


class TransformerEncoder(nn.Module):
    def __init__(self, args, vocab):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, args.encoder_embed_dim, padding_idx=PAD)
        self.embed_positions = nn.Embedding(64, args.encoder_embed_dim)
        self.layers = nn.ModuleList(FairseqLayer(args, encoder_attn=False) for _ in range(args.encoder_layers))

    def forward(self, src_tokens):
        encoder_padding_mask = src_tokens.eq(PAD)
        # fairseq make_positions: positions count only non-pad tokens, so left padding does not shift them.
        positions = (torch.cumsum(~encoder_padding_mask, dim=1) * ~encoder_padding_mask).long()
        x = self.embed_tokens(src_tokens) + self.embed_positions(positions)
        x = x.transpose(0, 1)
        for layer in self.layers:
            x = layer(x, encoder_padding_mask)
        return {"encoder_out": x, "encoder_padding_mask": encoder_padding_mask}


class LevenshteinTransformerDecoder(nn.Module):
    def __init__(self, args, vocab):
        super().__init__()
        d = args.decoder_embed_dim
        self.embed_tokens = nn.Embedding(vocab, d, padding_idx=PAD)
        self.embed_positions = nn.Embedding(64, d)
        self.layers = nn.ModuleList(FairseqLayer(args, encoder_attn=True) for _ in range(args.decoder_layers))
        self.output_projection = nn.Linear(d, vocab, bias=False)
        self.embed_mask_ins = nn.Linear(2 * d, 256)
        self.embed_word_del = nn.Linear(d, 2)

    def extract_features(self, prev_output_tokens, encoder_out):
        decoder_padding_mask = prev_output_tokens.eq(PAD)
        positions = (torch.cumsum(~decoder_padding_mask, dim=1) * ~decoder_padding_mask).long()
        x = self.embed_tokens(prev_output_tokens) + self.embed_positions(positions)
        x = x.transpose(0, 1)
        attn_inputs = []
        for layer in self.layers:
            attn_inputs.append(x)
            x = layer(x, decoder_padding_mask, encoder_out["encoder_out"], encoder_out["encoder_padding_mask"],
                      self_attn_mask=None)
        return x.transpose(0, 1), {"inner_states": attn_inputs, "padding_mask": decoder_padding_mask}

    def forward_mask_ins(self, prev_output_tokens, encoder_out):
        features, extra = self.extract_features(prev_output_tokens, encoder_out)
        features_cat = torch.cat([features[:, :-1, :], features[:, 1:, :]], 2)
        return F.linear(features_cat, self.embed_mask_ins.weight), extra

    def forward_word_ins(self, prev_output_tokens, encoder_out):
        features, extra = self.extract_features(prev_output_tokens, encoder_out)
        return self.output_projection(features), extra

    def forward_word_del(self, prev_output_tokens, encoder_out):
        features, extra = self.extract_features(prev_output_tokens, encoder_out)
        return F.linear(features, self.embed_word_del.weight), extra


def _apply_del_words(in_tokens, word_del_pred):
    # never delete <s>, </s> or padding
    word_del_pred = word_del_pred & in_tokens.ne(PAD) & in_tokens.ne(BOS) & in_tokens.ne(EOS)
    max_len = in_tokens.size(1)
    reordering = torch.arange(max_len).expand_as(in_tokens).masked_fill(word_del_pred, max_len).sort(1)[1]
    return in_tokens.masked_fill(word_del_pred, PAD).gather(1, reordering)


def _apply_ins_masks(in_tokens, mask_ins_pred):
    in_masks = in_tokens.ne(PAD)
    in_lengths = in_masks.sum(1)
    # fairseq's "HACK": turn the paddings into eos first, so that the padded slots, which scatter onto the
    # same output slot as the row's </s>, write </s> there again
    in_tokens = in_tokens.masked_fill(~in_masks, EOS)
    mask_ins_pred = mask_ins_pred.masked_fill(~in_masks[:, 1:], 0)
    out_lengths = in_lengths + mask_ins_pred.sum(1)
    out_max_len = int(out_lengths.max())
    out_masks = torch.arange(out_max_len)[None, :] < out_lengths[:, None]
    reordering = (mask_ins_pred + in_masks[:, 1:].long()).cumsum(1)
    out_tokens = torch.full((in_tokens.size(0), out_max_len), PAD, dtype=torch.long).masked_fill_(out_masks, UNK)
    out_tokens[:, 0] = in_tokens[:, 0]
    out_tokens.scatter_(1, reordering, in_tokens[:, 1:])
    return out_tokens


def masked_softmax_reference(q, k, v, key_pad):
    """Independent reference: softmax(q k^T / sqrt d) with padded keys set to -inf, per batch row."""
    scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
    scores = scores.masked_fill(key_pad[:, None, :], float("-inf"))
    return torch.softmax(scores, -1) @ v


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--encoder-embed-dim", type=int, default=32)
    parser.add_argument("--decoder-embed-dim", type=int, default=32)
    parser.add_argument("--decoder-attention-heads", type=int, default=1)
    parser.add_argument("--encoder-layers", type=int, default=1)
    parser.add_argument("--decoder-layers", type=int, default=2)
    args = parser.parse_args([])
    torch.manual_seed(0)
    vocab = 40
    encoder = TransformerEncoder(args, vocab).eval()
    decoder = LevenshteinTransformerDecoder(args, vocab).eval()

    # left-padded source (fairseq default left_pad_source=True)
    src_tokens = torch.tensor([[PAD, PAD, PAD, 11, 12, 13, EOS], [21, 22, 23, 24, 25, 26, EOS]])
    # current drafts, right-padded; row 1 is an empty draft <s></s>
    output_tokens = torch.tensor([[BOS, 30, 31, 32, 33, EOS], [BOS, EOS, PAD, PAD, PAD, PAD]])

    with torch.no_grad():
        encoder_out = encoder(src_tokens)
        # 1) deletion
        word_del_score, _ = decoder.forward_word_del(output_tokens, encoder_out)
        word_del_pred = word_del_score.max(-1)[1].bool()
        output_tokens = _apply_del_words(output_tokens, word_del_pred)
        # 2) placeholder insertion
        mask_ins_score, _ = decoder.forward_mask_ins(output_tokens, encoder_out)
        mask_ins_pred = mask_ins_score.max(-1)[1].clamp(max=3)
        output_tokens = _apply_ins_masks(output_tokens, mask_ins_pred)
        # 3) word insertion at the placeholders
        word_ins_score, extra = decoder.forward_word_ins(output_tokens, encoder_out)
        word_ins_pred = word_ins_score.max(-1)[1]
        output_tokens = output_tokens.masked_scatter(output_tokens.eq(UNK), word_ins_pred[output_tokens.eq(UNK)])

        # Check decoder layer 0 self-attention (single head, so MHA = projected masked softmax) on the last draft.
        layer = decoder.layers[0]
        x = extra["inner_states"][0]  # T x B x C
        w_q, w_k, w_v = layer.self_attn.in_proj_weight.chunk(3)
        b_q, b_k, b_v = layer.self_attn.in_proj_bias.chunk(3)
        xb = x.transpose(0, 1)
        ref = masked_softmax_reference(xb @ w_q.T + b_q, xb @ w_k.T + b_k, xb @ w_v.T + b_v, extra["padding_mask"])
        ref = layer.self_attn.out_proj(ref)
        got, _ = layer.self_attn(x, x, x, key_padding_mask=extra["padding_mask"], need_weights=False)
        real = ~extra["padding_mask"]
        assert torch.allclose(got.transpose(0, 1)[real], ref[real], atol=1e-5)

    assert output_tokens[:, 0].eq(BOS).all() and not output_tokens.eq(UNK).any()
    lengths = output_tokens.ne(PAD).sum(1)
    assert output_tokens.gather(1, (lengths - 1)[:, None]).eq(EOS).all()
    print("refined drafts:", output_tokens.tolist())


if __name__ == "__main__":
    main()
