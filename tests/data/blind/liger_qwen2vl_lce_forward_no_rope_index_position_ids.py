# Citation: linkedin/Liger-Kernel#276, commit bc5d20f77197853dd61c43f6b69964714c97f978
#   ("fix qwen2-vl: create correct rope position_ids when position_ids is None"),
#   which copies huggingface/transformers#33487.
# Upstream: src/liger_kernel/transformers/model/qwen2_vl.py, lce_forward (the patched
#   Qwen2VLForConditionalGeneration.forward), calling transformers 4.45
#   Qwen2VLForConditionalGeneration.get_rope_index and Qwen2VLModel.forward.
# Bug: during training the trainer calls forward without position_ids; Liger's lce_forward handed
#   position_ids=None straight to Qwen2VLModel, which then uses cache_position (0..L-1) on all three
#   M-RoPE axes.  The image tokens get 1-D text positions instead of their (t, h, w) grid positions,
#   the text after the image is placed image_len - max(h, w) slots too far, and the padding of a
#   shorter row is ignored when the positions are laid.
# Fix: when position_ids is None, build them with self.get_rope_index(input_ids, image_grid_thw,
#   video_grid_thw, attention_mask) before calling self.model.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class VisionConfig:
    spatial_merge_size = 2
    in_chans = 12  # stands for temporal_patch_size * patch_size**2 * channels, shrunk
    embed_dim = 16


class Qwen2VLConfig:
    vocab_size = 64
    hidden_size = 32
    intermediate_size = 64
    num_hidden_layers = 2
    num_attention_heads = 2
    num_key_value_heads = 2
    rms_norm_eps = 1e-6
    rope_theta = 10000.0
    rope_scaling = {"type": "mrope", "mrope_section": [2, 3, 3]}
    pad_token_id = 0
    vision_start_token_id = 60
    image_token_id = 61
    vision_end_token_id = 62
    video_token_id = 63
    vision_config = VisionConfig()
    output_attentions = False
    output_hidden_states = False
    use_return_dict = False


# ----------------------------------------------------------------------------------------------
# Vision tower stand-in (patch embed + PatchMerger, as Qwen2VisionTransformerPretrainedModel ends)
# ----------------------------------------------------------------------------------------------
class PatchMerger(nn.Module):
    def __init__(self, dim, context_dim, spatial_merge_size=2):
        super().__init__()
        self.hidden_size = context_dim * (spatial_merge_size**2)
        self.ln_q = nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(), nn.Linear(self.hidden_size, dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class Qwen2VisionTransformerPretrainedModel(nn.Module):
    def __init__(self, vision_config, hidden_size):
        super().__init__()
        self.patch_embed = nn.Linear(vision_config.in_chans, vision_config.embed_dim, bias=False)
        self.merger = PatchMerger(hidden_size, vision_config.embed_dim, vision_config.spatial_merge_size)

    def get_dtype(self):
        return self.patch_embed.weight.dtype

    def forward(self, hidden_states, grid_thw):
        hidden_states = self.patch_embed(hidden_states)
        return self.merger(hidden_states)


# ----------------------------------------------------------------------------------------------
# Text decoder (transformers 4.45 Qwen2VLModel, sdpa path)
# ----------------------------------------------------------------------------------------------
class Qwen2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class Qwen2VLRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        # position_ids: (3, bs, positions)
        inv_freq_expanded = self.inv_freq[None, None, :, None].float().expand(3, position_ids.shape[1], -1, 1)
        position_ids_expanded = position_ids[:, :, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(2, 3)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class Qwen2VLSdpaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.rope_scaling = config.rope_scaling
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_multimodal_rotary_pos_emb(q, k, cos, sin, self.rope_scaling["mrope_section"])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False)
        out = out.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class Qwen2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2VLDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Qwen2VLSdpaAttention(config)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


def _prepare_4d_causal_attention_mask_with_cache_position(attention_mask, sequence_length, target_length, dtype, cache_position, batch_size):
    min_dtype = torch.finfo(dtype).min
    causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
    if sequence_length != 1:
        causal_mask = torch.triu(causal_mask, diagonal=1)
    causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
    causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
    if attention_mask is not None:
        causal_mask = causal_mask.clone()
        mask_length = attention_mask.shape[-1]
        padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :]
        padding_mask = padding_mask == 0
        causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
    return causal_mask


