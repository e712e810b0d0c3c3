# NVIDIA/TransformerEngine#2077 ("fix: fixes multi head attention for context parallel: rotary embedding to use
# padded cu_seq_lens", merged for 2.7.0). transformer_engine/pytorch/attention/multi_head_attention.py:
# MultiheadAttention.forward with qkv_format="thd", context parallelism (cp_size=2, load-balanced split: rank r
# holds chunks r and 2*cp-1-r of every sequence) and pad_between_seqs=True, i.e. each packed sequence padded to a
# multiple of 2*cp_size so that it splits evenly, the layout given by cu_seqlens_q_padded. Before the fix the
# rotary embedding was applied with cu_seqlens=cu_seqlens_q (the unpadded boundaries) while the tokens are laid
# out by cu_seqlens_q_padded: the fused THD RoPE kernel takes each sequence's start and per-rank length from the
# wrong boundaries, so tokens get another sequence's / another chunk's positions. The fix passes
# cu_seqlens_q_padded / cu_seqlens_kv_padded to apply_rotary_pos_emb when pad_between_seqs.
# Ported to CPU: the fused THD RoPE kernel (fused_rope thd forward: start = cu_seqlens[b] / cp_size, one
# thread per (s_id, b), tokens outside every [start, end) left as they were) and the CP core attention
# (an all-gather of K/V over the ranks, then each sequence's causal attention over its real tokens) are plain
# torch; the ranks run in a loop.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CP_SIZE = 2
HIDDEN = 32
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
VOCAB = 50


class RotaryPositionEmbedding(nn.Module):
    def __init__(self, dim, rotary_base=10000.0):
        super().__init__()
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def forward(self, max_seq_len, offset=0):
        seq = torch.arange(max_seq_len, dtype=self.inv_freq.dtype) + offset
        freqs = torch.einsum("i , j -> i j", seq, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # emb [seq_length, .., dim]
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def fused_rope_thd_forward(t, cu_seqlens, freqs, cp_size, cp_rank):
    # t: [total_tokens_on_this_rank, h, d]; freqs: [max_s, 1, 1, d]
    output = t.clone()
    freqs = freqs.squeeze(1).squeeze(1)
    num_seqs = cu_seqlens.numel() - 1
    max_s = t.size(0)
    for b in range(num_seqs):
        start = int(cu_seqlens[b]) // cp_size
        end = int(cu_seqlens[b + 1]) // cp_size
        cur_seqlens = end - start
        for s_id in range(max_s):
            t_id = s_id + start
            if t_id >= end:
                break
            if cp_size > 1:
                if s_id < cur_seqlens // 2:
                    s_id_for_freqs = s_id + cp_rank * cur_seqlens // 2
                else:
                    s_id_for_freqs = (
                        cur_seqlens * cp_size - (cp_rank + 1) * cur_seqlens // 2 + s_id - cur_seqlens // 2
                    )
            else:
                s_id_for_freqs = s_id
            f = freqs[s_id_for_freqs]
            x = t[t_id]
            output[t_id] = x * torch.cos(f) + _rotate_half(x) * torch.sin(f)
    return output


def apply_rotary_pos_emb(t, freqs, tensor_format, fused, cu_seqlens, cp_size, cp_rank):
    assert tensor_format == "thd" and fused
    return fused_rope_thd_forward(t, cu_seqlens, freqs, cp_size, cp_rank)


def thd_partition_indices(cu_seqlens_padded, cp_size, cp_rank):
    # tex.thd_get_partitioned_indices: chunks cp_rank and 2*cp_size-1-cp_rank of each padded sequence
    idx = []
    for b in range(cu_seqlens_padded.numel() - 1):
        s0, s1 = int(cu_seqlens_padded[b]), int(cu_seqlens_padded[b + 1])
        chunk = (s1 - s0) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            idx.extend(range(s0 + c * chunk, s0 + (c + 1) * chunk))
    return torch.tensor(idx)


class CPCoreAttention:
    """All ranks' K/V gathered, each sequence causal over its real tokens (positions global)."""

    def __call__(self, q_all, k_all, v_all, cu_seqlens, cu_seqlens_padded, cp_size):
        # q_all etc: list over ranks of [tokens_on_rank, h, d]; returns list over ranks of [tokens_on_rank, h*d]
        total = int(cu_seqlens_padded[-1])
        h, d = q_all[0].shape[1:]
        gq = torch.zeros(total, h, d)
        gk = torch.zeros(total, h, d)
        gv = torch.zeros(total, h, d)
        for r in range(cp_size):
            idx = thd_partition_indices(cu_seqlens_padded, cp_size, r)
            gq[idx], gk[idx], gv[idx] = q_all[r], k_all[r], v_all[r]
        out = torch.zeros(total, h, d)
        for b in range(cu_seqlens.numel() - 1):
            s0 = int(cu_seqlens_padded[b])
            n = int(cu_seqlens[b + 1] - cu_seqlens[b])
            q = gq[s0 : s0 + n].transpose(0, 1)
            k = gk[s0 : s0 + n].transpose(0, 1)
            v = gv[s0 : s0 + n].transpose(0, 1)
            scores = q @ k.transpose(-1, -2) / d ** 0.5
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            out[s0 : s0 + n] = (scores.softmax(-1) @ v).transpose(0, 1)
        return [out[thd_partition_indices(cu_seqlens_padded, cp_size, r)].reshape(-1, h * d) for r in range(cp_size)]


class MultiheadAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, qkv_format="thd", cp_size=1):
        super().__init__()
        self.qkv_format = qkv_format
        self.cp_size = cp_size
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.core_attention = CPCoreAttention()

    def forward(
        self,
        hidden_states_per_rank,
        rotary_pos_emb,
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        pad_between_seqs,
    ):
        qs, ks, vs = [], [], []
        for cp_rank, hidden_states in enumerate(hidden_states_per_rank):
            mixed = self.qkv(hidden_states)
            query_layer, key_layer, value_layer = (
                x.reshape(x.size(0), -1, self.hidden_size_per_attention_head) for x in mixed.chunk(3, dim=-1)
            )
            q_pos_emb, k_pos_emb = (rotary_pos_emb,) * 2
            if FIXED:
                if pad_between_seqs:
                    rotary_pos_cu_seq_lens_q = cu_seqlens_q_padded
                    rotary_pos_cu_seq_lens_kv = cu_seqlens_kv_padded
                else:
                    rotary_pos_cu_seq_lens_q = cu_seqlens_q
                    rotary_pos_cu_seq_lens_kv = cu_seqlens_kv
            else:
                rotary_pos_cu_seq_lens_q = cu_seqlens_q
                rotary_pos_cu_seq_lens_kv = cu_seqlens_kv
            query_layer = apply_rotary_pos_emb(
                query_layer, q_pos_emb, self.qkv_format, fused=True,
                cu_seqlens=rotary_pos_cu_seq_lens_q, cp_size=self.cp_size, cp_rank=cp_rank,
            )
            key_layer = apply_rotary_pos_emb(
                key_layer, k_pos_emb, self.qkv_format, fused=True,
                cu_seqlens=rotary_pos_cu_seq_lens_kv, cp_size=self.cp_size, cp_rank=cp_rank,
            )
            qs.append(query_layer)
            ks.append(key_layer)
            vs.append(value_layer)
        context = self.core_attention(qs, ks, vs, cu_seqlens_q, cu_seqlens_q_padded, self.cp_size)
        return [self.proj(c) for c in context]


