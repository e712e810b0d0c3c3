# InternLM/xtuner#1248 (commit 17d741b21, "Fix Qwen3VL Position_id").
# xtuner v1 SequenceContext.__init__ took a position_ids argument, stored it, then always rebuilt
# position_ids from cu_seq_lens (torch.arange per packed segment) and overwrote it. The Qwen3-VL
# collator's 3-axis M-RoPE position_ids (images get (t, h, w) grid positions) were thrown away and the
# model rotated every token of the packed row with plain 1-D per-document positions.
# Fix: only build the arange positions when position_ids is None.
# Ported small: SequenceContext (xtuner/v1/data_proto/sequence_context.py), a Qwen3-VL style
# get_rope_index for each packed sample, M-RoPE attention over cu_seq_lens (varlen stand-in with SDPA).
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SequenceContext:
    def __init__(self, input_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                 num_padding=0, device="cpu", position_ids=None, image_grid_thw=None):
        self.input_ids = input_ids
        self.cu_seq_lens_q = cu_seq_lens_q
        self.cu_seq_lens_k = cu_seq_lens_k
        self.max_length_q = torch.tensor(max_length_q) if isinstance(max_length_q, int) else max_length_q
        self.max_length_k = torch.tensor(max_length_k) if isinstance(max_length_k, int) else max_length_k
        self.num_padding = num_padding
        self.device = device
        self.position_ids = position_ids
        self.image_grid_thw = image_grid_thw

        seq_lens_k = self.cu_seq_lens_k[1:] - self.cu_seq_lens_k[:-1]
        seq_lens_q = self.cu_seq_lens_q[1:] - self.cu_seq_lens_q[:-1]

        if FIXED:
            if position_ids is None:
                _position_ids = [torch.arange(k - q, k) for q, k in zip(seq_lens_q, seq_lens_k)]
                position_ids = torch.cat(_position_ids).unsqueeze(0).to(self.cu_seq_lens_k.device)
        else:
            _position_ids = [torch.arange(k - q, k) for q, k in zip(seq_lens_q, seq_lens_k)]
            position_ids = torch.cat(_position_ids).unsqueeze(0).to(self.cu_seq_lens_k.device)

        self.position_ids = position_ids


IMAGE_TOKEN = 7
MERGE = 2


def get_rope_index(input_ids, grid_thw):
    # Qwen-VL style: text runs count on all three axes; an image block takes (t, h, w) grid positions
    # offset by the text before it; text after the image restarts at max + 1.
    pos = torch.zeros(3, input_ids.numel(), dtype=torch.long)
    i, nxt = 0, 0
    ids = input_ids.tolist()
    while i < len(ids):
        if ids[i] == IMAGE_TOKEN:
            t, h, w = grid_thw
            h, w = h // MERGE, w // MERGE
            n = t * h * w
            tt = torch.arange(t).view(-1, 1).expand(-1, h * w).flatten()
            hh = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
            ww = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
            pos[:, i:i + n] = torch.stack([tt, hh, ww]) + nxt
            nxt = int(pos[:, i:i + n].max()) + 1
            i += n
        else:
            pos[:, i] = nxt
            nxt += 1
            i += 1
    return pos


def qwen3_vl_sft_collator(instances, pack_max_length):
    input_ids, position_ids_list, num_tokens, grids = [], [], [], []
    for inst in instances:
        ids = torch.tensor(inst["input_ids"])
        input_ids.append(ids)
        num_tokens.append(ids.numel())
        position_ids_list.append(get_rope_index(ids, inst["image_grid_thw"]).unsqueeze(1))
        grids.append(inst["image_grid_thw"])
    input_ids = torch.cat(input_ids).unsqueeze(0)
    position_ids = torch.cat(position_ids_list, dim=-1)  # (3, 1, seq)
    cu_seq_lens = torch.cumsum(torch.tensor([0] + num_tokens), dim=0).int()
    max_len = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    return SequenceContext(input_ids=input_ids, cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens,
                           max_length_q=max_len, max_length_k=max_len, position_ids=position_ids,
                           image_grid_thw=torch.tensor(grids))


class Config:
    vocab_size = 32
    hidden_size = 32
    num_attention_heads = 2
    head_dim = 16
    rope_theta = 10000.0
    mrope_section = [4, 2, 2]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen3VLTextRotaryEmbedding(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.mrope_section = config.mrope_section

    def forward(self, x, position_ids):
        if position_ids.ndim == 2:
            position_ids = position_ids[None, ...].expand(3, position_ids.shape[0], -1)
        freqs = position_ids[..., None].float() * self.inv_freq  # (3, b, s, d/2)
        # interleaved M-RoPE: frequency j takes its axis from j % 3 within the sections
        freqs_t = freqs[0].clone()
        for dim, offset in enumerate((1, 2), start=1):
            length = self.mrope_section[dim] * 3
            idx = slice(offset, length, 3)
            freqs_t[..., idx] = freqs[dim, ..., idx]
        emb = torch.cat((freqs_t, freqs_t), dim=-1)
        return emb.cos(), emb.sin()


class Attention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h, self.d = config.num_attention_heads, config.head_dim
        self.q_proj = torch.nn.Linear(config.hidden_size, self.h * self.d)
        self.k_proj = torch.nn.Linear(config.hidden_size, self.h * self.d)
        self.v_proj = torch.nn.Linear(config.hidden_size, self.h * self.d)
        self.o_proj = torch.nn.Linear(self.h * self.d, config.hidden_size)

    def forward(self, hidden_states, position_embeddings, seq_ctx):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.h, self.d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, self.h, self.d).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.h, self.d).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # flash_attn_varlen_func(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_q, max_k, causal=True)
        outs = []
        cu = seq_ctx.cu_seq_lens_q.tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            outs.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, start:end],
                                                       v[:, :, start:end], is_causal=True))
        out = torch.cat(outs, dim=2).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class TinyQwen3VLText(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = Qwen3VLTextRotaryEmbedding(config)
        self.layers = torch.nn.ModuleList([Attention(config) for _ in range(2)])
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, seq_ctx):
        h = self.embed_tokens(seq_ctx.input_ids)
        pe = self.rotary_emb(h, seq_ctx.position_ids)
        for layer in self.layers:
            h = h + layer(h, pe, seq_ctx)
        return self.lm_head(h)


instances = [
    {"input_ids": [1, 2] + [IMAGE_TOKEN] * 4 + [3, 4, 5], "image_grid_thw": (1, 4, 4)},
    {"input_ids": [6, 2, 3] + [IMAGE_TOKEN] * 8 + [9, 10, 11, 12], "image_grid_thw": (2, 4, 4)},
]
seq_ctx = qwen3_vl_sft_collator(instances, pack_max_length=32)
model = TinyQwen3VLText(Config()).eval()
labels = torch.cat([torch.tensor(i["input_ids"][1:] + [-100]) for i in instances]).unsqueeze(0)
labels[labels == IMAGE_TOKEN] = -100
with torch.no_grad():
    logits = model(seq_ctx)
loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
print("position_ids shape:", tuple(seq_ctx.position_ids.shape))
print("loss: %.6f" % loss.item())
print("last token logits[:4]:", [round(x, 4) for x in logits[0, -1, :4].tolist()])
