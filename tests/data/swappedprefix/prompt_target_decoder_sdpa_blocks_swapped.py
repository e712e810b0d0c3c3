# Written another way (for checks/swappedprefix.py): a decoder-only TTS / speech LM in the style of UniAudio and
# SpeechX that lays a text prompt and the target audio codes end to end and attends them with
# F.scaled_dot_product_attention and a boolean mask (True = attend) built from blocks with torch.cat, a padded batch
# of three. Buggy: the two off-diagonal blocks are swapped (the prompt rows see every target code, the target rows see
# none of the prompt), so the generated codes never read the prompt. Fixed: the target sees the prompt, not the
# reverse.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h, keep):
        b, n, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        h = h + self.proj(out.transpose(1, 2).reshape(b, n, d))
        return h + self.mlp(self.norm2(h))


class PromptedCodecLM(nn.Module):
    def __init__(self, text_vocab=60, codec_vocab=128, dim=48, heads=4, depth=2):
        super().__init__()
        self.text_embed = nn.Embedding(text_vocab, dim)
        self.code_embed = nn.Embedding(codec_vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, codec_vocab)

    def build_mask(self, prompt_lens, target_lens):
        P, T = int(prompt_lens.max()), int(target_lens.max())
        ar = torch.tril(torch.ones(T, T, dtype=torch.bool))
        if FIXED:
            top = torch.cat([torch.ones(P, P, dtype=torch.bool), torch.zeros(P, T, dtype=torch.bool)], dim=1)
            bottom = torch.cat([torch.ones(T, P, dtype=torch.bool), ar], dim=1)
        else:
            top = torch.cat([torch.ones(P, P, dtype=torch.bool), torch.ones(P, T, dtype=torch.bool)], dim=1)
            bottom = torch.cat([torch.zeros(T, P, dtype=torch.bool), ar], dim=1)
        structure = torch.cat([top, bottom], dim=0)  # (P + T, P + T)
        real = torch.cat([torch.arange(P)[None] < prompt_lens[:, None], torch.arange(T)[None] < target_lens[:, None]], 1)
        return structure[None, None] & real[:, None, None, :]  # (B, 1, L, L): key padding of both parts

    def forward(self, prompt, prompt_lens, codes, target_lens):
        keep = self.build_mask(prompt_lens, target_lens)
        h = torch.cat([self.text_embed(prompt), self.code_embed(codes)], dim=1)
        for block in self.blocks:
            h = block(h, keep)
        return self.head(h[:, prompt.shape[1]:])


def main():
    torch.manual_seed(0)
    model = PromptedCodecLM().eval()
    prompt_lens, target_lens = torch.tensor([5, 3, 4]), torch.tensor([6, 6, 4])
    prompt = torch.randint(1, 60, (3, 5)) * (torch.arange(5)[None] < prompt_lens[:, None])
    codes = torch.randint(1, 128, (3, 6)) * (torch.arange(6)[None] < target_lens[:, None])
    with torch.no_grad():
        a = model(prompt, prompt_lens, codes, target_lens)
        b = model(torch.randint(1, 60, (3, 5)), prompt_lens, codes, target_lens)
    print(f"{'fixed' if FIXED else 'buggy'}: max |target logits change| when the prompt changes = "
          f"{(a - b).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