def main():
    # two packed sequences, lengths 5 and 11, each padded to a multiple of 2 * cp_size
    seqlens = [5, 11]
    divisor = 2 * CP_SIZE
    padded = [(s + divisor - 1) // divisor * divisor for s in seqlens]
    cu_seqlens = torch.tensor([0] + seqlens).cumsum(0).to(torch.int32)
    cu_seqlens_padded = torch.tensor([0] + padded).cumsum(0).to(torch.int32)

    tokens = torch.zeros(int(cu_seqlens_padded[-1]), dtype=torch.long)
    labels = torch.full_like(tokens, -100)
    for b, n in enumerate(seqlens):
        s0 = int(cu_seqlens_padded[b])
        ids = torch.randint(1, VOCAB, (n + 1,))
        tokens[s0 : s0 + n] = ids[:-1]
        labels[s0 : s0 + n] = ids[1:]

    embed = nn.Embedding(VOCAB, HIDDEN)
    attn = MultiheadAttention(HIDDEN, HEADS, qkv_format="thd", cp_size=CP_SIZE)
    head = nn.Linear(HIDDEN, VOCAB)
    rope = RotaryPositionEmbedding(HEAD_DIM)
    rotary_pos_emb = rope(max(padded))

    hidden_per_rank, labels_per_rank = [], []
    for r in range(CP_SIZE):
        idx = thd_partition_indices(cu_seqlens_padded, CP_SIZE, r)
        hidden_per_rank.append(embed(tokens[idx]))
        labels_per_rank.append(labels[idx])

    with torch.no_grad():
        outs = attn(
            hidden_per_rank, rotary_pos_emb,
            cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
            cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
            pad_between_seqs=True,
        )
        loss_sum, count = 0.0, 0
        for r in range(CP_SIZE):
            logits = head(hidden_per_rank[r] + outs[r])
            keep = labels_per_rank[r] != -100
            loss_sum += nn.functional.cross_entropy(logits[keep], labels_per_rank[r][keep], reduction="sum").item()
            count += int(keep.sum())
    print(f"cp_size={CP_SIZE} seqlens={seqlens} padded={padded}")
    print(f"rank0 first-token output[:4]: {outs[0][0, :4].tolist()}")
    print(f"lm loss over {count} real tokens: {loss_sum / count:.6f}")


if __name__ == "__main__":
    main()