class Qwen2VLModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([Qwen2VLDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Qwen2VLRotaryEmbedding(config.hidden_size // config.num_attention_heads, config.rope_theta)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position):
        dtype = input_tensor.dtype
        sequence_length = input_tensor.shape[1]
        target_length = attention_mask.shape[-1] if attention_mask is not None else sequence_length
        return _prepare_4d_causal_attention_mask_with_cache_position(
            attention_mask, sequence_length, target_length, dtype, cache_position, input_tensor.shape[0]
        )

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, cache_position=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if cache_position is None:
            cache_position = torch.arange(0, inputs_embeds.shape[1], device=inputs_embeds.device)
        # the hard coded `3` is for temporal, height and width.
        if position_ids is None:
            position_ids = cache_position.view(1, 1, -1).expand(3, inputs_embeds.shape[0], -1)
        elif position_ids.dim() == 2:
            position_ids = position_ids[None, ...].expand(3, position_ids.shape[0], -1)

        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_embeddings)
        hidden_states = self.norm(hidden_states)
        return (hidden_states,)


class Qwen2VLForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.visual = Qwen2VisionTransformerPretrainedModel(config.vision_config, config.hidden_size)
        self.model = Qwen2VLModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    # transformers 4.45 Qwen2VLForConditionalGeneration.get_rope_index
    def get_rope_index(self, input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
        spatial_merge_size = self.config.vision_config.spatial_merge_size
        image_token_id = self.config.image_token_id
        video_token_id = self.config.video_token_id
        vision_start_token_id = self.config.vision_start_token_id
        mrope_position_deltas = []
        if image_grid_thw is not None or video_grid_thw is not None:
            total_input_ids = input_ids
            position_ids = torch.ones(3, input_ids.shape[0], input_ids.shape[1], dtype=input_ids.dtype, device=input_ids.device)
            image_index, video_index = 0, 0
            for i, input_ids in enumerate(total_input_ids):
                if attention_mask is not None:
                    input_ids = input_ids[attention_mask[i] == 1]
                image_nums, video_nums = 0, 0
                vision_start_indices = torch.argwhere(input_ids == vision_start_token_id).squeeze(1)
                vision_tokens = input_ids[vision_start_indices + 1]
                image_nums = (vision_tokens == image_token_id).sum()
                video_nums = (vision_tokens == video_token_id).sum()
                input_tokens = input_ids.tolist()
                llm_pos_ids_list: list = []
                st = 0
                remain_images, remain_videos = image_nums, video_nums
                for _ in range(image_nums + video_nums):
                    if image_token_id in input_tokens and remain_images > 0:
                        ed_image = input_tokens.index(image_token_id, st)
                    else:
                        ed_image = len(input_tokens) + 1
                    if video_token_id in input_tokens and remain_videos > 0:
                        ed_video = input_tokens.index(video_token_id, st)
                    else:
                        ed_video = len(input_tokens) + 1
                    if ed_image < ed_video:
                        t, h, w = image_grid_thw[image_index][0], image_grid_thw[image_index][1], image_grid_thw[image_index][2]
                        image_index += 1
                        remain_images -= 1
                        ed = ed_image
                    else:
                        t, h, w = video_grid_thw[video_index][0], video_grid_thw[video_index][1], video_grid_thw[video_index][2]
                        video_index += 1
                        remain_videos -= 1
                        ed = ed_video
                    llm_grid_t, llm_grid_h, llm_grid_w = t.item(), h.item() // spatial_merge_size, w.item() // spatial_merge_size
                    text_len = ed - st

                    st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                    llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)

                    t_index = torch.arange(llm_grid_t).view(-1, 1).expand(-1, llm_grid_h * llm_grid_w).flatten()
                    h_index = torch.arange(llm_grid_h).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
                    w_index = torch.arange(llm_grid_w).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
                    llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
                    st = ed + llm_grid_t * llm_grid_h * llm_grid_w

                if st < len(input_tokens):
                    st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                    text_len = len(input_tokens) - st
                    llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)

                llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
                position_ids[..., i, attention_mask[i] == 1] = llm_positions.to(position_ids.device)
                mrope_position_deltas.append(llm_positions.max() + 1 - len(total_input_ids[i]))
            mrope_position_deltas = torch.tensor(mrope_position_deltas, device=input_ids.device).unsqueeze(1)
            return position_ids, mrope_position_deltas
        else:
            if attention_mask is not None:
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(attention_mask == 0, 1)
                position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
                max_position_ids = position_ids.max(0, keepdim=False)[0].max(-1, keepdim=True)[0]
                mrope_position_deltas = max_position_ids + 1 - attention_mask.shape[-1]
            else:
                position_ids = torch.arange(input_ids.shape[1]).view(1, 1, -1).expand(3, input_ids.shape[0], -1)
                mrope_position_deltas = torch.zeros([input_ids.shape[0], 1], dtype=input_ids.dtype)
            return position_ids, mrope_position_deltas


# Stand-in for liger_kernel.transformers.fused_linear_cross_entropy (same result, unfused).
class LigerFusedLinearCrossEntropyLoss(nn.Module):
    def __init__(self, ignore_index=-100):
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, lin_weight, _input, target):
        logits = (_input @ lin_weight.t()).float()
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index)


