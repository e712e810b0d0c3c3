# Citation: wenet-e2e/wenet wenet/utils/mask.py (subsequent_chunk_mask, add_optional_chunk_mask, make_pad_mask)
#   and wenet/transformer/attention.py (MultiHeadedAttention.forward_attention), commit 0f46608ce7bca55ec8b75bd66e0037db483b2c25.
# Streaming Conformer/Transformer encoder: bool keep mask = right-padding mask (B,1,T) & chunk mask (T,T) with
# num_left_chunks of left context. Queries in a chunk that is all padding get an all-False row on purpose;
# forward_attention fills -inf, softmaxes, then zeroes those rows with masked_fill(mask, 0.0) (no NaN leaks).
import math
import torch
import torch.nn as nn

torch.manual_seed(0)


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
                            static_chunk_size, num_decoding_left_chunks, enable_full_context=True):
    if use_dynamic_chunk:
        max_len = xs.size(1)
        if decoding_chunk_size < 0:
            chunk_size = max_len
            num_left_chunks = -1
        elif decoding_chunk_size > 0:
            chunk_size = decoding_chunk_size
            num_left_chunks = num_decoding_left_chunks
        else:
            chunk_size = torch.randint(1, max_len, (1, )).item()
            num_left_chunks = -1
            if chunk_size > max_len // 2 and enable_full_context:
                chunk_size = max_len
            else:
                chunk_size = chunk_size % 25 + 1
                if use_dynamic_left_chunk:
                    max_left_chunks = (max_len - 1) // chunk_size
                    num_left_chunks = torch.randint(0, max_left_chunks, (1, )).item()
        chunk_masks = subsequent_chunk_mask(xs.size(1), chunk_size, num_left_chunks, xs.device)
        chunk_masks = chunk_masks.unsqueeze(0)
        chunk_masks = masks & chunk_masks
    elif static_chunk_size > 0:
        num_left_chunks = num_decoding_left_chunks
        chunk_masks = subsequent_chunk_mask(xs.size(1), static_chunk_size, num_left_chunks, xs.device)
        chunk_masks = chunk_masks.unsqueeze(0)
        chunk_masks = masks & chunk_masks
    else:
        chunk_masks = masks
    return chunk_masks


def make_pad_mask(lengths, max_len=None):
    batch_size = lengths.size(0)
    if max_len is None:
        max_len = torch.max(lengths)
    seq_range = torch.arange(0, max_len, dtype=torch.int64, device=lengths.device)
    seq_range_expand = seq_range.unsqueeze(0).expand(batch_size, max_len)
    seq_length_expand = lengths.unsqueeze(-1)
    return seq_range_expand >= seq_length_expand


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask.size(2) > 0:  # time2 > 0
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            mask = mask[:, :, :, :scores.size(-1)]
            scores = scores.masked_fill(mask, -float('inf'))
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)  # (batch, head, time1, time2)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class EncoderLayer(nn.Module):
    def __init__(self, size, n_head):
        super().__init__()
        self.self_attn = MultiHeadedAttention(n_head, size, 0.1)
        self.ff = nn.Sequential(nn.Linear(size, 4 * size), nn.ReLU(), nn.Linear(4 * size, size))
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)

    def forward(self, x, mask):
        residual = x
        x = self.norm1(x)
        x = residual + self.self_attn(x, x, x, mask)
        return x + self.ff(self.norm2(x))


class TransformerEncoder(nn.Module):
    def __init__(self, input_size=16, output_size=32, n_head=4, num_blocks=2, static_chunk_size=0,
                 use_dynamic_chunk=True, use_dynamic_left_chunk=True):
        super().__init__()
        self.embed = nn.Linear(input_size, output_size)
        self.encoders = nn.ModuleList([EncoderLayer(output_size, n_head) for _ in range(num_blocks)])
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)
        self.static_chunk_size = static_chunk_size
        self.use_dynamic_chunk = use_dynamic_chunk
        self.use_dynamic_left_chunk = use_dynamic_left_chunk

    def forward(self, xs, xs_lens, decoding_chunk_size=0, num_decoding_left_chunks=-1):
        T = xs.size(1)
        masks = ~make_pad_mask(xs_lens, T).unsqueeze(1)  # (B, 1, T)
        xs = self.embed(xs)
        mask_pad = masks
        chunk_masks = add_optional_chunk_mask(xs, masks, self.use_dynamic_chunk, self.use_dynamic_left_chunk,
                                              decoding_chunk_size, self.static_chunk_size,
                                              num_decoding_left_chunks)
        for layer in self.encoders:
            xs = layer(xs, chunk_masks)
        xs = self.after_norm(xs)
        return xs, masks


enc = TransformerEncoder()
xs = torch.randn(3, 24, 16)
xs_lens = torch.tensor([24, 17, 6])
# training step: dynamic chunk with dynamic left chunks (random chunk size drawn by add_optional_chunk_mask)
opt = torch.optim.SGD(enc.parameters(), lr=0.01)
out, masks = enc(xs, xs_lens)
loss = (out * masks.transpose(1, 2)).pow(2).sum() / masks.sum()
loss.backward()
opt.step()
# decoding: chunk 4 with 1 left chunk (third utterance has whole chunks of padding -> zeroed rows)
enc.eval()
with torch.no_grad():
    out2, masks2 = enc(xs, xs_lens, decoding_chunk_size=4, num_decoding_left_chunks=1)
valid = out2[masks2.squeeze(1)]
print(f"loss={loss.item():.4f} decode_norm={valid.norm().item():.4f} finite={torch.isfinite(out2).all().item()}")
