# musubi-tuner (kohya-ss/musubi-tuner commit 5bb0a34, "fix: update attention mask handling for --split_attn"):
# FramePack's packed HunyuanVideo DiT built cu_seqlens from the text mask, but the --split_attn per-sample loop in
# attn_varlen_func ignored it and attended over the full padded [image + text] sequence, so padded prompt tokens leak in.
import sys
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# no optional kernels on this machine, as in the module's import fallbacks
sageattn = None
flash_attn_func = None
xformers_attn_func = None
sageattn_varlen = None
flash_attn_varlen_func = None


def get_cu_seqlens(text_mask, img_len):
    batch_size = text_mask.shape[0]
    text_len = text_mask.sum(dim=1)
    max_len = text_mask.shape[1] + img_len

    cu_seqlens = torch.zeros([2 * batch_size + 1], dtype=torch.int32, device=text_mask.device)

    for i in range(batch_size):
        s = text_len[i] + img_len
        s1 = i * max_len + s
        s2 = (i + 1) * max_len
        cu_seqlens[2 * i + 1] = s1
        cu_seqlens[2 * i + 2] = s2

    if FIXED:
        seq_len = text_len + img_len
        return cu_seqlens, seq_len
    return cu_seqlens


def apply_rotary_emb_transposed(x, freqs_cis):
    cos, sin = freqs_cis.unsqueeze(-2).chunk(2, dim=-1)
    x_real, x_imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, seq_len=None, attn_mode=None,
                     split_attn=False):
    # q,k,v: [batch_size, seqlen, heads, head_dim]
    if cu_seqlens_q is None and cu_seqlens_kv is None and max_seqlen_q is None and max_seqlen_kv is None:
        x = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2)).transpose(1, 2)
        return x
    if split_attn:
        # (sageattn / flash / xformers branches not installed here; the torch branch follows)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if not FIXED:
            x = torch.empty_like(q)
            for i in range(q.size(0)):
                x[i : i + 1] = torch.nn.functional.scaled_dot_product_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1])
        else:
            x = []
            for i in range(q.size(0)):
                seq_len_i = seq_len[i]
                x_i = torch.nn.functional.scaled_dot_product_attention(
                    q[i : i + 1, :, :seq_len_i], k[i : i + 1, :, :seq_len_i], v[i : i + 1, :, :seq_len_i]
                )
                if seq_len_i < max_seqlen_q:
                    x_i = torch.nn.functional.pad(x_i, (0, 0, 0, max_seqlen_q - seq_len_i, 0, 0), mode="constant",
                                                  value=0.0)
                x.append(x_i)
            x = torch.cat(x, dim=0)
        x = x.transpose(1, 2)
        return x
    raise NotImplementedError("No Attn Installed or batch_size > 1 is not supported in this configuration. Try `--split_attn`.")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, heads, head_dim, processor, added_kv=True):
        super().__init__()
        self.heads = heads
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, inner), nn.Linear(dim, inner), nn.Linear(dim, inner)
        self.norm_q, self.norm_k = RMSNorm(head_dim), RMSNorm(head_dim)
        if added_kv:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner), nn.Linear(dim, inner),
                                                                 nn.Linear(dim, inner))
            self.norm_added_q, self.norm_added_k = RMSNorm(head_dim), RMSNorm(head_dim)
            self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])
            self.to_add_out = nn.Linear(inner, dim)
        self.processor = processor


def _unpack(attention_mask):
    if FIXED:
        return attention_mask
    cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv = attention_mask
    return cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, None


class HunyuanAttnProcessorFlashAttnDouble:
    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                 attn_mode: Optional[str] = None, split_attn: Optional[bool] = False):
        cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, seq_len = _unpack(attention_mask)

        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query = apply_rotary_emb_transposed(query, image_rotary_emb)
        key = apply_rotary_emb_transposed(key, image_rotary_emb)

        encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        txt_length = encoder_hidden_states.shape[1]
        encoder_query = attn.norm_added_q(encoder_query)
        encoder_key = attn.norm_added_k(encoder_key)

        query = torch.cat([query, encoder_query], dim=1)
        key = torch.cat([key, encoder_key], dim=1)
        value = torch.cat([value, encoder_value], dim=1)

        hidden_states_attn = attn_varlen_func(query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                              max_seqlen_kv, seq_len, attn_mode=attn_mode, split_attn=split_attn)
        hidden_states_attn = hidden_states_attn.flatten(-2)
        hidden_states, encoder_hidden_states = hidden_states_attn[:, :-txt_length], hidden_states_attn[:, -txt_length:]
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


class HunyuanAttnProcessorFlashAttnSingle:
    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                 attn_mode: Optional[str] = None, split_attn: Optional[bool] = False):
        cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, seq_len = _unpack(attention_mask)
        txt_length = encoder_hidden_states.shape[1]
        hidden_states_cat = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        query = attn.to_q(hidden_states_cat).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states_cat).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states_cat).unflatten(2, (attn.heads, -1))
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query = torch.cat([apply_rotary_emb_transposed(query[:, :-txt_length], image_rotary_emb),
                           query[:, -txt_length:]], dim=1)
        key = torch.cat([apply_rotary_emb_transposed(key[:, :-txt_length], image_rotary_emb), key[:, -txt_length:]],
                        dim=1)
        hidden_states = attn_varlen_func(query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                         seq_len, attn_mode=attn_mode, split_attn=split_attn)
        hidden_states = hidden_states.flatten(-2)
        hidden_states, encoder_hidden_states = hidden_states[:, :-txt_length], hidden_states[:, -txt_length:]
        return hidden_states, encoder_hidden_states


