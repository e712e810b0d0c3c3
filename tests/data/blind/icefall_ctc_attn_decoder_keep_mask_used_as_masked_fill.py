# k2-fsa/icefall commit c87f55671 ("fix attention mask", zipformer_ctc_attn/attention_decoder.py):
# the attention decoder built wenet-style masks (True = keep) but MultiHeadedAttention does
# masked_fill(mask, -inf) (True = masked), so every layer attended only to padding and future tokens.
import sys
from typing import List

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv


def make_pad_mask(lengths: torch.Tensor) -> torch.Tensor:
    max_len = int(lengths.max())
    n = lengths.size(0)
    return torch.arange(max_len).expand(n, max_len) >= lengths.unsqueeze(1)


def subsequent_mask(size, device="cpu", dtype=torch.bool):
    ret = torch.ones(size, size, device=device, dtype=dtype)
    return torch.tril(ret, out=ret)


class MultiHeadedAttention(nn.Module):
    def __init__(self, embed_dim: int, attention_dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = attention_dim // num_heads
        self.attention_dim = attention_dim
        self.linear_q = nn.Linear(embed_dim, attention_dim)
        self.linear_k = nn.Linear(embed_dim, attention_dim)
        self.linear_v = nn.Linear(embed_dim, attention_dim)
        self.out_proj = nn.Linear(attention_dim, embed_dim)

    def forward(self, query, key, value, mask):
        bsz, tgt_len, _ = query.size()
        src_len = key.size(1)
        h, d = self.num_heads, self.head_dim
        q = self.linear_q(query).reshape(bsz, tgt_len, h, d).transpose(1, 2)
        k = self.linear_k(key).reshape(bsz, src_len, h, d).permute(0, 2, 3, 1)
        v = self.linear_v(value).reshape(bsz, src_len, h, d).transpose(1, 2)
        attn_output_weights = torch.matmul(q, k) / d ** 0.5
        if mask is not None:
            attn_output_weights = attn_output_weights.masked_fill(mask.unsqueeze(1), float("-inf"))
        attn_output_weights = attn_output_weights.softmax(dim=-1)
        attn_output = torch.matmul(attn_output_weights, v)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.attention_dim)
        return self.out_proj(attn_output)


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.self_attn = MultiHeadedAttention(d_model, d_model, num_heads)
        self.src_attn = MultiHeadedAttention(d_model, d_model, num_heads)
        self.feed_forward = nn.Sequential(nn.Linear(d_model, 64), nn.ReLU(), nn.Linear(64, d_model))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, tgt, tgt_mask, memory, memory_mask):
        tgt = tgt + self.self_attn(self.norm1(tgt), self.norm1(tgt), self.norm1(tgt), tgt_mask)
        tgt = tgt + self.src_attn(self.norm2(tgt), memory, memory, memory_mask)
        return tgt + self.feed_forward(self.norm3(tgt))


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size=20, d_model=32, memory_dim=24, num_heads=4, num_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.memory_proj = nn.Linear(memory_dim, d_model)
        self.layers = nn.ModuleList([DecoderLayer(d_model, num_heads) for _ in range(num_layers)])
        self.output_layer = nn.Linear(d_model, vocab_size)

    def forward(self, hs_pad, hlens, ys_in_pad, ys_in_lens):
        tgt = ys_in_pad
        if FIXED:
            # tgt_mask: (B, 1, L), True = padding
            tgt_mask = make_pad_mask(ys_in_lens)[:, None, :].to(tgt.device)
            m = subsequent_mask(tgt_mask.size(-1), device=tgt_mask.device).unsqueeze(0)
            tgt_mask = tgt_mask | (~m)
            memory_mask = make_pad_mask(hlens)[:, None, :].to(hs_pad.device)
        else:
            # tgt_mask: (B, 1, L)
            tgt_mask = (~make_pad_mask(ys_in_lens)[:, None, :]).to(tgt.device)
            # m: (1, L, L)
            m = subsequent_mask(tgt_mask.size(-1), device=tgt_mask.device).unsqueeze(0)
            # tgt_mask: (B, L, L)
            tgt_mask = tgt_mask & m
            memory_mask = (~make_pad_mask(hlens))[:, None, :].to(hs_pad.device)
        memory = self.memory_proj(hs_pad)
        tgt = self.embed(tgt)
        for mod in self.layers:
            tgt = mod(tgt, tgt_mask, memory, memory_mask)
        return self.output_layer(tgt)


class AttentionDecoderModel(nn.Module):
    def __init__(self, vocab_size=20, sos_id=1, eos_id=1, ignore_id=-1):
        super().__init__()
        self.sos_id, self.eos_id, self.ignore_id = sos_id, eos_id, ignore_id
        self.decoder = TransformerDecoder(vocab_size)
        self.loss_fun = nn.CrossEntropyLoss(ignore_index=ignore_id, reduction="sum")

    def _pre_ys_in_out(self, token_ids: List[List[int]]):
        ys_in = [torch.tensor([self.sos_id] + t) for t in token_ids]
        ys_out = [torch.tensor(t + [self.eos_id]) for t in token_ids]
        ys_in_pad = pad_sequence(ys_in, batch_first=True, padding_value=self.eos_id)
        ys_out_pad = pad_sequence(ys_out, batch_first=True, padding_value=self.ignore_id)
        ys_in_lens = torch.tensor([len(t) + 1 for t in token_ids])
        return ys_in_pad, ys_in_lens, ys_out_pad

    def calc_att_loss(self, encoder_out, encoder_out_lens, token_ids):
        ys_in_pad, ys_in_lens, ys_out_pad = self._pre_ys_in_out(token_ids)
        decoder_out = self.decoder(encoder_out, encoder_out_lens, ys_in_pad, ys_in_lens)
        loss = self.loss_fun(decoder_out.reshape(-1, decoder_out.size(-1)), ys_out_pad.reshape(-1))
        return loss, decoder_out


def main():
    torch.manual_seed(0)
    model = AttentionDecoderModel()
    model.eval()
    encoder_out = torch.randn(2, 30, 24)  # output of the zipformer encoder (CTC branch shares it)
    encoder_out_lens = torch.tensor([30, 21])
    token_ids = [[3, 4, 5, 6], [7, 8]]
    with torch.no_grad():
        loss, out = model.calc_att_loss(encoder_out, encoder_out_lens, token_ids)
        _, ref = model.calc_att_loss(encoder_out[1:, :21], encoder_out_lens[1:], token_ids[1:])
    n_nan = torch.isnan(out).any(-1).sum().item()
    diff = (out[1, :3] - ref[0]).abs().max().item()
    print(f"fixed={FIXED} att loss {loss.item():.4f}, NaN rows {n_nan}, "
          f"padded utterance vs alone: max diff {diff:.3e}")


if __name__ == "__main__":
    main()
