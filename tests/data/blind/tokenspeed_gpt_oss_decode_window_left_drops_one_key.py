# lightseekorg/tokenspeed#578 (commit a32e999a; Triton/Gluon decode kernels, torch port): window_left is exclusive
# of the current token (config.sliding_window - 1), but the decode path kept min(cache_len, WINDOW_LEFT) keys, so each
# decoded token of a sliding layer attended one key too few.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class GptOssConfig:
    vocab_size, hidden_size, num_attention_heads, head_dim = 64, 32, 4, 8
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    sliding_window = 4
    max_position_embeddings = 64


def get_attention_sliding_window_size(config):
    # window_left is exclusive: keys strictly to the left of the current token
    return config.sliding_window - 1


def mha_prefill(q, k, v, window_left):
    # q, k, v: [heads, seqlen, head_dim]; causal, window_left keys to the left plus the current one
    s = q.shape[1]
    qi = torch.arange(s)[:, None]
    kj = torch.arange(s)[None, :]
    mask = kj <= qi
    if window_left >= 0:
        mask = mask & (kj >= qi - window_left)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def mha_decode_with_kvcache(q, k_cache, v_cache, cache_seqlens, window_left):
    # q: [bs, heads, 1, head_dim]; k_cache/v_cache: [bs, heads, max_len, head_dim]; cache_seqlens includes the new token
    kv_idx = torch.arange(k_cache.shape[2])[None, :]
    cache_len = cache_seqlens[:, None]
    if window_left >= 0:
        window = window_left + 1 if FIXED else window_left
        cur_batch_seq_len = torch.minimum(cache_len, torch.full_like(cache_len, window))
    else:
        cur_batch_seq_len = cache_len
    kv_start_offset = cache_len - cur_batch_seq_len
    mask = (kv_idx >= kv_start_offset) & (kv_idx < cache_len)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask[:, None, None, :])


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.nh, self.hd = config.num_attention_heads, config.head_dim
        use_sliding_window = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window_size = get_attention_sliding_window_size(config) if use_sliding_window else -1
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * self.nh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, config.hidden_size, bias=False)
        self.k_cache = self.v_cache = None

    def forward(self, x, cache_seqlens, decode):
        bs, s, _ = x.shape
        q, k, v = self.qkv_proj(x).view(bs, s, 3, self.nh, self.hd).permute(2, 0, 3, 1, 4)
        if not decode:  # prefill: one sequence per row, each of its own length (varlen)
            outs = []
            for b in range(bs):
                n = int(cache_seqlens[b])
                self.k_cache[b, :, :n], self.v_cache[b, :, :n] = k[b, :, :n], v[b, :, :n]
                o = mha_prefill(q[b, :, :n], k[b, :, :n], v[b, :, :n], self.sliding_window_size)
                outs.append(F.pad(o, (0, 0, 0, s - n)))
            out = torch.stack(outs)
        else:
            pos = cache_seqlens - 1
            self.k_cache[torch.arange(bs), :, pos] = k[:, :, 0]
            self.v_cache[torch.arange(bs), :, pos] = v[:, :, 0]
            out = mha_decode_with_kvcache(q, self.k_cache, self.v_cache, cache_seqlens, self.sliding_window_size)
        return self.o_proj(out.transpose(1, 2).reshape(bs, s, -1))


class GptOssModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([GptOssAttention(config, i) for i in range(len(config.layer_types))])
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def setup_cache(self, bs):
        for layer in self.layers:
            shape = (bs, layer.nh, self.config.max_position_embeddings, layer.hd)
            layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)

    def forward(self, ids, positions, cache_seqlens, decode):
        h = self.embed(ids) + self.pos(positions)
        for layer in self.layers:
            h = h + layer(h, cache_seqlens, decode)
        return self.lm_head(self.norm(h))


config = GptOssConfig()
model = GptOssModel(config).eval()
prompt_lens = torch.tensor([7, 5])
prompts = torch.randint(0, config.vocab_size, (2, 7))
with torch.no_grad():
    model.setup_cache(2)
    logits = model(prompts, torch.arange(7).expand(2, 7), prompt_lens, decode=False)
    cache_seqlens = prompt_lens.clone()
    tok = logits[torch.arange(2), prompt_lens - 1].argmax(-1)
    seqs, dec_logits = [prompts[b, :prompt_lens[b]].tolist() for b in range(2)], []
    for _ in range(4):  # decode loop
        for b in range(2):
            seqs[b].append(int(tok[b]))
        cache_seqlens = cache_seqlens + 1
        out = model(tok[:, None], (cache_seqlens - 1)[:, None], cache_seqlens, decode=True)[:, 0]
        dec_logits.append(out)
        tok = out.argmax(-1)
    diff = 0.0
    for b in range(2):  # reference: the whole sequence through the prefill path
        ids = torch.tensor(seqs[b])[None]
        model.setup_cache(1)
        ref = model(ids, torch.arange(ids.shape[1])[None], torch.tensor([ids.shape[1]]), decode=False)[0, -4:]
        got = torch.stack([d[b] for d in dec_logits])
        diff = max(diff, (got - ref).abs().max().item())
print("max |decode logits - prefill-path reference| = %.5f" % diff)