class HunyuanVideoTransformerBlock(nn.Module):
    def __init__(self, dim, heads, head_dim):
        super().__init__()
        self.attn = Attention(dim, heads, head_dim, HunyuanAttnProcessorFlashAttnDouble())
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))
        self.ff_context = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis, attn_mode, split_attn):
        n, c = self.norm(hidden_states) + temb[:, None], self.norm(encoder_hidden_states) + temb[:, None]
        a, ca = self.attn.processor(self.attn, n, c, attention_mask, freqs_cis, attn_mode=attn_mode,
                                    split_attn=split_attn)
        hidden_states = hidden_states + a
        encoder_hidden_states = encoder_hidden_states + ca
        hidden_states = hidden_states + self.ff(self.norm(hidden_states))
        encoder_hidden_states = encoder_hidden_states + self.ff_context(self.norm(encoder_hidden_states))
        return hidden_states, encoder_hidden_states


class HunyuanVideoSingleTransformerBlock(nn.Module):
    def __init__(self, dim, heads, head_dim):
        super().__init__()
        self.attn = Attention(dim, heads, head_dim, HunyuanAttnProcessorFlashAttnSingle(), added_kv=False)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.proj_out = nn.Linear(heads * head_dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis, attn_mode, split_attn):
        text_seq_length = encoder_hidden_states.shape[1]
        residual = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        n = self.norm(residual) + temb[:, None]
        a, ca = self.attn.processor(self.attn, n[:, :-text_seq_length], n[:, -text_seq_length:], attention_mask,
                                    freqs_cis, attn_mode=attn_mode, split_attn=split_attn)
        out = residual + self.proj_out(torch.cat([a, ca], dim=1))
        return out[:, :-text_seq_length], out[:, -text_seq_length:]


class HunyuanVideoTransformer3DModelPacked(nn.Module):
    def __init__(self, in_ch=4, text_dim=20, dim=32, heads=2, head_dim=16, split_attn=False):
        super().__init__()
        self.x_embedder = nn.Linear(in_ch, dim)
        self.context_embedder = nn.Linear(text_dim, dim)
        self.time_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.attn_mode = None
        self.split_attn = split_attn
        self.transformer_blocks = nn.ModuleList([HunyuanVideoTransformerBlock(dim, heads, head_dim) for _ in range(2)])
        self.single_transformer_blocks = nn.ModuleList(
            [HunyuanVideoSingleTransformerBlock(dim, heads, head_dim) for _ in range(2)])
        self.proj_out = nn.Linear(dim, in_ch)
        self.head_dim = head_dim

    def rope(self, batch_size, n):
        pos = torch.arange(n, dtype=torch.float32)[:, None]
        inv = 1.0 / (256 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        f = (pos * inv).repeat_interleave(2, dim=-1)
        return torch.cat([f.cos(), f.sin()], dim=-1)[None].expand(batch_size, -1, -1)

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask):
        batch_size = hidden_states.shape[0]
        hidden_states = self.x_embedder(hidden_states)
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)
        temb = self.time_embed(timestep[:, None].float())
        rope_freqs = self.rope(batch_size, hidden_states.shape[1])

        with torch.no_grad():
            if batch_size == 1 and not (FIXED and self.split_attn):
                # When batch size is 1, we do not need any masks or var-len funcs since cropping is mathematically same
                text_len = encoder_attention_mask.sum().item()
                encoder_hidden_states = encoder_hidden_states[:, :text_len]
                attention_mask = (None, None, None, None, None) if FIXED else (None, None, None, None)
            else:
                img_seq_len = hidden_states.shape[1]
                txt_seq_len = encoder_hidden_states.shape[1]
                if FIXED:
                    cu_seqlens_q, seq_len = get_cu_seqlens(encoder_attention_mask, img_seq_len)
                else:
                    cu_seqlens_q = get_cu_seqlens(encoder_attention_mask, img_seq_len)
                cu_seqlens_kv = cu_seqlens_q
                max_seqlen_q = img_seq_len + txt_seq_len
                max_seqlen_kv = max_seqlen_q
                if FIXED:
                    attention_mask = cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, seq_len
                else:
                    attention_mask = cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv

        for block in self.transformer_blocks:
            hidden_states, encoder_hidden_states = block(hidden_states, encoder_hidden_states, temb, attention_mask,
                                                         rope_freqs, self.attn_mode, self.split_attn)
        for block in self.single_transformer_blocks:
            hidden_states, encoder_hidden_states = block(hidden_states, encoder_hidden_states, temb, attention_mask,
                                                         rope_freqs, self.attn_mode, self.split_attn)
        return self.proj_out(hidden_states)


model = HunyuanVideoTransformer3DModelPacked(split_attn=True).eval()  # --split_attn
B, N, L = 2, 12, 10
latents = torch.randn(B, N, 4)
llama_embeds = torch.randn(B, L, 20)
lengths = [4, 7]
llama_attention_mask = torch.zeros(B, L, dtype=torch.long)
for i, n in enumerate(lengths):
    llama_attention_mask[i, :n] = 1
timestep = torch.tensor([900, 900])

with torch.no_grad():
    batched = model(latents, timestep, llama_embeds, llama_attention_mask)
    diffs = []
    for i, n in enumerate(lengths):
        model.split_attn = False  # batch of 1: the crop path the file calls "always the correct one"
        ref = model(latents[i : i + 1], timestep[i : i + 1], llama_embeds[i : i + 1], llama_attention_mask[i : i + 1])
        model.split_attn = True
        diffs.append((batched[i : i + 1] - ref).abs().max().item())
print(f"max |split_attn batch output - cropped single-sample output| = {max(diffs):.3e}")
