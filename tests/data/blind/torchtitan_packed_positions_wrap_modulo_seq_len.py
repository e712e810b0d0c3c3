# pytorch/torchtitan#2849 (commit 2ee33fa4e, "Fix RoPE position inconsistencies across chunked samples").
# HuggingFaceTextDataset packs documents into rows of seq_len tokens and yields per-document RoPE positions next
# to them; the llama3 model attends with a block_causal FlexAttention mask (documents split at EOS) and rotates
# q/k at those positions. Before the fix the positions buffer was `i % seq_len` per document: a document longer
# than seq_len got its positions restarted mid-document, and the part of a document carried into the next row
# kept the positions it had in the old row. The fix keeps `range(len(sample_tokens))` and, per row,
# `_normalize_positions` shifts the leading carried-over piece to start at 0.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

BOS_ID, EOS_ID, VOCAB = 1, 2, 64


class HuggingFaceTextDataset(torch.utils.data.IterableDataset):
    def __init__(self, docs, seq_len):
        self._data = docs
        self.seq_len = seq_len
        self._sample_idx = 0
        self._inputs_buffer: list[int] = []
        self._positions_buffer: list[int] = []

    def _normalize_positions(self, positions: list[int]) -> list[int]:
        offset = positions[0]
        if offset > 0:
            for i, p in enumerate(positions):
                if p == 0:
                    break
                positions[i] = p - offset
        return positions

    def __iter__(self):
        max_buffer_token_len = 1 + self.seq_len
        for sample_text in self._data:
            sample_tokens = [BOS_ID] + sample_text + [EOS_ID]
            self._inputs_buffer.extend(sample_tokens)
            if FIXED:
                self._positions_buffer.extend(range(len(sample_tokens)))
            else:
                self._positions_buffer.extend(
                    i % self.seq_len for i in range(len(sample_tokens))
                )
            self._sample_idx += 1

            while len(self._inputs_buffer) >= max_buffer_token_len:
                x = torch.LongTensor(self._inputs_buffer[:max_buffer_token_len])
                if FIXED:
                    pos = torch.LongTensor(
                        self._normalize_positions(
                            self._positions_buffer[:max_buffer_token_len]
                        )
                    )
                else:
                    pos = torch.LongTensor(self._positions_buffer[:max_buffer_token_len])
                self._inputs_buffer = self._inputs_buffer[max_buffer_token_len:]
                self._positions_buffer = self._positions_buffer[max_buffer_token_len:]
                input = x[:-1]
                label = x[1:]
                positions = pos[:-1]
                yield {"input": input, "positions": positions}, label


def get_causal_mask_mod():
    def _causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return _causal_mask


def get_document_mask_mod(batch: torch.Tensor, eos_id: int):
    eos_mask = batch == eos_id
    eos_mask[:, -1] = True
    cumulative_mask = torch.cumsum(torch.where(eos_mask, 1, 0), dim=1)
    sequence_indices = torch.zeros_like(cumulative_mask, dtype=torch.int32)
    sequence_indices[:, 1:] = cumulative_mask[:, :-1]

    def document_mask(b, h, q_idx, kv_idx):
        return sequence_indices[b, q_idx] == sequence_indices[b, kv_idx]

    return document_mask


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def _reshape_for_broadcast_complex(freqs_cis, x, positions=None):
    ndim = x.ndim
    seqlen = x.shape[1]
    if positions is None:
        freqs_cis = freqs_cis[0:seqlen]
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)
    elif positions.size(0) == 1:
        freqs_cis = freqs_cis[positions.squeeze(0)]
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)
    else:
        assert positions.shape == (x.shape[0], seqlen)
        freqs_cis_expanded = freqs_cis[None, :, None, :].expand(x.shape[0], -1, -1, -1)
        freqs_cis = torch.gather(
            freqs_cis_expanded,
            dim=1,
            index=positions.view(x.shape[0], seqlen, 1, 1).expand(
                x.shape[0], seqlen, 1, freqs_cis_expanded.shape[-1]
            ),
        )
        return freqs_cis


def apply_rotary_emb(xq, xk, freqs_cis, positions=None):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = _reshape_for_broadcast_complex(freqs_cis, xq_, positions)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis, positions=positions)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))
        output = flex_attention(xq, xk, xv, block_mask=attention_masks)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attention = Attention(dim, n_heads)
        self.feed_forward = nn.Sequential(nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim))
        self.attention_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, dim=32, n_heads=4, n_layers=2, max_seq_len=16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq_len * 2), persistent=False)

    def get_attention_masks(self, input_batch, eos_id):
        mask_mod = and_masks(get_causal_mask_mod(), get_document_mask_mod(input_batch, eos_id))
        B, S = input_batch.shape
        return create_block_mask(mask_mod, B, None, S, S, device=input_batch.device)

    def forward(self, tokens, attention_masks, positions=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis, attention_masks, positions)
        return self.output(self.norm(h))


def main():
    seq_len = 16
    g = torch.Generator().manual_seed(1)
    lengths = [5, 22, 7, 3, 30, 9, 4, 12]
    docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    ds = HuggingFaceTextDataset(docs, seq_len)
    loader = torch.utils.data.DataLoader(ds, batch_size=2)

    model = Transformer(max_seq_len=seq_len)
    model.eval()
    with torch.no_grad():
        for step, (inputs, labels) in enumerate(loader):
            tokens, positions = inputs["input"], inputs["positions"]
            masks = model.get_attention_masks(tokens, EOS_ID)
            logits = model(tokens, masks, positions=positions)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
            print(f"validation step {step} loss {loss.item():.6f}")

if __name__ == "__main__":
    main()
