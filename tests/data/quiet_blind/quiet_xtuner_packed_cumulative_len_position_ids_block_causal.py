# Citation: InternLM/xtuner xtuner/model/modules/dispatch/attention.py @1b0340c6388640605f29f89b4cda689100d5e652
#   (varlen_flash_attn: cumulative_len / max_seqlen passed as cu_seqlens) and xtuner/model/modules/dispatch/llama.py
#   @5af250da7e7ce6ec5f2c6d3a185dee6a43747426 (llama_attn_forward reads cumulative_len and position_ids from the
#   message hub when packing); xtuner/dataset/utils.py Packer (position_ids restart per sample); recalled.
# Packed (pack_to_max_length) SFT batch: several samples in one row, `cumulative_len` gives their boundaries and
# `position_ids` restart at 0 for each sample (RoPE). No flash-attn on CPU, so the varlen call is replaced by one
# SDPA call over the whole row with a block-diagonal causal mask built from cumulative_len (same semantics as
# flash_attn_varlen_func(causal=True)). The tail that fills the row to max_length is its own segment.
# Checked against each sample run alone (causal SDPA, positions 0..n-1): hidden states and per-sample loss.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # bs, 1, seq, dim
    sin = sin[position_ids].unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=256, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)


def varlen_attn(query_states, key_states, value_states, cumulative_len, max_seqlen):
    # q/k/v: (bs=1, heads, seq, dim); cumulative_len: (n_seg + 1,) cu_seqlens over the flattened row
    q_len = query_states.size(2)
    seg = torch.zeros(q_len, dtype=torch.long)
    seg[cumulative_len[1:-1]] = 1
    seg = seg.cumsum(0)  # segment id of every token
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    mask = (seg[:, None] == seg[None, :]) & causal
    return F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=mask)


class LlamaAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_heads = heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim)

    def forward(self, hidden_states, position_ids, cumulative_len=None, max_seqlen=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, self.rotary_emb.cos_cached, self.rotary_emb.sin_cached, position_ids)
        if cumulative_len is not None:
            out = varlen_attn(q, k, v, cumulative_len, max_seqlen)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, heads)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x, position_ids, cumulative_len=None, max_seqlen=None):
        x = x + self.self_attn(self.input_layernorm(x), position_ids, cumulative_len, max_seqlen)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=4, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids, cumulative_len=None, max_seqlen=None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids, cumulative_len, max_seqlen)
        return self.lm_head(self.norm(x))


def pack(samples, max_length, pad_index=0, ignore=-100):
    """Packer: concatenate samples into one row of max_length; the filler at the end is one more segment."""
    input_ids, labels, position_ids, cumulative_len = [], [], [], [0]
    for ids, lab in samples:
        input_ids += ids
        labels += lab
        position_ids += list(range(len(ids)))
        cumulative_len.append(len(input_ids))
    n_fill = max_length - len(input_ids)
    if n_fill > 0:
        input_ids += [pad_index] * n_fill
        labels += [ignore] * n_fill
        position_ids += list(range(n_fill))
        cumulative_len.append(max_length)
    lens = [b - a for a, b in zip(cumulative_len[:-1], cumulative_len[1:])]
    return (torch.tensor([input_ids]), torch.tensor([labels]), torch.tensor([position_ids]),
            torch.tensor(cumulative_len), max(lens))


def main():
    model = TinyLlama().eval()
    samples = []
    for n, n_prompt in [(7, 3), (4, 2), (9, 5)]:
        ids = torch.randint(1, 64, (n,)).tolist()
        samples.append((ids, [-100] * n_prompt + ids[n_prompt:]))
    input_ids, labels, position_ids, cumulative_len, max_seqlen = pack(samples, max_length=24)
    with torch.no_grad():
        logits = model(input_ids, position_ids, cumulative_len, max_seqlen)
        for s, (ids, lab) in enumerate(samples):
            a, b = cumulative_len[s].item(), cumulative_len[s + 1].item()
            ref = model(torch.tensor([ids]), torch.arange(len(ids))[None])
            assert torch.allclose(logits[0, a:b], ref[0], atol=1e-5), s
            # per-sample loss with shifted labels, inside the sample only
            lp = F.cross_entropy(logits[0, a:b - 1], labels[0, a + 1:b], ignore_index=-100)
            lr = F.cross_entropy(ref[0, :-1], torch.tensor(lab[1:]), ignore_index=-100)
            assert torch.allclose(lp, lr, atol=1e-5), s
    print("ok: packed row (cumulative_len", cumulative_len.tolist(), ") matches per-sample runs")


if __name__ == "__main__":
    main()
