"""WeNet streaming Conformer encoder: chunk-based attention with limited left context and padded utterances.

Follows wenet-e2e/wenet wenet/utils/mask.py (make_pad_mask, subsequent_chunk_mask(size, chunk_size,
num_left_chunks), add_optional_chunk_mask with static_chunk_size) and wenet/transformer/attention.py
(MultiHeadedAttention.forward_attention: scores.masked_fill(~mask, -inf), softmax, then masked_fill(~mask, 0.0)
so fully padded rows give zeros, not NaN). Mask meant: frame t in chunk c sees all frames of chunks
c - num_left_chunks .. c, including the LATER frames of its own chunk (look-ahead inside a chunk), never a
future chunk, never padding frames.
"""
import torch
from torch import nn


def make_pad_mask(lengths, max_len):
    seq_range = torch.arange(0, max_len, dtype=torch.int64)
    return seq_range.unsqueeze(0) >= lengths.unsqueeze(-1)


def subsequent_chunk_mask(size, chunk_size, num_left_chunks=-1):
    """Bool [size, size]: True where frame i may attend to frame j."""
    pos_idx = torch.arange(size)
    chunk_idx = torch.div(pos_idx, chunk_size, rounding_mode="trunc")
    ending = (chunk_idx + 1) * chunk_size
    if num_left_chunks < 0:
        start = torch.zeros_like(chunk_idx)
    else:
        start = torch.clamp((chunk_idx - num_left_chunks) * chunk_size, min=0)
    return (pos_idx.unsqueeze(0) >= start.unsqueeze(1)) & (pos_idx.unsqueeze(0) < ending.unsqueeze(1))


def add_optional_chunk_mask(xs, masks, static_chunk_size, num_decoding_left_chunks):
    chunk_masks = subsequent_chunk_mask(xs.size(1), static_chunk_size, num_decoding_left_chunks)
    chunk_masks = chunk_masks.unsqueeze(0)            # (1, L, L)
    return masks & chunk_masks                        # (B, L, L)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat):
        super().__init__()
        self.d_k, self.h = n_feat // n_head, n_head
        self.linear_q, self.linear_k = nn.Linear(n_feat, n_feat), nn.Linear(n_feat, n_feat)
        self.linear_v, self.linear_out = nn.Linear(n_feat, n_feat), nn.Linear(n_feat, n_feat)

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        mask = mask.unsqueeze(1).eq(0)                # (batch, 1, time1, time2)
        scores = scores.masked_fill(mask, -float("inf"))
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        x = torch.matmul(attn, value)
        return self.linear_out(x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k))

    def forward(self, query, key, value, mask):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.d_k ** 0.5
        return self.forward_attention(v, scores, mask)


def main():
    torch.manual_seed(0)
    encoder_conf = {"output_size": 32, "attention_heads": 4, "static_chunk_size": 4, "num_decoding_left_chunks": 2}
    xs = torch.randn(3, 22, encoder_conf["output_size"])      # subsampled fbank frames
    xs_lens = torch.tensor([22, 17, 9])
    masks = ~make_pad_mask(xs_lens, xs.size(1)).unsqueeze(1)   # (B, 1, L)
    chunk_masks = add_optional_chunk_mask(xs, masks, encoder_conf["static_chunk_size"],
                                          encoder_conf["num_decoding_left_chunks"])
    self_attn = MultiHeadedAttention(encoder_conf["attention_heads"], encoder_conf["output_size"])
    with torch.no_grad():
        out = xs + self_attn(xs, xs, xs, chunk_masks)
    print("encoder_out", tuple(out.shape), "lens", xs_lens.tolist())


if __name__ == "__main__":
    main()
