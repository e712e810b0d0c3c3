# kohya-ss/musubi-tuner commit 3ebd1df ("fix: update mask handling to use boolean dtype for accurate text length
# calculations"), src/musubi_tuner/qwen_image_generate_image.py generate() + qwen_image/qwen_image_model.py.
# Qwen-Image's DiT gets encoder_hidden_states_mask=None: the batch-1 prompt is trimmed to its text length, and that
# length (txt_seq_lens) is all the model knows about the text tokens (joint attention over [image, text], text RoPE).
# Bug: the length is taken as `mask.sum(dim=1)` after the mask was cast to bfloat16, so past 256 tokens the count
# rounds (261 -> 260) and the last real prompt token is cut from the joint attention. Fix: count on a bool mask.
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ------------------------------------------------------------------------------- text encoder (qwen_image_utils)
def extract_masked_hidden(hidden_states, mask):
    bool_mask = mask.bool()
    valid_lengths = bool_mask.sum(dim=1)
    selected = hidden_states[bool_mask]
    return torch.split(selected, valid_lengths.tolist(), dim=0)


def get_qwen_prompt_embeds(vlm, txt_token_ids, txt_attention_mask, drop_idx=34):
    with torch.no_grad():
        out = vlm(input_ids=txt_token_ids, attention_mask=txt_attention_mask, output_hidden_states=True)
    hidden_states = out.hidden_states[-1]
    split_hidden_states = extract_masked_hidden(hidden_states, txt_attention_mask)
    split_hidden_states = [e[drop_idx:] for e in split_hidden_states]
    attn_mask_list = [torch.ones(e.size(0), dtype=torch.long, device=e.device) for e in split_hidden_states]
    max_seq_len = max([e.size(0) for e in split_hidden_states])
    prompt_embeds = torch.stack([torch.cat([u, u.new_zeros(max_seq_len - u.size(0), u.size(1))]) for u in split_hidden_states])
    encoder_attention_mask = torch.stack([torch.cat([u, u.new_zeros(max_seq_len - u.size(0))]) for u in attn_mask_list])
    return prompt_embeds, encoder_attention_mask


