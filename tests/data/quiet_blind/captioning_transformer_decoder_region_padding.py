"""Image captioning with nn.TransformerDecoder: causal captions over padded region features.

Follows the nn.TransformerDecoder API as documented in pytorch/pytorch torch/nn/modules/transformer.py
(TransformerDecoder.forward: tgt_mask, tgt_is_causal, memory_key_padding_mask, tgt_key_padding_mask) and the
captioning setup of bottom-up region features (a variable number of detected regions per image, padded to the
batch maximum) as in "Meshed-Memory Transformer"-style decoders.

Masks meant:
- decoder self-attention: causal over the caption (`nn.Transformer.generate_square_subsequent_mask`, a float
  mask of 0 / -inf, passed with `tgt_is_causal=True`), plus `tgt_key_padding_mask` for captions shorter than the
  longest one in the batch;
- cross-attention: every caption token sees every real region of its own image and no padded region
  (`memory_key_padding_mask`), no causal structure: the image is fully known. Captions (12 tokens) are longer than
  the number of regions (at most 5), so the cross-attention has more queries than keys.
Greedy decoding at eval time re-runs the decoder on the growing prefix with a fresh causal mask each step.
"""
import torch
import torch.nn as nn

PAD, BOS, EOS = 0, 1, 2


class CaptionDecoder(nn.Module):
    def __init__(self, vocab_size=40, d_model=32, nhead=4, num_layers=2, feat_dim=20, max_len=16):
        super().__init__()
        self.feat_proj = nn.Linear(feat_dim, d_model)
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerDecoderLayer(d_model, nhead, dim_feedforward=64, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, regions, region_mask, captions):
        """regions: (B, R, feat_dim); region_mask: (B, R) True for a real region; captions: (B, T) token ids."""
        memory = self.feat_proj(regions)
        T = captions.size(1)
        positions = torch.arange(T, device=captions.device)
        tgt = self.embed(captions) + self.pos(positions)
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(T, device=captions.device)
        out = self.decoder(
            tgt, memory,
            tgt_mask=tgt_mask,
            tgt_is_causal=True,
            tgt_key_padding_mask=captions == PAD,
            memory_key_padding_mask=~region_mask,
        )
        return self.head(out)

    @torch.no_grad()
    def greedy(self, regions, region_mask, max_len=8):
        captions = torch.full((regions.size(0), 1), BOS, dtype=torch.long)
        for _ in range(max_len - 1):
            logits = self(regions, region_mask, captions)
            captions = torch.cat([captions, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return captions


def main():
    torch.manual_seed(0)
    model = CaptionDecoder()
    num_regions = torch.tensor([5, 3, 4])
    R = int(num_regions.max())
    regions = torch.randn(3, R, 20)
    region_mask = torch.arange(R)[None, :] < num_regions[:, None]
    regions = regions * region_mask[..., None]

    caption_lens = torch.tensor([12, 9, 7])
    captions = torch.randint(3, 40, (3, 12))
    captions[:, 0] = BOS
    captions[torch.arange(12)[None, :] >= caption_lens[:, None]] = PAD

    model.train()
    logits = model(regions, region_mask, captions[:, :-1])
    targets = captions[:, 1:].masked_fill(captions[:, 1:] == PAD, -100)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
    loss.backward()

    model.eval()
    out = model.greedy(regions, region_mask)
    print(f"train loss {loss.item():.4f}; greedy {tuple(out.shape)}")


if __name__ == "__main__":
    main()
