"""SpeechBrain TransformerASR: the decoding step attends padded encoder frames in cross-attention.

Citation: speechbrain/speechbrain#1107 ("Appropriate masks are needed for TransformerASR.decode()"); the
thread points to the fix in commit db4a46d58e8551c002d1c3c89c069c52a4183b72 (speechbrain/speechbrain#933).
I did not read that commit; the fixed lines below are those of later SpeechBrain releases
(``decode(self, tgt, encoder_out, enc_len=None)`` building ``src_key_padding_mask`` from ``enc_len``).

Bug: ``TransformerASR.forward`` (training) passes ``memory_key_padding_mask=src_key_padding_mask`` to the
decoder, but ``TransformerASR.decode`` (used step by step by ``S2STransformerBeamSearch`` / greedy search)
called the decoder with only ``tgt_mask``: with a batch of utterances of different lengths, the shorter
ones' decoder queries attend the padded encoder frames.
Fix: ``decode(tgt, encoder_out, enc_len=None)`` builds ``src_key_padding_mask = (1 - length_to_mask(enc_len)).bool()``
and passes it as ``memory_key_padding_mask``; the searcher computes
``enc_lens = torch.round(enc_states.shape[1] * wav_len).int()``.

This program: encoder output for a batch of two utterances (relative lengths ``wav_len`` = [1.0, 0.5] of
10 frames), a one-layer ``nn.MultiheadAttention`` decoder (batch_first), three greedy decoding steps.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def length_to_mask(length, max_len=None, dtype=None, device=None):
    """Creates a binary mask for each sequence (1 = valid)."""
    if max_len is None:
        max_len = length.max().long().item()
    mask = torch.arange(max_len, device=length.device, dtype=length.dtype).expand(
        len(length), max_len
    ) < length.unsqueeze(1)
    return torch.as_tensor(mask, dtype=dtype or length.dtype, device=device or length.device)


def get_lookahead_mask(padded_input):
    seq_len = padded_input.shape[1]
    mask = (torch.triu(torch.ones((seq_len, seq_len))) == 1).transpose(0, 1)
    return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_ffn, nhead, d_model):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        self.mutihead_attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        self.pos_ffn = nn.Sequential(nn.Linear(d_model, d_ffn), nn.ReLU(), nn.Linear(d_ffn, d_model))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None):
        tgt2, self_attn = self.self_attn(tgt, tgt, tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)
        tgt = self.norm1(tgt + tgt2)
        tgt2, multihead_attention = self.mutihead_attn(
            tgt, memory, memory, attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask
        )
        tgt = self.norm2(tgt + tgt2)
        tgt = self.norm3(tgt + self.pos_ffn(tgt))
        return tgt, self_attn, multihead_attention


class TransformerASR(nn.Module):
    def __init__(self, tgt_vocab=12, d_model=16, nhead=2, d_ffn=32):
        super().__init__()
        self.custom_tgt_module = nn.Embedding(tgt_vocab, d_model)
        self.decoder = TransformerDecoderLayer(d_ffn, nhead, d_model)
        self.out = nn.Linear(d_model, tgt_vocab)

    @torch.no_grad()
    def decode(self, tgt, encoder_out, enc_len=None):
        tgt_mask = get_lookahead_mask(tgt)
        src_key_padding_mask = None
        if enc_len is not None:
            src_key_padding_mask = (1 - length_to_mask(enc_len)).bool()

        tgt = self.custom_tgt_module(tgt)
        prediction, self_attns, multihead_attns = self.decoder(
            tgt, encoder_out, tgt_mask=tgt_mask, memory_key_padding_mask=src_key_padding_mask
        )
        return prediction, multihead_attns


class S2STransformerGreedySearch:
    def __init__(self, model, bos_index=1, max_steps=3):
        self.model, self.bos_index, self.max_steps = model, bos_index, max_steps

    def forward(self, enc_states, wav_len):
        enc_lens = torch.round(enc_states.shape[1] * wav_len).int()
        memory = torch.full((enc_states.shape[0], 1), self.bos_index, dtype=torch.long)
        for _ in range(self.max_steps):
            if FIXED:
                pred, attn = self.model.decode(memory, enc_states, enc_lens)
            else:
                pred, attn = self.model.decode(memory, enc_states)
            log_probs = self.model.out(pred[:, -1]).log_softmax(-1)
            memory = torch.cat([memory, log_probs.argmax(-1, keepdim=True)], dim=-1)
        return memory


def main():
    torch.manual_seed(0)
    model = TransformerASR().eval()
    enc_states = torch.randn(2, 10, 16)
    wav_len = torch.tensor([1.0, 0.5])
    hyps = S2STransformerGreedySearch(model).forward(enc_states, wav_len)
    print("hyps", hyps.tolist())


if __name__ == "__main__":
    main()
