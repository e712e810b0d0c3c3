# mindee/doctr#941 (commit fddceba): MASTER.make_mask tiled the (N, L, L) target mask as (num_heads * N, L, L) with
# torch.tile, but nn.MultiheadAttention reads it sample-major, so heads of one word got another word's padding mask.
import math
import sys

import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def positional_encoding(position, d_model=512, dtype=torch.float32):
    pe = torch.zeros(position, d_model)
    pos = torch.arange(0, position, dtype=dtype).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=dtype) * (-math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(pos * div_term)
    pe[:, 1::2] = torch.cos(pos * div_term)
    return pe.unsqueeze(0)


class Decoder(nn.Module):
    def __init__(self, num_layers=2, d_model=32, num_heads=4, dff=64, vocab_size=10, maximum_position_encoding=12,
                 dropout=0.0):
        super().__init__()
        self.d_model, self.num_layers = d_model, num_layers
        self.embedding = nn.Embedding(vocab_size + 3, d_model)  # 3 more classes EOS/SOS/PAD
        self.register_buffer('pos_encoding', positional_encoding(maximum_position_encoding, d_model))
        self.dec_layers = nn.ModuleList([
            nn.TransformerDecoderLayer(d_model=d_model, nhead=num_heads, dim_feedforward=dff, dropout=dropout,
                                       activation='relu', batch_first=True) for _ in range(num_layers)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, enc_output, look_ahead_mask, padding_mask=None):
        seq_len = x.shape[1]
        x = self.embedding(x)
        x *= math.sqrt(self.d_model)
        x += self.pos_encoding[:, :seq_len, :]
        x = self.dropout(x)
        for i in range(self.num_layers):
            x = self.dec_layers[i](tgt=x, memory=enc_output, tgt_mask=look_ahead_mask, memory_mask=padding_mask)
        return x


class MASTER(nn.Module):
    def __init__(self, vocab="abcdefghij", d_model=32, num_heads=4, max_length=12):
        super().__init__()
        self.vocab, self.vocab_size, self.num_heads, self.max_length = vocab, len(vocab), num_heads, max_length
        # stand-in for magc_resnet31: a tiny conv backbone giving (N, C, H, W) features
        self.feat_extractor = nn.Sequential(nn.Conv2d(3, d_model, 3, stride=4, padding=1), nn.ReLU())
        self.decoder = Decoder(d_model=d_model, num_heads=num_heads, vocab_size=self.vocab_size,
                               maximum_position_encoding=max_length)
        self.register_buffer('feature_pe', positional_encoding(8 * 32, d_model))
        self.linear = nn.Linear(d_model, self.vocab_size + 3)

    def make_mask(self, target):
        size = target.size(1)
        look_ahead_mask = ~ (torch.triu(torch.ones(size, size, device=target.device)) == 1).transpose(0, 1)[:, None]
        target_padding_mask = torch.eq(target, self.vocab_size + 2)  # Pad symbol
        combined_mask = target_padding_mask | look_ahead_mask
        return torch.tile(combined_mask.permute(1, 0, 2), (self.num_heads, 1, 1))

    def make_source_and_target_mask(self, source, target):
        # after the fix: (N, 1, L, L), True = see; one mask per sample
        target_pad_mask = (target != self.vocab_size + 2).unsqueeze(1).unsqueeze(1)
        target_length = target.size(1)
        target_sub_mask = torch.tril(torch.ones((target_length, target_length), dtype=torch.bool), diagonal=0)
        source_mask = torch.ones((target_length, source.size(1)), dtype=torch.uint8)
        target_mask = target_pad_mask & target_sub_mask
        return source_mask, target_mask.int()

    def build_target(self, words):
        sos, eos, pad = self.vocab_size + 1, self.vocab_size, self.vocab_size + 2
        gt = torch.full((len(words), self.max_length), pad, dtype=torch.long)
        for i, w in enumerate(words):
            ids = [sos] + [self.vocab.index(c) for c in w] + [eos]
            gt[i, :len(ids)] = torch.tensor(ids)
        return gt, torch.tensor([len(w) for w in words])

    def forward(self, x, target):
        features = self.feat_extractor(x)
        b, c, h, w = features.shape[:4]
        features = features.reshape((b, c, h * w)).permute(0, 2, 1)
        encoded = features + self.feature_pe[:, :h * w, :]
        gt, seq_len = self.build_target(target)
        if FIXED:
            _, target_mask = self.make_source_and_target_mask(encoded, gt)
            # the fixed decoder consumes one (L, L) mask per sample, shared by that sample's heads
            tgt_mask = ~target_mask.bool().repeat_interleave(self.num_heads, dim=0).squeeze(1)
        else:
            tgt_mask = self.make_mask(gt)
        output = self.decoder(gt, encoded, tgt_mask, None)
        logits = self.linear(output)
        cce = F.cross_entropy(logits[:, :-1, :].permute(0, 2, 1), gt[:, 1:], reduction='none')
        mask_2d = torch.arange(self.max_length - 1)[None, :] >= (seq_len + 1)[:, None]
        cce[mask_2d] = 0
        loss = (cce.sum(1) / (seq_len + 1).float()).mean()
        return logits, loss


model = MASTER()
model.train()
images = torch.randn(2, 3, 32, 128)
words = ["abcdefghi", "ab"]  # the second word is padded with PAD up to max_length
logits, loss = model(images, words)
solo_logits, _ = model(images[:1], words[:1])
n_valid = len(words[0]) + 2
diff = (logits[0, :n_valid] - solo_logits[0, :n_valid]).abs().max().item()
print(f"fixed={FIXED} training loss={loss.item():.4f} long word logits, batched vs alone: max diff {diff:.3e}")
