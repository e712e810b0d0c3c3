"""sglang Intel AMX CPU backend: extend_attention_cpu always causal, BERT rerankers masked causally.

Citation: sgl-project/sglang#35434 "[CPU] Fix wrongly causal-masked bidirectional attention"
(merged). Read from the PR description; the C++ diff (extend.cpp) and the backend's Python change
were not read line by line, the port below follows the description.

Bug: on the Intel AMX CPU attention backend, `extend_attention_cpu` always applied a causal mask
in its stage-2 loop over the extend tokens. The layer says otherwise: encoder-only models (BERT-
family rerankers / embedders such as bge-reranker) build `RadixAttention(...,
attn_type=AttentionType.ENCODER_ONLY)`, and the other backends (torch_native, triton, flashinfer)
turn that into causal=False. On CPU every token of a (query, document) pair saw only the tokens
before it; the reported symptom was bge-reranker-base scoring "hi" and a relevant passage the same.
Fix: `extend_attention_cpu` takes `is_causal` (default true); its stage-2 loop runs over the full
extend range and applies the causal mask only when `is_causal` is set; the backend passes
`is_causal=False` for ENCODER_ONLY layers.

This program: a small XLM-R style cross-encoder (random weights) served the sglang way: a ragged
batch of two (query, document) pairs packed into one token stream with `extend_seq_lens` /
`extend_start_loc`, no prefix, attention through `IntelAMXAttnBackend.forward_extend` and a torch
port of the kernel (softmax over q @ k^T per request).
"""
import sys
from enum import Enum

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class AttentionType(Enum):
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


class ForwardBatch:
    def __init__(self, extend_seq_lens, extend_prefix_lens):
        self.extend_seq_lens = extend_seq_lens
        self.extend_prefix_lens = extend_prefix_lens
        self.seq_lens = extend_seq_lens + extend_prefix_lens
        self.extend_start_loc = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
        self.batch_size = len(extend_seq_lens)


def extend_attention_cpu(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
                         req_to_token, req_pool_indices, seq_lens, extend_seq_lens,
                         extend_start_loc, max_len_extend, sm_scale, logit_cap, is_causal=True):
    """Port of sgl_kernel.cpu extend_attention_cpu: stage 1 over the cached prefix, stage 2 over the
    extend tokens, one online softmax over both."""
    num_heads = q_extend.shape[1]
    num_kv_heads = k_extend.shape[1]
    group = num_heads // num_kv_heads
    for i in range(len(seq_lens)):
        start = int(extend_start_loc[i])
        n_extend = int(extend_seq_lens[i])
        n_prefix = int(seq_lens[i]) - n_extend
        q = q_extend[start:start + n_extend].transpose(0, 1)  # [H, n, D]
        # stage 1: prefix keys from the KV pool
        slots = req_to_token[req_pool_indices[i], :n_prefix]
        k = torch.cat([k_buffer[slots], k_extend[start:start + n_extend]], 0).transpose(0, 1)
        v = torch.cat([v_buffer[slots], v_extend[start:start + n_extend]], 0).transpose(0, 1)
        k = k.repeat_interleave(group, 0)
        v = v.repeat_interleave(group, 0)
        s = (q @ k.transpose(-1, -2)) * sm_scale
        if logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        # stage 2: extend keys; key j visible to query m iff j <= m when causal
        if is_causal or not FIXED:
            m = torch.arange(n_extend)[:, None]
            j = torch.arange(n_extend)[None, :]
            s[:, :, n_prefix:] = s[:, :, n_prefix:].masked_fill(j > m, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o_extend[start:start + n_extend] = (p @ v).transpose(0, 1)
    return o_extend


class IntelAMXAttnBackend:
    def __init__(self, max_total_tokens, num_kv_heads, head_dim):
        self.k_buffer = torch.zeros(max_total_tokens, num_kv_heads, head_dim)
        self.v_buffer = torch.zeros(max_total_tokens, num_kv_heads, head_dim)
        self.req_to_token = torch.zeros(8, max_total_tokens, dtype=torch.long)
        self.extend_attention_fwd = extend_attention_cpu

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        o = torch.empty_like(q)
        max_extend_len = int(forward_batch.extend_seq_lens.max())
        kwargs = {}
        if FIXED:
            kwargs["is_causal"] = layer.attn_type != AttentionType.ENCODER_ONLY
        self.extend_attention_fwd(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            k, v, o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.k_buffer, self.v_buffer, self.req_to_token,
            torch.arange(forward_batch.batch_size), forward_batch.seq_lens,
            forward_batch.extend_seq_lens, forward_batch.extend_start_loc, max_extend_len,
            layer.scaling, layer.logit_cap, **kwargs,
        )
        return o


class RadixAttention(nn.Module):
    def __init__(self, num_heads, head_dim, scaling, num_kv_heads, layer_id,
                 attn_type=AttentionType.DECODER, logit_cap=0.0):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.qk_head_dim = self.v_head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.attn_type = attn_type
        self.logit_cap = logit_cap

    def forward(self, q, k, v, forward_batch):
        k = k.view(-1, self.tp_k_head_num, self.qk_head_dim)
        v = v.view(-1, self.tp_k_head_num, self.v_head_dim)
        return forward_batch.attn_backend.forward_extend(
            q, k, v, self, forward_batch, save_kv_cache=self.attn_type != AttentionType.ENCODER_ONLY)


class BertSelfAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_id):
        super().__init__()
        self.head_dim = hidden_size // num_attention_heads
        self.qkv_proj = nn.Linear(hidden_size, 3 * hidden_size)
        self.attn = RadixAttention(num_attention_heads, self.head_dim, self.head_dim ** -0.5,
                                   num_attention_heads, layer_id, attn_type=AttentionType.ENCODER_ONLY)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, forward_batch):
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        attn_output = self.attn(q.contiguous(), k.contiguous(), v.contiguous(), forward_batch)
        return self.LayerNorm(self.dense(attn_output) + hidden_states)


