# bigcode-project/Megatron-LM commit f1a50a3 ("Flash Attention inference fix", from NVIDIA/Megatron-LM): FlashSelfAttention.
# In inference with the KV cache the query (1 token) and keys (whole prefix) differ in length, but the key cu_seqlens/max_s were
# built from the query length and causal=True was kept, so each decode step attended to the wrong single key row.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def rearrange_bs(x):  # einops rearrange(x, 'b s ... -> (b s) ...')
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def flash_attn_unpadded_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale=None, causal=False):
    # CPU float32 stand-in for flash_attn (v1) flash_attn_unpadded_func: varlen attention per cu_seqlens segment,
    # causal mask aligned to the top-left corner as in flash-attn < 2.1 (same alignment as SDPA's is_causal).
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi, ki, vi = (t.transpose(0, 1)[None] for t in (q[qs:qe], k[ks:ke], v[ks:ke]))  # (1, h, s, d)
        oi = F.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)
        out[qs:qe] = oi[0].transpose(0, 1)
    return out


class FlashSelfAttention(nn.Module):
    # megatron/model/transformer.py (dtype / is_cuda asserts dropped for the CPU float32 run)
    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.dropout_p = attention_dropout

    def forward(self, q, k, v):
        """q, k, v: (batch, seqlen, nheads, headdim)"""
        if not FIXED:
            batch_size, seqlen = q.shape[0], q.shape[1]
            q, k, v = [rearrange_bs(x) for x in [q, k, v]]
            max_s = seqlen
            cu_seqlens = torch.arange(0, (batch_size + 1) * seqlen, step=seqlen, dtype=torch.int32, device=q.device)
            output = flash_attn_unpadded_func(
                q, k, v, cu_seqlens, cu_seqlens, max_s, max_s,
                self.dropout_p if self.training else 0.0,
                softmax_scale=self.softmax_scale, causal=self.causal
            )
        else:
            batch_size, seqlen_q = q.shape[0], q.shape[1]
            if self.training:
                q, k, v = [rearrange_bs(x) for x in [q, k, v]]
                cu_seqlens = torch.arange(0, (batch_size + 1) * seqlen_q, step=seqlen_q, dtype=torch.int32, device=q.device)
                output = flash_attn_unpadded_func(
                    q, k, v, cu_seqlens, cu_seqlens, seqlen_q, seqlen_q,
                    self.dropout_p if self.training else 0.0,
                    softmax_scale=self.softmax_scale, causal=self.causal
                )
            else:
                # turn off FA causal mask after first inference autoregressive iteration
                # only on first autoregressive step do q,k,v have same seqlen
                seqlen_k = k.shape[1]
                is_causal = seqlen_q == seqlen_k
                q, k, v = [rearrange_bs(x) for x in [q, k, v]]
                cu_seqlens_q = torch.arange(0, (batch_size + 1) * seqlen_q, step=seqlen_q, dtype=torch.int32, device=q.device)
                cu_seqlens_k = torch.arange(0, (batch_size + 1) * seqlen_k, step=seqlen_k, dtype=torch.int32, device=q.device)
                output = flash_attn_unpadded_func(
                    q, k, v, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                    0.0,
                    softmax_scale=self.softmax_scale, causal=is_causal
                )
        return output.reshape(batch_size, -1, *output.shape[1:])  # rearrange '(b s) ... -> b s ...'


class ParallelAttention(nn.Module):
    # trimmed megatron ParallelAttention (self-attn, use_flash_attn=True) with its inference key/value memory
    def __init__(self, hidden, heads, layer_number):
        super().__init__()
        self.heads, self.head_dim, self.layer_number = heads, hidden // heads, layer_number
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.core_attention_flash = FlashSelfAttention(causal=True, attention_dropout=0.0)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, inference_params=None):
        b, s, _ = hidden_states.shape
        q, k, v = self.query_key_value(hidden_states).view(b, s, self.heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        if inference_params is not None:
            mem = inference_params.key_value_memory_dict
            if self.layer_number in mem:
                pk, pv = mem[self.layer_number]
                k, v = torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)
            mem[self.layer_number] = (k, v)
        context = self.core_attention_flash(q.contiguous(), k.contiguous(), v.contiguous())
        return self.dense(context.reshape(b, s, -1))


class ParallelTransformerLayer(nn.Module):
    def __init__(self, hidden, heads, layer_number):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = ParallelAttention(hidden, heads, layer_number)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, inference_params=None):
        x = x + self.self_attention(self.input_layernorm(x), inference_params)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTModel(nn.Module):
    def __init__(self, vocab=50, hidden=64, heads=4, layers=2, max_pos=32):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.layers = nn.ModuleList([ParallelTransformerLayer(hidden, heads, i + 1) for i in range(layers)])
        self.final_layernorm = nn.LayerNorm(hidden)

    def forward(self, tokens, position_ids, inference_params=None):
        x = self.word_embeddings(tokens) + self.position_embeddings(position_ids)
        for layer in self.layers:
            x = layer(x, inference_params)
        return self.final_layernorm(x) @ self.word_embeddings.weight.t()


class InferenceParams:
    def __init__(self):
        self.key_value_memory_dict = {}


model = GPTModel().eval()  # inference: self.training is False
prompts = torch.randint(0, 50, (2, 6))  # batch of 2 code prompts, same length
steps = 6

with torch.no_grad():
    # megatron text_generation loop: prefill with the prompt, then one token per step with the KV cache
    params = InferenceParams()
    tokens = prompts.clone()
    prev = 0
    cached_logits = []
    for cur in range(prompts.shape[1], prompts.shape[1] + steps):
        logits = model(tokens[:, prev:cur], torch.arange(prev, cur)[None].expand(2, -1), params)
        cached_logits.append(logits[:, -1])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        prev = cur
    # reference: recompute the whole sequence without cache for every step, same generated tokens
    worst = 0.0
    for i, cur in enumerate(range(prompts.shape[1], prompts.shape[1] + steps)):
        ref = model(tokens[:, :cur], torch.arange(cur)[None].expand(2, -1), None)[:, -1]
        worst = max(worst, (ref - cached_logits[i]).abs().max().item())
print(f"max |logits(KV-cache decode) - logits(full recompute)| over {steps} steps: {worst:.6f}")
