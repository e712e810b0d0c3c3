# ParaAttention (chengzeyi/ParaAttention commit 8effb91, PR #26): the first-block-cache HunyuanVideo adapter ran the blocks with
# attention_mask=None, so latents attended to padded LLaMA prompt tokens; the fix builds the [B, 1, N + M] mask and runs the
# blocks under SparseKVAttnMode, whose sparse-KV op now keeps each batch element's valid keys (it used element 0's mask).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- para_attn/ops/__init__.py -------------------------------------------------------------------------------
def _attention_forward_sparse_kv(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    if attn_mask is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale)

    assert attn_mask.dtype == torch.bool, "attn_mask must be a boolean tensor"
    assert not is_causal, "is_causal is not supported with sparse kv"

    s_kv = key.shape[-2]
    if not FIXED:
        while attn_mask.ndim > 1:
            attn_mask = attn_mask[0]
        indices = torch.arange(s_kv, device=key.device)
        indices = indices[attn_mask]
        key = key[..., indices, :]
        value = value[..., indices, :]
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    indices = torch.arange(s_kv, device=key.device)
    outputs = []
    for q, k, v, m in zip(query, key, value, attn_mask):
        q = q.unsqueeze(0)
        k = k.unsqueeze(0)
        v = v.unsqueeze(0)
        while m.ndim > 1:
            m = m[0]
        indices_ = indices[m]
        k = k[..., indices_, :]
        v = v[..., indices_, :]
        outputs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale))
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat(outputs, dim=0)


# ---- para_attn/sparse_attn.py ----------------------------------------------------------------------------------
class BaseTorchFunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        return func(*args, **kwargs)


class SparseKVAttnMode(BaseTorchFunctionMode):
    disabled = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if SparseKVAttnMode.disabled:
            return super().__torch_function__(func, types, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return _attention_forward_sparse_kv(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


# ---- diffusers HunyuanVideo (trimmed) --------------------------------------------------------------------------
class HunyuanVideoAttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query = attn.norm_added_q(attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2))
            encoder_key = attn.norm_added_k(attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2))
            encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            query = torch.cat([query, encoder_query], dim=2)
            key = torch.cat([key, encoder_key], dim=2)
            value = torch.cat([value, encoder_value], dim=2)
        hidden_states = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                       is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (hidden_states[:, : -encoder_hidden_states.shape[1]],
                                                    hidden_states[:, -encoder_hidden_states.shape[1]:])
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[0](hidden_states)
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


class Attention(nn.Module):
    def __init__(self, dim, heads, head_dim, added_kv):
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, inner), nn.Linear(dim, inner), nn.Linear(dim, inner)
        self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
        self.add_q_proj = self.add_k_proj = self.add_v_proj = None
        if added_kv:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner), nn.Linear(dim, inner),
                                                                 nn.Linear(dim, inner))
            self.norm_added_q, self.norm_added_k = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
            self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
            self.to_add_out = nn.Linear(inner, dim)
        self.processor = HunyuanVideoAttnProcessor2_0()

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class HunyuanVideoTransformerBlock(nn.Module):
    def __init__(self, dim, heads, head_dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads, head_dim, added_kv=True)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))
        self.ff_context = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None):
        a, ca = self.attn(self.norm(hidden_states) + temb[:, None], self.norm(encoder_hidden_states) + temb[:, None],
                          attention_mask=attention_mask)
        hidden_states = hidden_states + a
        encoder_hidden_states = encoder_hidden_states + ca
        hidden_states = hidden_states + self.ff(self.norm(hidden_states))
        encoder_hidden_states = encoder_hidden_states + self.ff_context(self.norm(encoder_hidden_states))
        return hidden_states, encoder_hidden_states


class HunyuanVideoSingleTransformerBlock(nn.Module):
    def __init__(self, dim, heads, head_dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads, head_dim, added_kv=False)
        self.proj_out = nn.Linear(heads * head_dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, image_rotary_emb=None):
        text_seq_length = encoder_hidden_states.shape[1]
        residual = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        norm = self.norm(residual) + temb[:, None]
        a, ca = self.attn(norm[:, :-text_seq_length], norm[:, -text_seq_length:], attention_mask=attention_mask)
        out = residual + self.proj_out(torch.cat([a, ca], dim=1))
        return out[:, :-text_seq_length], out[:, -text_seq_length:]


class HunyuanVideoTransformer3DModel(nn.Module):
    def __init__(self, in_ch=4, text_dim=20, dim=32, heads=2, head_dim=16):
        super().__init__()
        self.x_embedder = nn.Linear(in_ch, dim)
        self.context_embedder = nn.Linear(text_dim, dim)
        self.time_text_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.transformer_blocks = nn.ModuleList([HunyuanVideoTransformerBlock(dim, heads, head_dim) for _ in range(2)])
        self.single_transformer_blocks = nn.ModuleList(
            [HunyuanVideoSingleTransformerBlock(dim, heads, head_dim) for _ in range(2)])
        self.proj_out = nn.Linear(dim, in_ch)

    def call_transformer_blocks(self, hidden_states, encoder_hidden_states, *args, **kwargs):
        for block in self.transformer_blocks:
            hidden_states, encoder_hidden_states = block(hidden_states, encoder_hidden_states, *args, **kwargs)
        for block in self.single_transformer_blocks:
            hidden_states, encoder_hidden_states = block(hidden_states, encoder_hidden_states, *args, **kwargs)
        return hidden_states, encoder_hidden_states

    # para_attn/first_block_cache/diffusers_adapters/hunyuan_video.py: new_forward (cache bookkeeping trimmed)
    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask):
        batch_size = hidden_states.shape[0]
        image_rotary_emb = None
        temb = self.time_text_embed(timestep[:, None].float())
        hidden_states = self.x_embedder(hidden_states)
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)

        if not FIXED:
            # 4. Transformer blocks
            hidden_states, encoder_hidden_states = self.call_transformer_blocks(
                hidden_states, encoder_hidden_states, temb, None, image_rotary_emb
            )
        else:
            # 3. Attention mask preparation
            latent_sequence_length = hidden_states.shape[1]
            latent_attention_mask = torch.ones(
                batch_size, 1, latent_sequence_length, device=hidden_states.device, dtype=torch.bool
            )  # [B, 1, N]
            attention_mask = torch.cat(
                [latent_attention_mask, encoder_attention_mask.unsqueeze(1).to(torch.bool)], dim=-1
            )  # [B, 1, N + M]

            with SparseKVAttnMode():
                # 4. Transformer blocks
                hidden_states, encoder_hidden_states = self.call_transformer_blocks(
                    hidden_states, encoder_hidden_states, temb, attention_mask, image_rotary_emb
                )
        return self.proj_out(hidden_states)


model = HunyuanVideoTransformer3DModel().eval()
B, N, M = 2, 12, 10
latents = torch.randn(B, N, 4)
prompt_embeds = torch.randn(B, M, 20)
lengths = [4, 8]
prompt_attention_mask = torch.zeros(B, M, dtype=torch.long)
for i, n in enumerate(lengths):
    prompt_attention_mask[i, :n] = 1
timestep = torch.tensor([700, 700])

with torch.no_grad():
    batched = model(latents, timestep, prompt_embeds, prompt_attention_mask)
    diffs = []
    for i, n in enumerate(lengths):
        ref = model(latents[i : i + 1], timestep[i : i + 1], prompt_embeds[i : i + 1, :n],
                    torch.ones(1, n, dtype=torch.long))
        diffs.append((batched[i : i + 1] - ref).abs().max().item())
print(f"max |padded-batch latent output - unpadded per-prompt output| = {max(diffs):.3e}")
