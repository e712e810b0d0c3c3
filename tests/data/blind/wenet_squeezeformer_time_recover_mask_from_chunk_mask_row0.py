# wenet (wenet-e2e/wenet#1664, commit f73a834): SqueezeformerEncoder re-masks the recovered (upsampled) activations with
# chunk_masks[:, 0, :] -- the first query row of the streaming chunk mask -- instead of the padding mask mask_pad.
import sys, math
from typing import List, Tuple
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def make_pad_mask(lengths, max_len=0):
    batch_size = lengths.size(0)
    max_len = max_len if max_len > 0 else lengths.max().item()
    seq_range = torch.arange(0, max_len, dtype=torch.int64)
    return seq_range.unsqueeze(0).expand(batch_size, max_len) >= lengths.unsqueeze(-1)


def subsequent_chunk_mask(size, chunk_size, num_left_chunks=-1, device=torch.device("cpu")):
    ret = torch.zeros(size, size, device=device, dtype=torch.bool)
    for i in range(size):
        if num_left_chunks < 0:
            start = 0
        else:
            start = max((i // chunk_size - num_left_chunks) * chunk_size, 0)
        ending = min((i // chunk_size + 1) * chunk_size, size)
        ret[i, start:ending] = True
    return ret


def add_optional_chunk_mask(xs, masks, use_dynamic_chunk, use_dynamic_left_chunk, decoding_chunk_size,
                            static_chunk_size, num_decoding_left_chunks):
    if static_chunk_size > 0:
        num_left_chunks = num_decoding_left_chunks
        chunk_masks = subsequent_chunk_mask(xs.size(1), static_chunk_size, num_left_chunks, xs.device)
        chunk_masks = chunk_masks.unsqueeze(0)  # (1, L, L)
        chunk_masks = masks & chunk_masks  # (B, L, L)
    else:
        chunk_masks = masks
    return chunk_masks


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)

    def forward(self, query, key, value, mask):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        mask = mask.unsqueeze(1).eq(0)
        scores = scores.masked_fill(mask, -float('inf'))
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        x = torch.matmul(attn, v).transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)


class SqueezeformerEncoderLayer(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.self_attn = MultiHeadedAttention(4, size)
        self.layer_norm1 = nn.LayerNorm(size)
        self.ffn = nn.Sequential(nn.Linear(size, 2 * size), nn.SiLU(), nn.Linear(2 * size, size))
        self.layer_norm2 = nn.LayerNorm(size)

    def forward(self, x, mask, pos_emb, mask_pad):
        residual = x
        x = self.layer_norm1(residual + self.self_attn(x, x, x, mask))
        x = self.layer_norm2(x + self.ffn(x))
        return x, mask, None, None


class TimeReductionLayer1D(nn.Module):
    def __init__(self, channel, out_dim, kernel_size=5, stride=2):
        super().__init__()
        self.stride = stride
        self.padding = max(0, kernel_size - stride)
        self.dw_conv = nn.Conv1d(channel, channel, kernel_size, stride=stride, padding=self.padding, groups=channel)
        self.pw_conv = nn.Conv1d(channel, out_dim, 1)

    def forward(self, xs, xs_lens, mask, mask_pad):
        xs = xs.transpose(1, 2)  # [B, C, T]
        xs = xs.masked_fill(mask_pad.eq(0), 0.0)
        xs = self.dw_conv(xs)
        xs = self.pw_conv(xs)
        xs = xs.transpose(1, 2)  # [B, T, C]
        B, T, D = xs.size()
        mask = mask[:, ::self.stride, ::self.stride]
        mask_pad = mask_pad[:, :, ::self.stride]
        L = mask_pad.size(-1)
        if L - T < 0:
            xs = xs[:, :L - T, :].contiguous()
        else:
            xs = torch.cat([xs, torch.zeros(B, L - T, D)], dim=1)
        xs_lens = torch.div(xs_lens + 1, 2, rounding_mode='trunc')
        return xs, xs_lens, mask, mask_pad


class SqueezeformerEncoder(nn.Module):
    def __init__(self, d=32, num_blocks=4, reduce_idx=1, recover_idx=3, static_chunk_size=4):
        super().__init__()
        self.encoders = nn.ModuleList([SqueezeformerEncoderLayer(d) for _ in range(num_blocks)])
        self.reduce_idx = [reduce_idx]
        self.recover_idx = [recover_idx]
        self.time_reduce = 'recover'
        self.time_reduction_layer = TimeReductionLayer1D(d, d)
        self.time_recover_layer = nn.Linear(d, d)
        self.static_chunk_size = static_chunk_size
        self.preln = nn.LayerNorm(d)
        self.recovered_inputs = []

    def forward(self, xs, xs_lens, decoding_chunk_size=0, num_decoding_left_chunks=-1):
        T = xs.size(1)
        masks = ~make_pad_mask(xs_lens, T).unsqueeze(1)  # (B, 1, T)
        pos_emb = torch.zeros(1, T, xs.size(-1))
        mask_pad = masks  # (B, 1, T/subsample_rate)
        chunk_masks = add_optional_chunk_mask(xs, masks, False, False, decoding_chunk_size,
                                              self.static_chunk_size, num_decoding_left_chunks)
        if FIXED:
            xs_lens = mask_pad.squeeze(1).sum(1)
        else:
            xs_lens = chunk_masks.squeeze(1).sum(1)
        xs = self.preln(xs)
        recover_activations: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        index = 0
        for i, layer in enumerate(self.encoders):
            if self.reduce_idx is not None:
                if self.time_reduce is not None and i in self.reduce_idx:
                    recover_activations.append((xs, chunk_masks, pos_emb, mask_pad))
                    xs, xs_lens, chunk_masks, mask_pad = \
                        self.time_reduction_layer(xs, xs_lens, chunk_masks, mask_pad)
                    pos_emb = pos_emb[:, ::2, :]
                    index += 1
            if self.recover_idx is not None:
                if self.time_reduce == 'recover' and i in self.recover_idx:
                    index -= 1
                    (recover_tensor, recover_chunk_masks, recover_pos_emb, recover_mask_pad) \
                        = recover_activations[index]
                    xs = xs.unsqueeze(2).repeat(1, 1, 2, 1).flatten(1, 2)
                    xs = self.time_recover_layer(xs)
                    recoverd_t = recover_tensor.size(1)
                    xs = recover_tensor + xs[:, :recoverd_t, :].contiguous()
                    chunk_masks = recover_chunk_masks
                    pos_emb = recover_pos_emb
                    mask_pad = recover_mask_pad
                    if FIXED:
                        xs = xs.masked_fill(~mask_pad[:, 0, :].unsqueeze(-1), 0.0)
                    else:
                        xs = xs.masked_fill(~chunk_masks[:, 0, :].unsqueeze(-1), 0.0)
                    self.recovered_inputs.append(xs)
            xs, chunk_masks, _, _ = layer(xs, chunk_masks, pos_emb, mask_pad)
        return xs, masks


enc = SqueezeformerEncoder().eval()
lens = torch.tensor([16, 11])
xs = torch.randn(2, 16, 32)
with torch.no_grad():
    out, masks = enc(xs, lens)
rec = enc.recovered_inputs[0]
valid = masks[:, 0, :]
zeroed = ((rec.abs().sum(-1) == 0) & valid).sum().item()
print(f"valid frames zeroed at the time-recover layer: {zeroed} of {int(valid.sum())}")
