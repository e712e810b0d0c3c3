"""candle whisper example: the text decoder's self-attention runs without a causal mask.

Citation: huggingface/candle PR #70 "[whisper] Add the causal mask in text decoding." (merge commit
9cebf07f0, branch LaurentMazare/whisper-mask), in candle-examples/examples/whisper/main.rs, the Rust port
of openai/whisper's model.py. Read from the repository history (the PR has no description).

Bug: `MultiHeadAttention::qkv_attention` computed `softmax(q @ k^T)` with no mask for every block, and
`TextDecoder::forward` ran the whole token prompt (`<|startoftranscript|>` ... ) through the decoder in one
pass, so each text position attended to later text positions — unlike openai/whisper, whose TextDecoder
registers a `-inf` upper-triangular `mask` buffer of size `n_text_ctx`.
Fix: `TextDecoder::load` builds that `(n_text_ctx, n_text_ctx)` `-inf` triangle, `forward` passes it to each
block's self-attention (not the cross-attention), and `qkv_attention` narrows it to `n_ctx` and adds it to
`qk` before the softmax.

This program is a torch rendering of that Rust code (same struct / method names, same `Config` fields,
small sizes instead of `Config::tiny_en()`, random weights). The model is run once over a 5-token prompt
and a batch of 2 mel inputs; `--fixed` adds the mask.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Config:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    @staticmethod
    def tiny_test():
        # Config::tiny_en() shrunk so the program runs in well under a second
        return Config(n_mels=8, n_audio_ctx=12, n_audio_state=32, n_audio_head=2, n_audio_layer=2,
                      n_vocab=64, n_text_ctx=16, n_text_state=32, n_text_head=2, n_text_layer=2)


def sinusoids(length, channels):
    log_timescale_increment = torch.log(torch.tensor(10000.0)) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state, n_head):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x, xa=None, mask=None):
        q = self.query(x)
        k = self.key(x if xa is None else xa)
        v = self.value(x if xa is None else xa)
        wv = self.qkv_attention(q, k, v, mask)
        return self.out(wv)

    def reshape_head(self, x):
        n_batch, n_ctx, n_state = x.shape
        return x.reshape(n_batch, n_ctx, self.n_head, n_state // self.n_head).transpose(1, 2)

    def qkv_attention(self, q, k, v, mask):
        _, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = self.reshape_head(q) * scale
        k = self.reshape_head(k).transpose(2, 3) * scale
        v = self.reshape_head(v).contiguous()
        qk = q.matmul(k)
        if mask is not None:
            mask = mask.narrow(0, 0, n_ctx).narrow(1, 0, n_ctx)
            qk = qk + mask
        w = qk.softmax(dim=qk.dim() - 1)
        return w.matmul(v).transpose(1, 2).flatten(2)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state, n_head, cross_attention):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.cross_attn = None
        if cross_attention:
            self.cross_attn = nn.ModuleList([MultiHeadAttention(n_state, n_head), nn.LayerNorm(n_state)])
        self.mlp_linear1 = nn.Linear(n_state, 4 * n_state)
        self.mlp_linear2 = nn.Linear(4 * n_state, n_state)
        self.mlp_ln = nn.LayerNorm(n_state)

    def forward(self, x, xa=None, mask=None):
        x = x + self.attn(self.attn_ln(x), None, mask)
        if self.cross_attn is not None:
            attn, ln = self.cross_attn
            x = x + attn(ln(x), xa, None)
        return x + self.mlp_linear2(F.gelu(self.mlp_linear1(self.mlp_ln(x))))


class AudioEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        n_state = cfg.n_audio_state
        self.conv1 = nn.Conv1d(cfg.n_mels, n_state, 3, padding=1)
        self.conv2 = nn.Conv1d(n_state, n_state, 3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(cfg.n_audio_ctx, n_state))
        self.blocks = nn.ModuleList(
            ResidualAttentionBlock(n_state, cfg.n_audio_head, False) for _ in range(cfg.n_audio_layer))
        self.ln_post = nn.LayerNorm(n_state)

    def forward(self, x):
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x))
        x = x.transpose(1, 2) + self.positional_embedding
        for block in self.blocks:
            x = block(x, None, None)
        return self.ln_post(x)


class TextDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        n_state, n_ctx = cfg.n_text_state, cfg.n_text_ctx
        self.token_embedding = nn.Embedding(cfg.n_vocab, n_state)
        self.positional_embedding = nn.Parameter(torch.randn(n_ctx, n_state) * 0.02)
        self.blocks = nn.ModuleList(
            ResidualAttentionBlock(n_state, cfg.n_text_head, True) for _ in range(cfg.n_text_layer))
        self.ln = nn.LayerNorm(n_state)
        if FIXED:
            mask = torch.full((n_ctx, n_ctx), float("-inf")).triu_(1)
            self.register_buffer("mask", mask)
        else:
            self.mask = None

    def forward(self, x, xa):
        last = x.shape[-1]
        x = self.token_embedding(x) + self.positional_embedding.narrow(0, 0, last)
        for block in self.blocks:
            x = block(x, xa, self.mask)
        x = self.ln(x)
        return x.matmul(self.token_embedding.weight.t())


class Whisper(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = AudioEncoder(cfg)
        self.decoder = TextDecoder(cfg)

    def forward(self, mel, tokens):
        enc = self.encoder(mel)
        return self.decoder(tokens, enc)


def main():
    torch.manual_seed(0)
    cfg = Config.tiny_test()
    model = Whisper(cfg).eval()
    mel = torch.randn(2, cfg.n_mels, 2 * cfg.n_audio_ctx)
    # <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|> then one text token (ids scaled down)
    tokens = torch.tensor([[60, 61, 62, 63, 7], [60, 61, 62, 63, 9]])
    with torch.no_grad():
        logits = model(mel, tokens)
    print("fixed" if FIXED else "buggy", tuple(logits.shape), int(logits[0, 0].argmax()))


if __name__ == "__main__":
    main()
