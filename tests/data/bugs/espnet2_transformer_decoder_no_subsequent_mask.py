"""ESPnet2 TransformerDecoder.forward: the target mask had only padding, no subsequent (causal) mask.

Citation: espnet/espnet#1539 ("[ESPnet2] Fix transformer", merged; description: "I just didn't
create subsequent mask"). The PR thread was read, not its diff; the fixed ``forward`` was read in a
stored copy of espnet2/asr/decoder/transformer_decoder.py (``m = subsequent_mask(...)``,
``tgt_mask = tgt_mask & m``). The pre-fix form -- the same lines without ``m`` -- is reconstructed
from the PR description.

Bug: the ESPnet2 decoder's teacher-forced ``forward`` built ``tgt_mask`` from ``ys_in_lens`` only
((B, 1, L) padding mask), so every target position's self-attention saw the later target tokens
during training (the ESPnet1 decoder it was ported from combined it with ``subsequent_mask``).
Fix: ``m = subsequent_mask(tgt_mask.size(-1)).unsqueeze(0); tgt_mask = tgt_mask & m``.

Reproduction: ESPnet's ``MultiHeadedAttention.forward_attention`` (masked_fill with the dtype
minimum, softmax, masked_fill 0) in one pre-norm ``DecoderLayer`` (self-attention + source
attention over encoder output ``hs_pad`` with its ``memory_mask``), random weights; a batch of two
right-padded token sequences (lengths 5 and 3). The program changes the last real token of the
first sequence and prints how much the first position's output moves.
"""
import math
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def make_pad_mask(lengths, maxlen=None):
    maxlen = int(lengths.max()) if maxlen is None else maxlen
    return torch.arange(maxlen)[None, :] >= lengths[:, None]


def subsequent_mask(size, device="cpu", dtype=torch.bool):
    ret = torch.ones(size, size, device=device, dtype=dtype)
    return torch.tril(ret, out=ret)


class MultiHeadedAttention(torch.nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate=0.0):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = torch.nn.Linear(n_feat, n_feat)
        self.linear_k = torch.nn.Linear(n_feat, n_feat)
        self.linear_v = torch.nn.Linear(n_feat, n_feat)
        self.linear_out = torch.nn.Linear(n_feat, n_feat)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            self.attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(self.attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class DecoderLayer(torch.nn.Module):
    def __init__(self, size, self_attn, src_attn):
        super().__init__()
        self.self_attn, self.src_attn = self_attn, src_attn
        self.norm1 = torch.nn.LayerNorm(size)
        self.norm2 = torch.nn.LayerNorm(size)

    def forward(self, tgt, tgt_mask, memory, memory_mask):
        x = tgt + self.self_attn(self.norm1(tgt), self.norm1(tgt), self.norm1(tgt), tgt_mask)
        x = x + self.src_attn(self.norm2(x), memory, memory, memory_mask)
        return x, tgt_mask, memory, memory_mask


class TransformerDecoder(torch.nn.Module):
    def __init__(self, vocab_size, encoder_output_size, attention_heads=4, num_blocks=1):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, encoder_output_size)
        self.pos = torch.nn.Embedding(32, encoder_output_size)
        self.decoders = torch.nn.ModuleList([
            DecoderLayer(
                encoder_output_size,
                MultiHeadedAttention(attention_heads, encoder_output_size),
                MultiHeadedAttention(attention_heads, encoder_output_size),
            ) for _ in range(num_blocks)
        ])
        self.after_norm = torch.nn.LayerNorm(encoder_output_size)
        self.output_layer = torch.nn.Linear(encoder_output_size, vocab_size)

    def forward(self, hs_pad, hlens, ys_in_pad, ys_in_lens):
        tgt = ys_in_pad
        # tgt_mask: (B, 1, L)
        tgt_mask = (~make_pad_mask(ys_in_lens)[:, None, :]).to(tgt.device)
        if FIXED:
            # m: (1, L, L)
            m = subsequent_mask(tgt_mask.size(-1), device=tgt_mask.device).unsqueeze(0)
            # tgt_mask: (B, L, L)
            tgt_mask = tgt_mask & m
        memory = hs_pad
        memory_mask = (~make_pad_mask(hlens, maxlen=memory.size(1)))[:, None, :].to(memory.device)
        x = self.embed(tgt) + self.pos(torch.arange(tgt.size(1)))
        for decoder in self.decoders:
            x, tgt_mask, memory, memory_mask = decoder(x, tgt_mask, memory, memory_mask)
        x = self.output_layer(self.after_norm(x))
        olens = tgt_mask.sum(1)
        return x, olens


if __name__ == "__main__":
    decoder = TransformerDecoder(vocab_size=20, encoder_output_size=32).eval()
    hs_pad = torch.randn(2, 7, 32)
    hlens = torch.tensor([7, 5])
    ys_in_pad = torch.tensor([[19, 4, 8, 15, 6], [19, 3, 9, -1, -1]]).clamp(min=0)  # <sos> + tokens, padded
    ys_in_lens = torch.tensor([5, 3])
    changed = ys_in_pad.clone()
    changed[0, 4] = 11  # a later target token
    with torch.no_grad():
        out, _ = decoder(hs_pad, hlens, ys_in_pad, ys_in_lens)
        out2, _ = decoder(hs_pad, hlens, changed, ys_in_lens)
    diff = (out[0, 0] - out2[0, 0]).abs().max().item()
    print("fixed" if FIXED else "buggy", "position-0 output change when token 4 changes:", f"{diff:.4f}")
