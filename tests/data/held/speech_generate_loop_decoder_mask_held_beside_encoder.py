"""A correct speech encoder-decoder generate loop: its function holds the decoder's left-padded prompt mask (`mask`, 7
tokens) while it runs the encoder's self-attention over 8 frames of audio, none of them padding.

Written for maskcli's tests (checks/heldextra.py): the held (B, 7) mask is the decoder's, which the loop hands to the
decoder model call as its `decoder_attention_mask`; it is no padding of the encoder's 8 keys (a CLS token or a state
beside 7 tokens), so padding-unused must stay quiet (the Whisper longform loop of transformers PR #48028, written in
plain torch).
"""
import torch
from torch import nn

torch.manual_seed(0)
D, H = 16, 2


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, frames):
        out, _ = self.attn(frames, frames, frames, need_weights=False)
        return out


class Decoder(nn.Module):
    def __init__(self, vocab=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.self_attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.head = nn.Linear(D, vocab)

    def forward(self, decoder_input_ids, memory, decoder_attention_mask):
        x = self.embed(decoder_input_ids)
        t = x.shape[1]
        blocked = torch.ones(t, t, dtype=torch.bool).triu(1)[None] | (decoder_attention_mask == 0)[:, None, :]
        blocked &= ~torch.eye(t, dtype=torch.bool)[None]  # (each padded query sees itself: no row of NaN)
        blocked = blocked.repeat_interleave(H, dim=0)
        x = x + self.self_attn(x, x, x, attn_mask=blocked, need_weights=False)[0]
        x = x + self.cross_attn(x, memory, memory, need_weights=False)[0]
        return self.head(x)


encoder, decoder = Encoder().eval(), Decoder().eval()


def greedy(frames, ids, mask, steps=2):
    with torch.no_grad():
        memory = encoder(frames)
        for _ in range(steps):
            logits = decoder(ids, memory, decoder_attention_mask=mask)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
    return ids


prompts = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 12, 13, 14]])  # the second left-padded
print(greedy(torch.randn(2, 8, D), prompts, (prompts != 0).long()).tolist())
