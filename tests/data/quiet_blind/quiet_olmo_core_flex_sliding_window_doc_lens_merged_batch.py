# Correct program (quiet batch quiet-r79a).
# Ported from allenai/OLMo-core @a93d8bcd958cb626f996cf9e4eb3cbfdecd62441: src/olmo_core/nn/attention/flex_attn_api.py
#   (FlexAttention.get_mask_mod: causal & sliding window (left, right) & document_ids from doc_lens;
#   create_causal_block_mask / get_causal_block_mask: with doc_lens the batch dimension is merged into the sequence,
#   B=1, Q_LEN = KV_LEN = sum(doc_lens); without doc_lens B=None over seq_len; FlexAttention.forward's sliding_window ->
#   window_size=(sliding_window, 0)). The attention module around it (q/k/v of shape (B, H, S, D), flattened to
#   (1, H, B*S, D) for the intra-document mask, positions restarting per document) is a trimmed port; flex_attention
#   runs eagerly on CPU instead of OLMo-core's torch.compile'd class attribute.
# Two rows of 16 tokens each pack several documents (doc_lens over the flattened batch: 5, 7, 4 | 9, 7). Even layers
# use a sliding window of 3 keys back, odd layers full causal, both intra-document. A second call with no doc_lens
# runs one unpacked document per row under the causal + window mask. The self-check runs every document alone through
# an eager softmax whose keep-mask is a double loop (same document, j <= i, i - j <= window) and compares every token.
import warnings

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

torch.manual_seed(0)
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


class FlexAttention(nn.Module):
    @staticmethod
    def get_mask_mod(window_size=None, doc_lens=None, device=None):
        mask_mods = []

        def _causal_mask_mod(B, H, q_idx, kv_idx):
            return q_idx >= kv_idx

        mask_mods.append(_causal_mask_mod)

        if window_size is not None and window_size != (-1, -1):

            def _sliding_window_mask_mod(B, H, q_idx, kv_idx):
                return torch.logical_and(q_idx - kv_idx <= window_size[0], kv_idx - q_idx <= window_size[1])

            mask_mods.append(_sliding_window_mask_mod)

        if doc_lens is not None:
            if device is None:
                raise ValueError("Device is required for intra-document masking mod")
            document_ids = torch.cat(
                [torch.full((int(doc_len),), i, device=device) for i, doc_len in enumerate(doc_lens)])

            def _document_masking_mask_mod(B, H, q_idx, kv_idx):
                return document_ids[q_idx] == document_ids[kv_idx]

            mask_mods.append(_document_masking_mask_mod)

        return and_masks(*mask_mods)

    @staticmethod
    def create_causal_block_mask(seq_len, device, window_size=None, doc_lens=None, block_size=128):
        if doc_lens is not None:
            token_count = int(sum(doc_lens))
            if token_count % seq_len != 0:
                raise ValueError("Sum of document lengths is not a multiple of sequence length")
            # For intra-document masking, we merge the batch size dimension into the sequence dimension.
            return create_block_mask(
                FlexAttention.get_mask_mod(window_size, doc_lens=doc_lens, device=device),
                B=1, H=None, Q_LEN=token_count, KV_LEN=token_count, device=device.type, BLOCK_SIZE=block_size)
        return create_block_mask(
            FlexAttention.get_mask_mod(window_size, device=device),
            B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device.type, BLOCK_SIZE=block_size)

    @staticmethod
    def get_causal_block_mask(seq_len, device, window_size=None, doc_lens=None, block_size=128):
        if doc_lens is not None:
            doc_lens_list = tuple(doc_lens.flatten().tolist())
            return FlexAttention.create_causal_block_mask(seq_len, device, window_size, doc_lens_list, block_size)
        return FlexAttention.create_causal_block_mask(seq_len, device, window_size, doc_lens=None,
                                                      block_size=block_size)


def rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = pos.float()[..., None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, sliding_window):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.sliding_window = sliding_window
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.w_v = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.w_out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, pos, doc_lens=None):
        B, S, _ = x.shape
        q = self.w_q(x).view(B, S, self.n_heads, self.head_dim)
        k = self.w_k(x).view(B, S, self.n_kv_heads, self.head_dim)
        v = self.w_v(x).view(B, S, self.n_kv_heads, self.head_dim)
        q, k = rope(q.transpose(1, 2), pos[:, None]), rope(k.transpose(1, 2), pos[:, None])
        v = v.transpose(1, 2)
        window_size = (self.sliding_window, 0) if self.sliding_window else None
        block_mask = FlexAttention.get_causal_block_mask(S, x.device, window_size=window_size, doc_lens=doc_lens)
        if doc_lens is not None:
            # batch merged into the sequence: (B, H, S, D) -> (1, H, B*S, D)
            q, k, v = (t.transpose(0, 1).reshape(1, t.shape[1], B * S, self.head_dim) for t in (q, k, v))
        o = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        if doc_lens is not None:
            o = o.reshape(self.n_heads, B, S, self.head_dim).transpose(0, 1)
        return self.w_out(o.transpose(1, 2).reshape(B, S, -1))


class Model(nn.Module):
    def __init__(self, vocab=50, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, window=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            [Attention(d_model, n_heads, n_kv_heads, window if i % 2 == 0 else 0) for i in range(n_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(n_layers)])

    def forward(self, ids, pos, doc_lens=None):
        h = self.emb(ids)
        for norm, attn in zip(self.norms, self.layers):
            h = h + attn(norm(h), pos, doc_lens=doc_lens)
        return h


def reference_attention(attn, x, pos):
    # one document alone, eager softmax, keep-mask from a double loop
    S = x.shape[1]
    q = rope(attn.w_q(x).view(1, S, attn.n_heads, -1).transpose(1, 2), pos[:, None])
    k = rope(attn.w_k(x).view(1, S, attn.n_kv_heads, -1).transpose(1, 2), pos[:, None])
    v = attn.w_v(x).view(1, S, attn.n_kv_heads, -1).transpose(1, 2)
    rep = attn.n_heads // attn.n_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    keep = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        for j in range(S):
            keep[i, j] = j <= i and (attn.sliding_window == 0 or i - j <= attn.sliding_window)
    scores = (q @ k.transpose(-1, -2)) / attn.head_dim ** 0.5
    o = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v
    return attn.w_out(o.transpose(1, 2).reshape(1, S, -1))


def reference_model(model, ids):
    pos = torch.arange(ids.shape[1])[None]
    h = model.emb(ids)
    for norm, attn in zip(model.norms, model.layers):
        h = h + reference_attention(attn, norm(h), pos)
    return h


def main():
    model = Model().eval()
    S = 16
    doc_lens = torch.tensor([[5, 7, 4], [9, 7, 0]])
    doc_lens_nonzero = doc_lens[doc_lens > 0]
    ids = torch.randint(1, 50, (2, S))
    # positions restart at each document
    pos = torch.cat([torch.arange(int(n)) for n in doc_lens_nonzero]).view(2, S)

    with torch.no_grad():
        out = model(ids, pos, doc_lens=doc_lens)  # zero-padded rows, flattened as OLMo-core does
        flat_ids, flat_out = ids.reshape(-1), out.reshape(-1, out.shape[-1])
        start = 0
        for n in doc_lens_nonzero.tolist():
            alone = reference_model(model, flat_ids[start:start + n][None])[0]
            torch.testing.assert_close(flat_out[start:start + n], alone, rtol=1e-4, atol=1e-5)
            start += n

        # unpacked rows: one document per row, no doc_lens (B=None block mask over seq_len)
        out_rows = model(ids, torch.arange(S).expand(2, S))
        for b in range(2):
            torch.testing.assert_close(out_rows[b], reference_model(model, ids[b:b + 1])[0], rtol=1e-4, atol=1e-5)
    print("packed flex (doc_lens, sliding window) and unpacked rows match each document run alone")


if __name__ == "__main__":
    main()
