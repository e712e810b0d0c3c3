"""A speech recognizer's attention decoder (SpeechBrain's TransformerASR / ESPnet's decoder): the decoder's tokens
attend causally to themselves and, by cross-attention, to the encoder's frames, the encoder's padding given as the
frames' lengths (`wav_lens` relative, turned into `src_key_padding_mask` as SpeechBrain's make_transformer_src_mask
does). The decoder (7 tokens) is longer than the encoder's output (5 frames): queries are not placed among the keys.

Right: every real decoder query sees every real frame of its row and no padded one; the self-attention is causal
with the target padding masked as keys."""
import torch
from torch import nn


class Decoder(nn.Module):
    def __init__(self, d=16, heads=2, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerDecoderLayer(d, heads, 32, dropout=0.0, batch_first=True)
                                    for _ in range(layers))

    def forward(self, tgt, memory, tgt_mask, tgt_key_padding_mask, memory_key_padding_mask):
        for layer in self.layers:
            tgt = layer(tgt, memory, tgt_mask=tgt_mask, tgt_key_padding_mask=tgt_key_padding_mask,
                        memory_key_padding_mask=memory_key_padding_mask)
        return tgt


class TransformerASR(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Embedding(20, d, padding_idx=0)
        self.decoder = Decoder(d)

    def forward(self, src, tgt, wav_lens):
        src_len = torch.round(wav_lens * src.shape[1]).long()
        memory_key_padding_mask = torch.arange(src.shape[1])[None, :] >= src_len[:, None]  # True = padded frame
        tgt_key_padding_mask = tgt == 0
        tgt_mask = torch.triu(torch.full((tgt.shape[1], tgt.shape[1]), float("-inf")), diagonal=1)
        return self.decoder(self.embed(tgt), src, tgt_mask, tgt_key_padding_mask, memory_key_padding_mask)


def main():
    torch.manual_seed(0)
    src = torch.randn(2, 5, 16)  # the encoder's output: 5 frames
    tgt = torch.tensor([[1, 4, 5, 6, 7, 8, 2], [1, 9, 3, 2, 0, 0, 0]])
    with torch.no_grad():
        out = TransformerASR().eval()(src, tgt, torch.tensor([1.0, 0.6]))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
