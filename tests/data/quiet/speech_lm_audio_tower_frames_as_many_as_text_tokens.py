"""A speech language model written by hand: an `audio_tower` encodes each clip's frames under its own frame padding
mask (lengths 8 and 5 of 8), then a causal text decoder over left-padded prompts of 8 tokens attends under the text's
attention_mask. The frames are as many as the text tokens, but the text's mask says nothing of them: quiet. Checked:
the second clip's real frames match it run alone."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, -1))


class AudioTower(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.proj, self.attn = nn.Linear(4, d), Attention(d)

    def forward(self, frames, frame_lengths):
        keep = torch.arange(frames.shape[1])[None, :] < frame_lengths[:, None]  # (B, T): real frames
        x = self.proj(frames)
        return x + self.attn(x, keep[:, None, None, :])


class SpeechLM(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.audio_tower, self.embed, self.attn = AudioTower(d), nn.Embedding(30, d, padding_idx=0), Attention(d)
        self.audio_proj, self.head = nn.Linear(d, d), nn.Linear(d, 30)

    def forward(self, input_ids, attention_mask, input_features, frame_lengths):
        audio = self.audio_tower(input_features, frame_lengths)
        pooled = (audio * (torch.arange(audio.shape[1])[None, :, None] < frame_lengths[:, None, None])).sum(1)
        x = self.embed(input_ids) + self.audio_proj(pooled / frame_lengths[:, None])[:, None]
        n = input_ids.shape[1]
        keep = torch.ones(n, n, dtype=torch.bool).tril() & attention_mask.bool()[:, None, None, :]
        keep = keep | torch.eye(n, dtype=torch.bool)  # (a left pad's query sees itself: no empty row)
        return self.head(x + self.attn(x, keep)), audio


torch.manual_seed(0)
model = SpeechLM().eval()
ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]])
mask = (ids != 0).long()
frames, lengths = torch.randn(2, 8, 4), torch.tensor([8, 5])
with torch.no_grad():
    logits, audio = model(ids, mask, frames, lengths)
    alone = model.audio_tower(frames[1:, :5], lengths[1:])
assert torch.allclose(audio[1, :5], alone[0], atol=1e-5)
print("logits", logits[:, -1, :3].numpy().round(3))
