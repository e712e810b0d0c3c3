# The bug of oarriaga/paz#422 (Florence-2's encoder over image tokens and right-padded instruction tokens, handed no
# mask), written another way: an audio-text encoder that puts its audio frames AFTER the text (the ids lengthened at
# the end, not the start), its pad id in a config dataclass, SDPA with no mask over a right-padded batch; the program
# checks the short caption against the same caption encoded alone. `--fixed` hands SDPA a key mask built from the ids
# (text real where id != pad_token_id, every audio frame real).
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class EncoderConfig:
    vocab_size: int = 40
    hidden_size: int = 16
    num_heads: int = 2
    num_layers: int = 2
    frames: int = 5
    pad_token_id: int = 0


class Block(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, x, key_mask=None):
        b, length, dim = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(attended.transpose(1, 2).reshape(b, length, dim))


class AudioTextEncoder(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.audio = nn.Linear(8, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))

    def forward(self, input_ids, audio_features):
        x = torch.cat([self.embed(input_ids), self.audio(audio_features)], dim=1)  # the frames after the text
        key_mask = None
        if FIXED:
            frames = torch.ones(audio_features.shape[:2], dtype=torch.bool)
            key_mask = torch.cat([input_ids.ne(self.config.pad_token_id), frames], dim=1)
        for block in self.blocks:
            x = block(x, key_mask)
        return x


config = EncoderConfig()
model = AudioTextEncoder(config).eval()
captions = [[7, 12, 19, 4, 22, 31], [9, 14, 3, 27]]
width = max(len(c) for c in captions)
input_ids = torch.tensor([c + [config.pad_token_id] * (width - len(c)) for c in captions])
audio = torch.randn(2, config.frames, 8)
with torch.no_grad():
    batched = model(input_ids, audio)
    alone = model(input_ids[1:, :4], audio[1:])
print("caption 1, batched vs alone, largest gap on its text:", round((batched[1, :4] - alone[0, :4]).abs().max().item(), 5))
print("caption 0 norm:", round(batched[0].norm().item(), 4))
