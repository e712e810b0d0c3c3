# OpenEvaByte/evabyte#10: prepare_eva_training_mask (training_utils.py) restarts a document at
# `start_index = token_idx + 1`, so the first token of every packed document after the first gets the
# article-separator id 0: its own attention row is fully masked and the rest of its document cannot see it.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
MASK_MIN_VALUE = -10e10
EOS_ID = 1


def prepare_eva_attention_mask(seq_len, device, window_size):
    assert seq_len % window_size == 0
    window_causal_mask = torch.ones((1, 1, 1, window_size, window_size), device=device).triu(1).to(torch.bool)
    return window_causal_mask


def prepare_eva_training_mask(target_token_type_ids, window_size, EOS_TOKEN_TYPE_ID=None, PAD_TOKEN_TYPE_ID=None):
    batch_size, num_tokens = target_token_type_ids.shape
    window_causal_mask = prepare_eva_attention_mask(num_tokens, target_token_type_ids.device, window_size)
    #### step 1: mark each document with a unique id
    end_token_ids = {EOS_TOKEN_TYPE_ID, PAD_TOKEN_TYPE_ID}
    token_types = torch.zeros(batch_size, num_tokens)
    for sequence_idx, sequence in enumerate(target_token_type_ids):
        num_articles = 0
        start_index = 0
        for token_idx, token_type_id in enumerate(sequence):
            if start_index is not None and token_type_id.item() in end_token_ids:
                num_articles += 1
                end_index = token_idx if token_type_id == PAD_TOKEN_TYPE_ID else token_idx + 1
                token_types[sequence_idx][start_index:end_index] = num_articles
                start_index = None
            elif start_index is None and token_type_id not in end_token_ids:
                start_index = token_idx if FIXED else token_idx + 1
    num_windows = num_tokens // window_size
    article_separator = 0
    #### step 2: generate attention masks for each window
    token_types_windows = token_types.reshape(batch_size, num_windows, window_size, 1)
    token_types_windows_t = token_types_windows.transpose(-1, -2)
    token_types_windows = torch.where(token_types_windows == article_separator, -1, token_types_windows)
    window_3d_mask = ~(token_types_windows == token_types_windows_t)
    window_mask = torch.logical_or(window_causal_mask, window_3d_mask.unsqueeze(1))
    return window_mask  # [b, 1, w, window, window], True = masked


def prepare_doc_mask_position_ids(input_ids, window_size, eos_token_id):
    attention_mask = prepare_eva_training_mask(input_ids, window_size, EOS_TOKEN_TYPE_ID=eos_token_id)
    bs, seq_len = input_ids.shape
    position_ids = []
    for b in range(bs):
        position_id = torch.arange(0, seq_len, dtype=torch.long)
        eos_ind = position_id[input_ids[b] == eos_token_id]
        prev_index = 0
        for j in range(eos_ind.shape[0]):
            i = eos_ind[j]
            position_id[(i + 1):] -= (i + 1 - prev_index)
            prev_index = i + 1
        position_ids.append(position_id)
    return attention_mask, torch.stack(position_ids, dim=0)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attention_op(q, k, v, attn_mask, head_dim_scaling):
    attn = torch.matmul(q, k.transpose(-2, -1)) * head_dim_scaling
    if attn_mask is not None:
        attn = attn.masked_fill(attn_mask, MASK_MIN_VALUE)
    attn_weights = torch.softmax(attn, dim=-1).to(q.dtype)
    return torch.matmul(attn_weights, v)


class EvaAttention(nn.Module):
    """exact local (window) attention part of EVA; one window covers the whole training sequence here"""

    def __init__(self, hidden_size=32, num_heads=4, window_size=16):
        super().__init__()
        self.num_heads, self.head_dim, self.window_size = num_heads, hidden_size // num_heads, window_size
        self.head_dim_scaling = self.head_dim ** -0.5
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def window_partition(self, x):
        gw, d = x.shape[-2:]
        return x.reshape(*x.shape[:-2], gw // self.window_size, self.window_size, d)

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, n, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(bsz, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = position_ids[:, None, :, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        w_q, w_k, w_v = (self.window_partition(t) for t in (q, k, v))
        out = attention_op(w_q, w_k, w_v, attention_mask, self.head_dim_scaling)
        out = out.reshape(bsz, self.num_heads, n, self.head_dim).transpose(1, 2).reshape(bsz, n, -1)
        return self.o_proj(out)


class TinyEvaByte(nn.Module):
    def __init__(self, vocab=64, hidden_size=32, n_layers=2, window_size=16):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden_size)
        self.layers = nn.ModuleList(EvaAttention(hidden_size, window_size=window_size) for _ in range(n_layers))
        self.norm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab, bias=False)

    def forward(self, input_ids, attention_mask, position_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = h + layer(h, attention_mask, position_ids)
        return self.lm_head(self.norm(h))


model = TinyEvaByte().eval()
# packed training row: two documents, each ended by the <file_sep> EOS
doc_a, doc_b = torch.randint(2, 64, (9,)), torch.randint(2, 64, (5,))
input_ids = torch.cat([doc_a, torch.tensor([EOS_ID]), doc_b, torch.tensor([EOS_ID])])[None]
attention_mask, position_ids = prepare_doc_mask_position_ids(input_ids, window_size=16, eos_token_id=EOS_ID)
with torch.no_grad():
    logits = model(input_ids, attention_mask, position_ids)
    # reference: document b on its own, causal only
    alone_ids = torch.cat([doc_b, torch.tensor([EOS_ID])])[None]
    alone_mask = torch.ones(6, 6, dtype=torch.bool).triu(1)[None, None, None]
    single = TinyEvaByte(window_size=6)
    single.load_state_dict(model.state_dict())
    alone = single(alone_ids, alone_mask, torch.arange(6)[None])
diff = (logits[0, 10:] - alone[0]).abs().max().item()
print(f"fixed={FIXED} max |packed - alone| logits of document b: {diff:.4f}")