# liger_kernel/transformers/model/qwen2_vl.py lce_forward (bound as Qwen2VLForConditionalGeneration.forward)
def lce_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, pixel_values=None, pixel_values_videos=None,
                image_grid_thw=None, video_grid_thw=None, rope_deltas=None):
    output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
    output_hidden_states = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
    return_dict = return_dict if return_dict is not None else self.config.use_return_dict

    if inputs_embeds is None:
        inputs_embeds = self.model.embed_tokens(input_ids)
        if pixel_values is not None:
            pixel_values = pixel_values.type(self.visual.get_dtype())
            image_embeds = self.visual(pixel_values, grid_thw=image_grid_thw).to(inputs_embeds.device)
            image_mask = input_ids == self.config.image_token_id
            if self.training:
                inputs_embeds = inputs_embeds.clone()
            inputs_embeds[image_mask] = image_embeds
        if pixel_values_videos is not None:
            pixel_values_videos = pixel_values_videos.type(self.visual.get_dtype())
            video_embeds = self.visual(pixel_values_videos, grid_thw=video_grid_thw).to(inputs_embeds.device)
            video_mask = input_ids == self.config.video_token_id
            inputs_embeds[video_mask] = video_embeds
        if attention_mask is not None:
            attention_mask = attention_mask.to(inputs_embeds.device)
    if FIXED:
        # The code is copied from https://github.com/huggingface/transformers/pull/33487
        if position_ids is None and input_ids is not None:
            position_ids, _ = self.get_rope_index(input_ids, image_grid_thw, video_grid_thw, attention_mask)

    outputs = self.model(
        input_ids=None,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        return_dict=return_dict,
    )
    hidden_states = outputs[0]

    loss = None
    logits = None
    if self.training and (labels is not None):
        shift_hidden_states = hidden_states[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        shift_hidden_states = shift_hidden_states.view(-1, self.config.hidden_size)
        shift_labels = shift_labels.view(-1)
        lce = LigerFusedLinearCrossEntropyLoss()
        loss = lce(self.lm_head.weight, shift_hidden_states, shift_labels)
    else:
        logits = self.lm_head(hidden_states).float()
    return loss, logits, hidden_states


# apply_liger_kernel_to_qwen2_vl(fused_linear_cross_entropy=True): monkeypatch the forward
Qwen2VLForConditionalGeneration.forward = lce_forward


def build_batch(config):
    """A right-padded SFT batch as the collator hands it (two samples, images of different sizes)."""
    V0, IM, V1, PAD = config.vision_start_token_id, config.image_token_id, config.vision_end_token_id, config.pad_token_id
    merge = config.vision_config.spatial_merge_size
    image_grid_thw = torch.tensor([[1, 4, 6], [1, 4, 4]])  # 6 and 4 merged tokens
    n_img = [int(t * h * w // merge**2) for t, h, w in image_grid_thw.tolist()]
    prompts = [[1, 5, 6], [1, 7]]
    answers = [[20, 21, 22, 23, 2], [24, 25, 26, 27, 28, 29, 2]]
    rows, labs = [], []
    for p, n, a in zip(prompts, n_img, answers):
        ids = [p[0], V0] + [IM] * n + [V1] + p[1:] + a
        lab = [-100] * (len(ids) - len(a)) + a
        rows.append(ids)
        labs.append(lab)
    L = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [PAD] * (L - len(r)) for r in rows])
    labels = torch.tensor([l + [-100] * (L - len(l)) for l in labs])
    attention_mask = (torch.arange(L)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
    n_patches = int(image_grid_thw.prod(-1).sum())
    pixel_values = torch.randn(n_patches, config.vision_config.in_chans)
    return input_ids, attention_mask, labels, pixel_values, image_grid_thw


def main():
    config = Qwen2VLConfig()
    model = Qwen2VLForConditionalGeneration(config)
    model.train()
    input_ids, attention_mask, labels, pixel_values, image_grid_thw = build_batch(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss, _, hidden = model.forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                        pixel_values=pixel_values, image_grid_thw=image_grid_thw)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.6f}")
    model.eval()
    with torch.no_grad():
        _, logits, _ = model.forward(input_ids=input_ids, attention_mask=attention_mask,
                                     pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    last = attention_mask.sum(-1) - 1
    print("last-token logits[:4] per row:", [[round(v, 4) for v in logits[b, last[b], :4].tolist()] for b in range(2)])


if __name__ == "__main__":
    main()
