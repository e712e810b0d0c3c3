"""fairseq CMLM (Mask-Predict): a non-autoregressive decoder with NO future mask, iterative refinement.

Follows facebookresearch/fairseq fairseq/models/nat/cmlm_transformer.py (CMLMNATransformerModel.forward_decoder:
re-mask the lowest-scoring tokens, _skeptical_unmasking) and fairseq/models/nat/nonautoregressive_transformer.py
(NATransformerDecoder.extract_features: self_attn_mask=None, self_attn_padding_mask=prev_output_tokens.eq(
padding_idx), encoder_padding_mask for the source; initialize_output_tokens fills predicted lengths with <mask>
and pads the batch). Recalled, not read line by line.

Mask meant: decoder self-attention is bidirectional among the real target slots (every slot sees every other
slot, masked or already predicted) because all tokens are predicted in parallel; only target padding (from
different predicted lengths) is hidden as keys, and source padding is hidden in encoder-decoder attention.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
PAD, MASK, BOS, EOS = 1, 3, 0, 2


class NATDecoderLayer(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.encoder_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc = nn.Linear(d, d)
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x, encoder_out, encoder_padding_mask, self_attn_padding_mask):
        h, _ = self.self_attn(x, x, x, key_padding_mask=self_attn_padding_mask, attn_mask=None)
        x = self.ln1(x + h)
        h, _ = self.encoder_attn(x, encoder_out, encoder_out, key_padding_mask=encoder_padding_mask)
        x = self.ln2(x + h)
        return self.ln3(x + torch.relu(self.fc(x)))


class CMLMLite(nn.Module):
    def __init__(self, vocab=24, d=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d, padding_idx=PAD)
        self.embed_positions = nn.Embedding(32, d)
        self.encoder = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.layers = nn.ModuleList([NATDecoderLayer(d)])
        self.output_projection = nn.Linear(d, vocab)

    def forward_encoder(self, src_tokens):
        encoder_padding_mask = src_tokens.eq(PAD)
        pos = self.embed_positions(torch.arange(src_tokens.shape[1]))
        return self.encoder(self.embed_tokens(src_tokens) + pos, src_key_padding_mask=encoder_padding_mask), \
            encoder_padding_mask

    def forward_decoder(self, prev_output_tokens, encoder_out, encoder_padding_mask):
        self_attn_padding_mask = prev_output_tokens.eq(PAD)
        x = self.embed_tokens(prev_output_tokens) + self.embed_positions(torch.arange(prev_output_tokens.shape[1]))
        for layer in self.layers:
            x = layer(x, encoder_out, encoder_padding_mask, self_attn_padding_mask)
        return self.output_projection(x).log_softmax(-1)


def initialize_output_tokens(length_tgt):
    max_len = int(length_tgt.max())
    idx = torch.arange(max_len)[None]
    tokens = torch.full((len(length_tgt), max_len), PAD).masked_fill(idx < length_tgt[:, None], MASK)
    tokens[:, 0] = BOS
    tokens.scatter_(1, length_tgt[:, None] - 1, EOS)
    return tokens


def mask_predict(model, src_tokens, length_tgt, max_iter=3):
    encoder_out, enc_pad = model.forward_encoder(src_tokens)
    output_tokens = initialize_output_tokens(length_tgt)
    output_scores = torch.zeros(output_tokens.shape)
    special = output_tokens.eq(PAD) | output_tokens.eq(BOS) | output_tokens.eq(EOS)
    for step in range(max_iter):
        lprobs = model.forward_decoder(output_tokens, encoder_out, enc_pad)
        scores, tokens = lprobs[..., 4:].max(-1)
        tokens = tokens + 4
        masked = output_tokens.eq(MASK)
        output_tokens = output_tokens.masked_scatter(masked, tokens[masked])
        output_scores = output_scores.masked_scatter(masked, scores[masked])
        if step + 1 == max_iter:
            break
        # skeptical unmasking: re-mask the lowest-scoring real tokens, fewer each iteration
        num_mask = ((length_tgt - 2).float() * (1 - (step + 1) / max_iter)).long()
        ranked = output_scores.masked_fill(special, float("inf")).sort(-1)[1]
        remask = torch.arange(ranked.shape[1])[None] < num_mask[:, None]
        remask = torch.zeros_like(special).scatter(1, ranked, remask)
        output_tokens = output_tokens.masked_fill(remask, MASK)
        output_scores = output_scores.masked_fill(remask, 0.0)
    return output_tokens


src_tokens = torch.tensor([[5, 6, 7, 8, 9, EOS], [10, 11, 12, EOS, PAD, PAD]])
length_tgt = torch.tensor([5, 7])   # from the length predictor
model = CMLMLite().eval()
with torch.no_grad():
    out = mask_predict(model, src_tokens, length_tgt)
    # reference: each sentence decoded alone, without any source or target padding
    for i in range(2):
        src = src_tokens[i:i + 1, : int(src_tokens[i].ne(PAD).sum())]
        alone = mask_predict(model, src, length_tgt[i:i + 1])
        assert torch.equal(alone[0], out[i, : int(length_tgt[i])])
        assert out[i, int(length_tgt[i]):].eq(PAD).all()
print(out.tolist(), "ok")
