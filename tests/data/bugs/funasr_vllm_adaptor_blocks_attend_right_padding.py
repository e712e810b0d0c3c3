"""vLLM's FunASR audio adaptor runs its transformer blocks with no padding mask.

Citation: vllm-project/vllm#55167 "[Bugfix][Model] Fix padding isolation in FunASR adaptor attention"
(open PR, read through its description). In vLLM's port of Fun-ASR, the audio adaptor downsamples the
encoder features (frames grouped by ``downsample_rate``), projects them with linear1/relu/linear2 and then
runs a few transformer ``EncoderLayer`` blocks. The batch is right-padded to the longest feature sequence,
but ``EncoderLayer.forward`` called ``self.self_attn(hidden_states, None, None)``: no length metadata, so a
short request's frames attended to the padding that its longer batch-mates introduced. The reference
FunASR adaptor (funasr/models/llm_asr/adaptor.py) builds ``olens = 1 + (ilens - downsample_rate) // k``
style lengths after downsampling and a padding mask from them for every block.

Fix: derive the post-downsampling output lengths and route them (cu_seqlens / max_seqlen /
sequence_lengths in vLLM) to every adaptor block's attention, so each row attends only to its own frames.

This program: a two-row batch of encoder features (lengths 12 and 7 frames, downsample_rate 2), the
adaptor as vLLM wrote it; the attention is F.scaled_dot_product_attention. Buggy: ``None`` mask, row 1's
four real frames attend its two padded frames. ``--fixed``: the per-row lengths reach attention as
cu_seqlens / max_seqlen / sequence_lengths (as the upstream fix routes them); the SDPA backend masks the
keys past each row's sequence length.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat):
        super().__init__()
        self.h = n_head
        self.d_k = n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)

    def forward(self, hidden_states, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        # the torch SDPA backend of vLLM's MMEncoderAttention reads the explicit per-row lengths
        b, t, _ = hidden_states.shape
        q = self.linear_q(hidden_states).view(b, t, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(hidden_states).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(hidden_states).view(b, t, self.h, self.d_k).transpose(1, 2)
        attn_mask = None
        if sequence_lengths is not None:
            attn_mask = (torch.arange(t)[None, :] < sequence_lengths[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, -1))


class EncoderLayer(nn.Module):
    def __init__(self, size, n_head, ffn_dim):
        super().__init__()
        self.self_attn = MultiHeadedAttention(n_head, size)
        self.feed_forward = nn.Sequential(nn.Linear(size, ffn_dim), nn.ReLU(), nn.Linear(ffn_dim, size))
        self.norm1 = nn.LayerNorm(size)
        self.norm2 = nn.LayerNorm(size)

    def forward(self, hidden_states, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        if FIXED:
            hidden_states = residual + self.self_attn(hidden_states, cu_seqlens, max_seqlen, sequence_lengths)
        else:
            hidden_states = residual + self.self_attn(hidden_states, None, None)
        return hidden_states + self.feed_forward(self.norm2(hidden_states))


class Transformer(nn.Module):
    """The Fun-ASR audio adaptor: downsample, project to the LLM width, transformer blocks."""

    def __init__(self, downsample_rate=2, encoder_dim=16, llm_dim=32, ffn_dim=64, n_layer=2, attention_heads=4):
        super().__init__()
        self.k = downsample_rate
        self.encoder_dim = encoder_dim
        self.llm_dim = llm_dim
        self.linear1 = nn.Linear(encoder_dim * self.k, ffn_dim)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(ffn_dim, llm_dim)
        self.blocks = nn.ModuleList(EncoderLayer(llm_dim, attention_heads, ffn_dim) for _ in range(n_layer))

    def forward(self, x, ilens):
        batch_size, seq_len, dim = x.size()
        chunk_num = (seq_len - 1) // self.k + 1
        pad_num = chunk_num * self.k - seq_len
        x = F.pad(x, (0, 0, 0, pad_num, 0, 0), value=0.0)
        x = x.contiguous().view(batch_size, chunk_num, dim * self.k)
        x = self.linear2(self.relu(self.linear1(x)))
        olens = (ilens - 1) // self.k + 1
        if FIXED:
            cu_seqlens = F.pad(olens.cumsum(0), (1, 0)).to(torch.int32)
            max_seqlen = int(olens.max())
            for block in self.blocks:
                x = block(x, cu_seqlens, max_seqlen, olens)
        else:
            for block in self.blocks:
                x = block(x)
        return x, olens


def main():
    torch.manual_seed(0)
    adaptor = Transformer().eval()
    feature_lens = torch.tensor([12, 7])
    feats = torch.randn(2, 12, 16)
    feats[1, 7:] = 0.0  # the encoder output is right-padded to the longest request
    with torch.no_grad():
        out, olens = adaptor(feats, feature_lens)
        alone, _ = adaptor(feats[1:, :7], feature_lens[1:])
    n = int(olens[1])
    print("row 1 matches its own run:", torch.allclose(out[1, :n], alone[0, :n], atol=1e-5))


if __name__ == "__main__":
    main()