class BertLayer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.attention = BertSelfAttention(config["hidden_size"], config["num_attention_heads"], layer_id)
        self.intermediate = nn.Linear(config["hidden_size"], config["intermediate_size"])
        self.output = nn.Linear(config["intermediate_size"], config["hidden_size"])
        self.LayerNorm = nn.LayerNorm(config["hidden_size"])

    def forward(self, hidden_states, forward_batch):
        h = self.attention(hidden_states, forward_batch)
        return self.LayerNorm(self.output(F.gelu(self.intermediate(h))) + h)


class XLMRobertaForSequenceClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], config["hidden_size"])
        self.layer = nn.ModuleList([BertLayer(config, i) for i in range(config["num_hidden_layers"])])
        self.classifier = nn.Linear(config["hidden_size"], 1)

    def forward(self, input_ids, positions, forward_batch):
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        for layer in self.layer:
            h = layer(h, forward_batch)
        cls = h[forward_batch.extend_start_loc]  # <s> of each pair
        return self.classifier(torch.tanh(cls)).squeeze(-1)


def main():
    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                  num_hidden_layers=2, max_position_embeddings=32)
    model = XLMRobertaForSequenceClassification(config).eval()
    query = [0, 11, 12, 13, 2]
    documents = [[2, 20, 2], [2, 30, 31, 32, 33, 34, 35, 2]]
    pairs = [query + d for d in documents]
    input_ids = torch.tensor([t for p in pairs for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in pairs])
    forward_batch = ForwardBatch(torch.tensor([len(p) for p in pairs]), torch.zeros(2, dtype=torch.long))
    forward_batch.attn_backend = IntelAMXAttnBackend(64, config["num_attention_heads"],
                                                     config["hidden_size"] // config["num_attention_heads"])
    with torch.no_grad():
        scores = model(input_ids, positions, forward_batch)
    print("scores:", [round(float(s), 5) for s in scores])


if __name__ == "__main__":
    main()