# ------------------------------------------------------------------------------- DiT (qwen_image_model)
class QwenEmbedRope(nn.Module):
    def __init__(self, theta, axes_dim, scale_rope=False):
        super().__init__()
        self.theta, self.axes_dim, self.scale_rope = theta, axes_dim, scale_rope
        pos_index = torch.arange(4096)
        neg_index = torch.arange(4096).flip(0) * -1 - 1
        self.pos_freqs = torch.cat([self.rope_params(pos_index, d, theta) for d in axes_dim], dim=1)
        self.neg_freqs = torch.cat([self.rope_params(neg_index, d, theta) for d in axes_dim], dim=1)

    def rope_params(self, index, dim, theta=10000):
        freqs = torch.outer(index, 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim)))
        return torch.polar(torch.ones_like(freqs), freqs)

    def forward(self, video_fhw, txt_seq_lens, device):
        if isinstance(video_fhw, list):
            video_fhw = video_fhw[0]
        if not isinstance(video_fhw, list):
            video_fhw = [video_fhw]
        vid_freqs, max_vid_index = [], 0
        for idx, (frame, height, width) in enumerate(video_fhw):
            vid_freqs.append(self._compute_video_freqs(frame, height, width, idx))
            max_vid_index = max(height // 2, width // 2, max_vid_index) if self.scale_rope else max(height, width, max_vid_index)
        max_len = max(txt_seq_lens)
        txt_freqs = self.pos_freqs[max_vid_index : max_vid_index + max_len, ...]
        return torch.cat(vid_freqs, dim=0), txt_freqs

    def _compute_video_freqs(self, frame, height, width, idx=0):
        freqs_pos = self.pos_freqs.split([x // 2 for x in self.axes_dim], dim=1)
        freqs_neg = self.neg_freqs.split([x // 2 for x in self.axes_dim], dim=1)
        freqs_frame = freqs_pos[0][idx : idx + frame].view(frame, 1, 1, -1).expand(frame, height, width, -1)
        freqs_height = torch.cat([freqs_neg[1][-(height - height // 2):], freqs_pos[1][: height // 2]], dim=0)
        freqs_height = freqs_height.view(1, height, 1, -1).expand(frame, height, width, -1)
        freqs_width = torch.cat([freqs_neg[2][-(width - width // 2):], freqs_pos[2][: width // 2]], dim=0)
        freqs_width = freqs_width.view(1, 1, width, -1).expand(frame, height, width, -1)
        return torch.cat([freqs_frame, freqs_height, freqs_width], dim=-1).reshape(frame * height * width, -1)


def apply_rotary_emb_qwen(x, freqs_cis):
    x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    x_out = torch.view_as_real(x_rotated * freqs_cis.unsqueeze(1)).flatten(3)
    return x_out.type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        hd = dim // heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_q, self.norm_k = nn.RMSNorm(hd, eps=1e-6), nn.RMSNorm(hd, eps=1e-6)
        self.norm_added_q, self.norm_added_k = nn.RMSNorm(hd, eps=1e-6), nn.RMSNorm(hd, eps=1e-6)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None, attention_mask=None,
                image_rotary_emb=None, txt_seq_lens=None):
        img_query = self.norm_q(self.to_q(hidden_states).unflatten(-1, (self.heads, -1)))
        img_key = self.norm_k(self.to_k(hidden_states).unflatten(-1, (self.heads, -1)))
        img_value = self.to_v(hidden_states).unflatten(-1, (self.heads, -1))
        txt_query = self.norm_added_q(self.add_q_proj(encoder_hidden_states).unflatten(-1, (self.heads, -1)))
        txt_key = self.norm_added_k(self.add_k_proj(encoder_hidden_states).unflatten(-1, (self.heads, -1)))
        txt_value = self.add_v_proj(encoder_hidden_states).unflatten(-1, (self.heads, -1))
        img_freqs, txt_freqs = image_rotary_emb
        img_query, img_key = apply_rotary_emb_qwen(img_query, img_freqs), apply_rotary_emb_qwen(img_key, img_freqs)
        txt_query, txt_key = apply_rotary_emb_qwen(txt_query, txt_freqs), apply_rotary_emb_qwen(txt_key, txt_freqs)
        # Order: [image, txt]
        joint_query = torch.cat([img_query, txt_query], dim=1).transpose(1, 2)
        joint_key = torch.cat([img_key, txt_key], dim=1).transpose(1, 2)
        joint_value = torch.cat([img_value, txt_value], dim=1).transpose(1, 2)
        seq_img = img_query.shape[1]
        # hunyuan_attention(mode="torch", split_attn=False): SDPA with attn_mask=None
        joint_hidden_states = F.scaled_dot_product_attention(joint_query, joint_key, joint_value, attn_mask=attention_mask)
        joint_hidden_states = joint_hidden_states.transpose(1, 2).flatten(2, 3).to(joint_query.dtype)
        img_attn_output = self.to_out[1](self.to_out[0](joint_hidden_states[:, :seq_img, :]))
        txt_attn_output = self.to_add_out(joint_hidden_states[:, seq_img:, :])
        return img_attn_output, txt_attn_output


class QwenImageTransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.txt_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.img_mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.txt_mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def _modulate(self, x, mod_params):
        shift, scale, gate = mod_params.chunk(3, dim=-1)
        return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), gate.unsqueeze(1)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, image_rotary_emb=None,
                txt_seq_lens=None):
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
        img_modulated, img_gate1 = self._modulate(self.img_norm1(hidden_states), img_mod1)
        txt_modulated, txt_gate1 = self._modulate(self.txt_norm1(encoder_hidden_states), txt_mod1)
        img_attn_output, txt_attn_output = self.attn(
            hidden_states=img_modulated, encoder_hidden_states=txt_modulated,
            encoder_hidden_states_mask=encoder_hidden_states_mask, image_rotary_emb=image_rotary_emb,
            txt_seq_lens=txt_seq_lens)
        hidden_states = hidden_states + img_gate1 * img_attn_output
        encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn_output
        img_modulated2, img_gate2 = self._modulate(self.img_norm2(hidden_states), img_mod2)
        hidden_states = hidden_states + img_gate2 * self.img_mlp(img_modulated2)
        txt_modulated2, txt_gate2 = self._modulate(self.txt_norm2(encoder_hidden_states), txt_mod2)
        encoder_hidden_states = encoder_hidden_states + txt_gate2 * self.txt_mlp(txt_modulated2)
        return encoder_hidden_states, hidden_states


class QwenImageTransformer2DModel(nn.Module):
    def __init__(self, patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)):
        super().__init__()
        inner_dim = num_attention_heads * attention_head_dim
        self.in_channels = in_channels
        self.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(axes_dims_rope), scale_rope=True)
        self.time_proj = nn.Sequential(nn.Linear(256, inner_dim), nn.SiLU(), nn.Linear(inner_dim, inner_dim))
        self.txt_norm = nn.RMSNorm(joint_attention_dim, eps=1e-6)
        self.img_in = nn.Linear(in_channels, inner_dim)
        self.txt_in = nn.Linear(joint_attention_dim, inner_dim)
        self.transformer_blocks = nn.ModuleList([QwenImageTransformerBlock(inner_dim, num_attention_heads)
                                                 for _ in range(num_layers)])
        self.norm_out = nn.LayerNorm(inner_dim, eps=1e-6)
        self.proj_out = nn.Linear(inner_dim, patch_size * patch_size * out_channels)

    def time_text_embed(self, timestep, hidden_states):
        half = 128
        exponent = -np.log(10000) * torch.arange(half, dtype=torch.float32) / half
        emb = timestep[:, None].float() * 1000 * torch.exp(exponent)[None]
        emb = torch.cat([torch.cos(emb), torch.sin(emb)], dim=-1).to(hidden_states.dtype)
        return self.time_proj(emb)

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None, timestep=None,
                img_shapes=None, txt_seq_lens=None, guidance=None, attention_kwargs=None):
        if encoder_hidden_states_mask is not None and encoder_hidden_states_mask.dtype != torch.bool:
            encoder_hidden_states_mask = encoder_hidden_states_mask.bool()
        hidden_states = self.img_in(hidden_states)
        timestep = timestep.to(hidden_states.dtype)
        encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))
        temb = self.time_text_embed(timestep, hidden_states)
        image_rotary_emb = self.pos_embed(img_shapes, txt_seq_lens, device=hidden_states.device)
        txt_seq_lens = torch.tensor(txt_seq_lens, device=hidden_states.device) if txt_seq_lens is not None else None
        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=encoder_hidden_states_mask, temb=temb,
                image_rotary_emb=image_rotary_emb, txt_seq_lens=txt_seq_lens)
        return self.proj_out(self.norm_out(hidden_states))


# ------------------------------------------------------------------------------- generate()
def tokenize(words, n_prefix=34, n_suffix=5, vocab=200):
    # "<|im_start|>system\n...<|im_end|>\n<|im_start|>user\n" (34 tokens dropped), prompt, "<|im_end|>\n<|im_start|>assistant\n"
    ids = [3 + (i * 7) % 50 for i in range(n_prefix)] + [60 + (sum(map(ord, w)) % 120) for w in words] + [190 + i for i in range(n_suffix)]
    ids = torch.tensor([ids])
    return ids, torch.ones_like(ids)


def generate():
    vlm_cfg = Qwen2Config(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    vlm = Qwen2Model(vlm_cfg).eval()
    model = QwenImageTransformer2DModel().eval().to(torch.bfloat16)
    device = torch.device("cpu")

    words = ("a detailed painting of " + " ".join(f"w{i}" for i in range(252))).split()  # 256 prompt words
    ids, am = tokenize(words)
    embed_c, mask_c = get_qwen_prompt_embeds(vlm, ids, am)
    ids, am = tokenize([" "])
    embed_n, mask_n = get_qwen_prompt_embeds(vlm, ids, am)
    context, context_null = {"embed": embed_c, "mask": mask_c}, {"embed": embed_n, "mask": mask_n}

    embed = context["embed"].to(device, dtype=torch.bfloat16)
    mask = context["mask"].to(device, dtype=torch.bfloat16)
    negative_embed = context_null["embed"].to(device, dtype=torch.bfloat16)
    negative_mask = context_null["mask"].to(device, dtype=torch.bfloat16)

    # The batch size is 1, so we can trim embeds as the length of the prompt
    if FIXED:
        txt_seq_lens = mask.to(dtype=torch.bool).sum(dim=1).to(torch.int64).tolist()
    else:
        txt_seq_lens = mask.sum(dim=1).to(torch.int64).tolist()
    embed = embed[:, : txt_seq_lens[0], :]
    mask = None

    if FIXED:
        negative_txt_seq_lens = negative_mask.to(dtype=torch.bool).sum(dim=1).to(torch.int64).tolist()
    else:
        negative_txt_seq_lens = negative_mask.sum(dim=1).to(torch.int64).tolist()
    negative_embed = negative_embed[:, : negative_txt_seq_lens[0], :]
    negative_mask = None
    print("prompt tokens:", context["mask"].shape[1], "txt_seq_lens:", txt_seq_lens)

    height = width = 8  # latent patches grid 4x4 after 2x2 packing
    seed_g = torch.Generator(device="cpu").manual_seed(42)
    latents = torch.randn(1, (height // 2) * (width // 2), model.in_channels, generator=seed_g).to(torch.bfloat16)
    img_shapes = [(1, height // 2, width // 2)]
    num_inference_steps, guidance_scale = 4, 4.0
    sigmas = np.append(np.linspace(1.0, 1 / num_inference_steps, num_inference_steps), 0.0)
    for i in range(num_inference_steps):
        t = torch.tensor(sigmas[i] * 1000)
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        with torch.no_grad():
            noise_pred = model(hidden_states=latents, timestep=timestep / 1000, encoder_hidden_states_mask=mask,
                               encoder_hidden_states=embed, img_shapes=img_shapes, txt_seq_lens=txt_seq_lens)
            neg_noise_pred = model(hidden_states=latents, timestep=timestep / 1000,
                                   encoder_hidden_states_mask=negative_mask, encoder_hidden_states=negative_embed,
                                   img_shapes=img_shapes, txt_seq_lens=negative_txt_seq_lens)
        comb_pred = neg_noise_pred + guidance_scale * (noise_pred - neg_noise_pred)
        cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
        noise_pred = comb_pred * (cond_norm / noise_norm)
        latents = (latents.float() + (sigmas[i + 1] - sigmas[i]) * noise_pred.float()).to(torch.bfloat16)
    return latents


if __name__ == "__main__":
    latents = generate()
    print("latents mean/std: %.5f %.5f" % (latents.float().mean().item(), latents.float().std().item()))
    print("latents[0, 0, :6]:", [round(v, 4) for v in latents[0, 0, :6].float().tolist()])
