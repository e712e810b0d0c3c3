# kandinskylab/kandinsky-5#38 (commit f8b9745): "Text embedding mask fix"
# With text_token_padding=True the Qwen2.5-VL prompt is padded to max_length and Kandinsky5TextEmbedder.encode returned
# the padding mask as attention_mask.to(torch.bfloat16). The DiT hands it straight to F.scaled_dot_product_attention as
# attn_mask (text self-attention and visual->text cross-attention), where a float mask is ADDED to the scores: real
# tokens got +1, padding +0, so every padded text token stayed attendable. The fix returns attention_mask.to(torch.bool).
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- kandinsky/models/attention.py ------------------------------------------------------------------------------------
def sdpa(q, k, v, attn_mask=None):
    query = q.transpose(1, 2).contiguous()
    key = k.transpose(1, 2).contiguous()
    value = v.transpose(1, 2).contiguous()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask).transpose(1, 2).contiguous()
    return out


class SelfAttentionEngine:
    def __init__(self, engine="auto"):
        self.attention_fn = sdpa  # "sdpa" (no flash-attn / sage on this machine)

    def get_attention(self):
        return self.attention_fn


# ---- kandinsky/models/nn.py (torch.compile and cuda-autocast decorators dropped for CPU) ----------------------------
def get_freqs(dim, max_period=10000.0):
    return torch.exp(-math.log(max_period) * torch.arange(start=0, end=dim, dtype=torch.float32) / dim)


def apply_scale_shift_norm(norm, x, scale, shift):
    return (norm(x) * (scale + 1.0) + shift).to(torch.bfloat16)


def apply_gate_sum(x, out, gate):
    return (x + gate * out).to(torch.bfloat16)


def apply_rotary(x, rope):
    x_ = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
    x_out = (rope * x_).sum(dim=-1)
    return x_out.reshape(*x.shape).to(torch.bfloat16)


class TimeEmbeddings(nn.Module):
    def __init__(self, model_dim, time_dim, max_period=10000.0):
        super().__init__()
        self.register_buffer("freqs", get_freqs(model_dim // 2, max_period), persistent=False)
        self.in_layer = nn.Linear(model_dim, time_dim, bias=True)
        self.activation = nn.SiLU()
        self.out_layer = nn.Linear(time_dim, time_dim, bias=True)

    def forward(self, time):
        args = torch.outer(time, self.freqs.to(device=time.device))
        time_embed = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.out_layer(self.activation(self.in_layer(time_embed)))


class TextEmbeddings(nn.Module):
    def __init__(self, text_dim, model_dim):
        super().__init__()
        self.in_layer = nn.Linear(text_dim, model_dim, bias=True)
        self.norm = nn.LayerNorm(model_dim, elementwise_affine=True)

    def forward(self, text_embed):
        text_embed = self.in_layer(text_embed)
        return self.norm(text_embed).type_as(text_embed)


class VisualEmbeddings(nn.Module):
    def __init__(self, visual_dim, model_dim, patch_size):
        super().__init__()
        self.patch_size = patch_size
        self.in_layer = nn.Linear(math.prod(patch_size) * visual_dim, model_dim)

    def forward(self, x):
        duration, height, width, dim = x.shape
        x = (
            x.view(duration // self.patch_size[0], self.patch_size[0], height // self.patch_size[1],
                   self.patch_size[1], width // self.patch_size[2], self.patch_size[2], dim)
            .permute(0, 2, 4, 1, 3, 5, 6)
            .flatten(3, 6)
        )
        return self.in_layer(x)


class RoPE1D(nn.Module):
    def __init__(self, dim, max_pos=1024, max_period=10000.0):
        super().__init__()
        freq = get_freqs(dim // 2, max_period)
        pos = torch.arange(max_pos, dtype=freq.dtype)
        self.register_buffer("args", torch.outer(pos, freq), persistent=False)

    def forward(self, pos):
        args = self.args[pos]
        cosine, sine = torch.cos(args), torch.sin(args)
        rope = torch.stack([cosine, -sine, sine, cosine], dim=-1)
        rope = rope.view(*rope.shape[:-1], 2, 2)
        return rope.unsqueeze(-4)


class RoPE3D(nn.Module):
    def __init__(self, axes_dims, max_pos=(128, 128, 128), max_period=10000.0):
        super().__init__()
        self.axes_dims = axes_dims
        for i, (axes_dim, ax_max_pos) in enumerate(zip(axes_dims, max_pos)):
            freq = get_freqs(axes_dim // 2, max_period)
            pos = torch.arange(ax_max_pos, dtype=freq.dtype)
            self.register_buffer(f"args_{i}", torch.outer(pos, freq), persistent=False)

    def forward(self, shape, pos, scale_factor=(1.0, 1.0, 1.0)):
        duration, height, width = shape
        args_t = self.args_0[pos[0]] / scale_factor[0]
        args_h = self.args_1[pos[1]] / scale_factor[1]
        args_w = self.args_2[pos[2]] / scale_factor[2]
        args = torch.cat(
            [
                args_t.view(duration, 1, 1, -1).repeat(1, height, width, 1),
                args_h.view(1, height, 1, -1).repeat(duration, 1, width, 1),
                args_w.view(1, 1, width, -1).repeat(duration, height, 1, 1),
            ],
            dim=-1,
        )
        cosine, sine = torch.cos(args), torch.sin(args)
        rope = torch.stack([cosine, -sine, sine, cosine], dim=-1)
        rope = rope.view(*rope.shape[:-1], 2, 2)
        return rope.unsqueeze(-4)


class Modulation(nn.Module):
    def __init__(self, time_dim, model_dim, num_params):
        super().__init__()
        self.activation = nn.SiLU()
        self.out_layer = nn.Linear(time_dim, num_params * model_dim)
        # (the real checkpoint's modulation weights are trained; a zero init would make every attention a no-op here)

    def forward(self, x):
        return self.out_layer(self.activation(x))


class MultiheadSelfAttentionEnc(nn.Module):
    def __init__(self, num_channels, head_dim):
        super().__init__()
        self.num_heads = num_channels // head_dim
        self.to_query = nn.Linear(num_channels, num_channels, bias=True)
        self.to_key = nn.Linear(num_channels, num_channels, bias=True)
        self.to_value = nn.Linear(num_channels, num_channels, bias=True)
        self.query_norm = nn.RMSNorm(head_dim)
        self.key_norm = nn.RMSNorm(head_dim)
        self.out_layer = nn.Linear(num_channels, num_channels, bias=True)
        self.attn_engine = SelfAttentionEngine("sdpa")

    def get_qkv(self, x):
        query, key, value = self.to_query(x), self.to_key(x), self.to_value(x)
        shape = query.shape[:-1]
        return (query.reshape(*shape, self.num_heads, -1), key.reshape(*shape, self.num_heads, -1),
                value.reshape(*shape, self.num_heads, -1))

    def norm_qk(self, q, k):
        return self.query_norm(q.float()).type_as(q), self.key_norm(k.float()).type_as(k)

    def scaled_dot_product_attention(self, query, key, value, attention_mask=None):
        return self.attn_engine.get_attention()(q=query, k=key, v=value, attn_mask=attention_mask)[0].flatten(-2, -1)

    def forward(self, x, rope, attention_mask=None):
        query, key, value = self.get_qkv(x)
        query, key = self.norm_qk(query, key)
        query = apply_rotary(query, rope).type_as(query)
        key = apply_rotary(key, rope).type_as(key)
        out = self.scaled_dot_product_attention(query, key, value, attention_mask)
        return self.out_layer(out)


class MultiheadSelfAttentionDec(MultiheadSelfAttentionEnc):
    def attention(self, query, key, value):
        return self.attn_engine.get_attention()(q=query.unsqueeze(0), k=key.unsqueeze(0),
                                                v=value.unsqueeze(0))[0].flatten(-2, -1)

    def forward(self, x, rope, sparse_params=None):
        query, key, value = self.get_qkv(x)
        query, key = self.norm_qk(query, key)
        query = apply_rotary(query, rope).type_as(query)
        key = apply_rotary(key, rope).type_as(key)
        return self.out_layer(self.attention(query, key, value))


class MultiheadCrossAttention(nn.Module):
    def __init__(self, num_channels, head_dim):
        super().__init__()
        self.num_heads = num_channels // head_dim
        self.to_query = nn.Linear(num_channels, num_channels, bias=True)
        self.to_key = nn.Linear(num_channels, num_channels, bias=True)
        self.to_value = nn.Linear(num_channels, num_channels, bias=True)
        self.query_norm = nn.RMSNorm(head_dim)
        self.key_norm = nn.RMSNorm(head_dim)
        self.out_layer = nn.Linear(num_channels, num_channels, bias=True)
        self.attn_engine = SelfAttentionEngine("sdpa")

    def get_qkv(self, x, cond):
        query, key, value = self.to_query(x), self.to_key(cond), self.to_value(cond)
        shape, cond_shape = query.shape[:-1], key.shape[:-1]
        return (query.reshape(*shape, self.num_heads, -1), key.reshape(*cond_shape, self.num_heads, -1),
                value.reshape(*cond_shape, self.num_heads, -1))

    def norm_qk(self, q, k):
        return self.query_norm(q.float()).type_as(q), self.key_norm(k.float()).type_as(k)

    def attention(self, query, key, value, attention_mask=None):
        return self.attn_engine.get_attention()(q=query.unsqueeze(0), k=key, v=value,
                                                attn_mask=attention_mask)[0].flatten(-2, -1)

    def forward(self, x, cond, attention_mask=None):
        query, key, value = self.get_qkv(x, cond)
        query, key = self.norm_qk(query, key)
        out = self.attention(query, key, value, attention_mask)
        return self.out_layer(out)


class FeedForward(nn.Module):
    def __init__(self, dim, ff_dim):
        super().__init__()
        self.in_layer = nn.Linear(dim, ff_dim, bias=False)
        self.activation = nn.GELU()
        self.out_layer = nn.Linear(ff_dim, dim, bias=False)

    def forward(self, x):
        return self.out_layer(self.activation(self.in_layer(x)))


class OutLayer(nn.Module):
    def __init__(self, model_dim, time_dim, visual_dim, patch_size):
        super().__init__()
        self.patch_size = patch_size
        self.modulation = Modulation(time_dim, model_dim, 2)
        self.norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.out_layer = nn.Linear(model_dim, math.prod(patch_size) * visual_dim, bias=True)

    def forward(self, visual_embed, text_embed, time_embed):
        shift, scale = torch.chunk(self.modulation(time_embed), 2, dim=-1)
        visual_embed = apply_scale_shift_norm(self.norm, visual_embed, scale[:, None, None],
                                              shift[:, None, None]).type_as(visual_embed)
        x = self.out_layer(visual_embed)
        duration, height, width, _ = x.shape
        x = (
            x.view(duration, height, width, -1, self.patch_size[0], self.patch_size[1], self.patch_size[2])
            .permute(0, 4, 1, 5, 2, 6, 3).flatten(0, 1).flatten(1, 2).flatten(2, 3)
        )
        return x


# ---- kandinsky/models/dit.py --------------------------------------------------------------------------------------
class TransformerEncoderBlock(nn.Module):
    def __init__(self, model_dim, time_dim, ff_dim, head_dim):
        super().__init__()
        self.text_modulation = Modulation(time_dim, model_dim, 6)
        self.self_attention_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.self_attention = MultiheadSelfAttentionEnc(model_dim, head_dim)
        self.feed_forward_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.feed_forward = FeedForward(model_dim, ff_dim)

    def forward(self, x, time_embed, rope, attention_mask=None):
        self_attn_params, ff_params = torch.chunk(self.text_modulation(time_embed), 2, dim=-1)
        shift, scale, gate = torch.chunk(self_attn_params, 3, dim=-1)
        out = apply_scale_shift_norm(self.self_attention_norm, x, scale, shift)
        out = self.self_attention(out, rope, attention_mask)
        x = apply_gate_sum(x, out, gate)
        shift, scale, gate = torch.chunk(ff_params, 3, dim=-1)
        out = apply_scale_shift_norm(self.feed_forward_norm, x, scale, shift)
        out = self.feed_forward(out)
        return apply_gate_sum(x, out, gate)


class TransformerDecoderBlock(nn.Module):
    def __init__(self, model_dim, time_dim, ff_dim, head_dim, attention_engine="auto"):
        super().__init__()
        self.visual_modulation = Modulation(time_dim, model_dim, 9)
        self.self_attention_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.self_attention = MultiheadSelfAttentionDec(model_dim, head_dim)
        self.cross_attention_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.cross_attention = MultiheadCrossAttention(model_dim, head_dim)
        self.feed_forward_norm = nn.LayerNorm(model_dim, elementwise_affine=False)
        self.feed_forward = FeedForward(model_dim, ff_dim)

    def forward(self, visual_embed, text_embed, time_embed, rope, sparse_params, attention_mask=None):
        self_attn_params, cross_attn_params, ff_params = torch.chunk(self.visual_modulation(time_embed), 3, dim=-1)
        shift, scale, gate = torch.chunk(self_attn_params, 3, dim=-1)
        visual_out = apply_scale_shift_norm(self.self_attention_norm, visual_embed, scale, shift)
        visual_out = self.self_attention(visual_out, rope, sparse_params)
        visual_embed = apply_gate_sum(visual_embed, visual_out, gate)

        shift, scale, gate = torch.chunk(cross_attn_params, 3, dim=-1)
        visual_out = apply_scale_shift_norm(self.cross_attention_norm, visual_embed, scale, shift)
        visual_out = self.cross_attention(visual_out, text_embed, attention_mask)
        visual_embed = apply_gate_sum(visual_embed, visual_out, gate)

        shift, scale, gate = torch.chunk(ff_params, 3, dim=-1)
        visual_out = apply_scale_shift_norm(self.feed_forward_norm, visual_embed, scale, shift)
        visual_out = self.feed_forward(visual_out)
        return apply_gate_sum(visual_embed, visual_out, gate)


class DiffusionTransformer3D(nn.Module):
    def __init__(self, in_visual_dim=4, in_text_dim=32, in_text_dim2=16, time_dim=32, out_visual_dim=4,
                 patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=2,
                 axes_dims=(4, 6, 6), visual_cond=False):
        super().__init__()
        head_dim = sum(axes_dims)
        self.visual_cond = visual_cond
        self.time_embeddings = TimeEmbeddings(model_dim, time_dim)
        self.text_embeddings = TextEmbeddings(in_text_dim, model_dim)
        self.pooled_text_embeddings = TextEmbeddings(in_text_dim2, time_dim)
        self.visual_embeddings = VisualEmbeddings(in_visual_dim, model_dim, patch_size)
        self.text_rope_embeddings = RoPE1D(head_dim)
        self.text_transformer_blocks = nn.ModuleList(
            [TransformerEncoderBlock(model_dim, time_dim, ff_dim, head_dim) for _ in range(num_text_blocks)]
        )
        self.visual_rope_embeddings = RoPE3D(axes_dims)
        self.visual_transformer_blocks = nn.ModuleList(
            [TransformerDecoderBlock(model_dim, time_dim, ff_dim, head_dim) for _ in range(num_visual_blocks)]
        )
        self.out_layer = OutLayer(model_dim, time_dim, out_visual_dim, patch_size)

    def forward(self, x, text_embed, pooled_text_embed, time, visual_rope_pos, text_rope_pos,
                scale_factor=(1.0, 1.0, 1.0), sparse_params=None, attention_mask=None):
        text_embed = self.text_embeddings(text_embed)
        time_embed = self.time_embeddings(time)
        time_embed = time_embed + self.pooled_text_embeddings(pooled_text_embed)
        visual_embed = self.visual_embeddings(x)
        text_rope = self.text_rope_embeddings(text_rope_pos)

        for text_transformer_block in self.text_transformer_blocks:
            text_embed = text_transformer_block(text_embed, time_embed, text_rope, attention_mask)

        visual_shape = visual_embed.shape[:-1]
        visual_rope = self.visual_rope_embeddings(visual_shape, visual_rope_pos, scale_factor)
        visual_embed, visual_rope = visual_embed.flatten(0, 2), visual_rope.flatten(0, 2)  # fractal_flatten, no nabla

        for visual_transformer_block in self.visual_transformer_blocks:
            visual_embed = visual_transformer_block(visual_embed, text_embed, time_embed, visual_rope, sparse_params,
                                                    attention_mask)

        visual_embed = visual_embed.reshape(*visual_shape, *visual_embed.shape[1:])  # fractal_unflatten
        return self.out_layer(visual_embed, text_embed, time_embed)


# ---- kandinsky/models/text_embedders.py ---------------------------------------------------------------------------
class TinyQwenProcessor:
    """Stand-in for the Qwen2.5-VL AutoProcessor (word-level ids, right padding to max_length)."""

    def __init__(self, vocab_size=64, pad_token_id=0):
        self.vocab, self.vocab_size, self.pad_token_id = {}, vocab_size, pad_token_id

    def __call__(self, text, images=None, videos=None, max_length=16, truncation=True, return_tensors="pt",
                 padding="max_length"):
        ids, masks = [], []
        for t in text:
            toks = [2 + self.vocab.setdefault(w, len(self.vocab)) % (self.vocab_size - 2) for w in t.split()][:max_length]
            ids.append(toks + [self.pad_token_id] * (max_length - len(toks)))
            masks.append([1] * len(toks) + [0] * (max_length - len(toks)))
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(masks)}


class Qwen2_5_VLTextEmbedder:
    PROMPT_TEMPLATE = {
        "template": {"image": ("<|im_start|>system describe the image<|im_end|>", "<|im_start|>user\n{}<|im_end|>")},
        "crop_start": {"image": 5},
    }

    def __init__(self, model, processor, max_length, text_token_padding=True):
        self.model = model
        self.processor = processor
        self.max_length = max_length
        self.text_token_padding = text_token_padding

    def __call__(self, texts, images=None, type_of_content="video"):
        prompt_template = "\n".join(self.PROMPT_TEMPLATE["template"][type_of_content])
        crop_start = self.PROMPT_TEMPLATE["crop_start"][type_of_content]
        full_texts = list(map(lambda x: prompt_template.format(x), texts))
        max_length = self.max_length + crop_start
        inputs = self.processor(text=full_texts, images=None, videos=None, max_length=max_length, truncation=True,
                                return_tensors="pt", padding="max_length")
        with torch.no_grad():
            embeds = self.model(input_ids=inputs["input_ids"], return_dict=True,
                                output_hidden_states=True)["hidden_states"][-1][:, crop_start:]
        attention_mask = inputs["attention_mask"][:, crop_start:]
        if self.text_token_padding:
            seq_length = embeds.shape[1]
            cu_seqlens = torch.tensor([0, seq_length], dtype=torch.int32)
        else:
            embeds = embeds[attention_mask.bool()]
            cu_seqlens = torch.cumsum(attention_mask.sum(1), dim=0)
            cu_seqlens = torch.cat([torch.zeros_like(cu_seqlens)[:1], cu_seqlens]).to(dtype=torch.int32)
            attention_mask = None
        return embeds, cu_seqlens, attention_mask


class Kandinsky5TextEmbedder:
    def __init__(self, embedder, clip_embedder):
        self.embedder = embedder
        self.clip_embedder = clip_embedder

    def encode(self, texts, images=None, type_of_content="image"):
        text_embeds, cu_seqlens, attention_mask = self.embedder(texts, images=images, type_of_content=type_of_content)
        pooled_embed = self.clip_embedder(texts)
        if FIXED:
            return {"text_embeds": text_embeds, "pooled_embed": pooled_embed}, cu_seqlens, attention_mask.to(torch.bool)
        return {"text_embeds": text_embeds, "pooled_embed": pooled_embed}, cu_seqlens, attention_mask.to(torch.bfloat16)


# ---- kandinsky/generation_utils.py ---------------------------------------------------------------------------------
def get_velocity(dit, x, t, text_embeds, null_text_embeds, visual_rope_pos, text_rope_pos, null_text_rope_pos,
                 guidance_weight, sparse_params=None, attention_mask=None, null_attention_mask=None):
    pred_velocity = dit(x, text_embeds["text_embeds"], text_embeds["pooled_embed"], t * 1000, visual_rope_pos,
                        text_rope_pos, sparse_params=sparse_params, attention_mask=attention_mask)
    if abs(guidance_weight - 1.0) > 1e-6:
        uncond_pred_velocity = dit(x, null_text_embeds["text_embeds"], null_text_embeds["pooled_embed"], t * 1000,
                                   visual_rope_pos, null_text_rope_pos, sparse_params=sparse_params,
                                   attention_mask=null_attention_mask)
        pred_velocity = uncond_pred_velocity + guidance_weight * (pred_velocity - uncond_pred_velocity)
    return pred_velocity


@torch.no_grad()
def generate(model, shape, num_steps, text_embeds, null_text_embeds, visual_rope_pos, text_rope_pos,
             null_text_rope_pos, guidance_weight, scheduler_scale, seed=6554, attention_mask=None,
             null_attention_mask=None):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(*shape, generator=g)
    timesteps = torch.linspace(1, 0, num_steps + 1)
    timesteps = scheduler_scale * timesteps / (1 + (scheduler_scale - 1) * timesteps)
    for timestep, timestep_diff in zip(timesteps[:-1], torch.diff(timesteps)):
        time = timestep.unsqueeze(0)
        pred_velocity = get_velocity(model, img, time, text_embeds, null_text_embeds, visual_rope_pos, text_rope_pos,
                                     null_text_rope_pos, guidance_weight, attention_mask=attention_mask,
                                     null_attention_mask=null_attention_mask)
        img = img + timestep_diff * pred_velocity
    return img


def generate_sample(shape, caption, dit, text_embedder, patch_size=(1, 2, 2), num_steps=3, guidance_weight=5.0,
                    scheduler_scale=1, negative_caption="", seed=6554):
    bs, duration, height, width, dim = shape
    type_of_content = "image" if duration == 1 else "video"
    with torch.no_grad():
        bs_text_embed, text_cu_seqlens, attention_mask = text_embedder.encode([caption], type_of_content=type_of_content)
        bs_null_text_embed, null_text_cu_seqlens, null_attention_mask = text_embedder.encode(
            [negative_caption], type_of_content=type_of_content
        )
    text_cu_seqlens = text_cu_seqlens[-1].item()
    null_text_cu_seqlens = null_text_cu_seqlens[-1].item()
    visual_rope_pos = [torch.arange(duration), torch.arange(shape[-3] // patch_size[1]),
                       torch.arange(shape[-2] // patch_size[2])]
    text_rope_pos = torch.arange(text_cu_seqlens)
    null_text_rope_pos = torch.arange(null_text_cu_seqlens)
    print(f"attention_mask handed to the DiT: dtype={attention_mask.dtype} values={attention_mask[0].tolist()}")
    with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        latent_visual = generate(dit, (bs * duration, height, width, dim), num_steps, bs_text_embed,
                                 bs_null_text_embed, visual_rope_pos, text_rope_pos, null_text_rope_pos,
                                 guidance_weight, scheduler_scale, seed=seed, attention_mask=attention_mask,
                                 null_attention_mask=null_attention_mask)
    return latent_visual


if __name__ == "__main__":
    qwen_config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=1, pad_token_id=0,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32),
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )
    qwen = Qwen2_5_VLForConditionalGeneration(qwen_config).to(torch.bfloat16).eval()
    clip_proj = nn.Linear(1, 16)
    clip_embedder = lambda texts: clip_proj(torch.tensor([[float(len(t))] for t in texts])).detach()  # pooled CLIP stand-in
    text_embedder = Kandinsky5TextEmbedder(
        Qwen2_5_VLTextEmbedder(qwen, TinyQwenProcessor(), max_length=12, text_token_padding=True), clip_embedder
    )
    dit = DiffusionTransformer3D().eval()

    # text-to-image: bs=1, duration=1, 8x8 latent, 4 channels; CFG with the empty negative caption
    latent = generate_sample((1, 1, 8, 8, 4), "a red fox jumps over the fence", dit, text_embedder)
    print(f"fixed={FIXED} latent mean={latent.float().mean().item():.6f}")
