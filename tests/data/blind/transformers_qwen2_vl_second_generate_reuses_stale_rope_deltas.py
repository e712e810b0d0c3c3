"""Qwen2-VL generation: a second `generate()` call reuses the first call's `rope_deltas`.

Citation: huggingface/transformers#43952 ("Fix qwen-vl position ids when generating several times",
fixes huggingface/trl#5088), in src/transformers/models/qwen2_vl/modeling_qwen2_vl.py
``Qwen2VLForConditionalGeneration._prepare_position_ids_for_generation`` (added by #43734).

The bug: ``_prepare_position_ids_for_generation`` took an early exit whenever ``self.model.rope_deltas``
was set, returning ``text_positions + self.model.rope_deltas``. ``rope_deltas`` is state kept on the model
from the previous call, so the second ``generate()`` (a new prompt with its own image, no cache yet, as
TRL's GRPO loop does every step) got 1-D text positions plus the first prompt's delta on all three M-RoPE
axes: its image tokens lost their (t, h, w) layout and every token after the image was shifted by the
wrong delta. Only the first generate after loading was right.

The fix: take the early exit only when continuing from a cache
(``past_length != 0 and self.model.rope_deltas is not None``); a generation from scratch calls
``get_rope_index`` again and stores the new deltas. (The fixed lines here are those of the installed
release; the pre-fix condition is the one the PR description names.)

Ported at toy sizes with random weights: the config is transformers' ``Qwen2VLConfig``; the text model
is a hand-written Qwen2 decoder with M-RoPE (``mrope_section``), SDPA with a 4-D mask built from the
left-padded 2-D ``attention_mask`` and a hand-written KV cache; the vision tower is replaced by a fixed
projection of ``pixel_values`` (one row per merged image token). ``get_rope_index`` follows the
released code (token-type groups, ``get_vision_position_ids``). A left-padded batch of two is
generated twice with different prompts and images.
"""

import itertools
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2VLConfig

FIXED = "--fixed" in sys.argv

PAD, VISION_START, VISION_END, IMAGE, VIDEO = 0, 61, 62, 60, 59


class KVCache:
    def __init__(self, num_layers):
        self.keys = [None] * num_layers
        self.values = [None] * num_layers

    def get_seq_length(self):
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def update(self, k, v, layer_idx):
        if self.keys[layer_idx] is None:
            self.keys[layer_idx], self.values[layer_idx] = k, v
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section):
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Qwen2VLRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        base = config.rope_parameters["rope_theta"]
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x, position_ids):
        # position_ids is broadcast to (3, bs, positions)
        position_ids = position_ids.expand(3, -1, -1)
        inv_freq = self.inv_freq[None, None, :, None].expand(3, position_ids.shape[1], -1, 1)
        freqs = (inv_freq @ position_ids[:, :, None, :].float()).transpose(2, 3)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Qwen2VLAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.mrope_section = config.rope_parameters["mrope_section"]
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_multimodal_rotary_pos_emb(q, k, cos, sin, self.mrope_section)
        k, v = cache.update(k, v, self.layer_idx)
        rep = self.num_heads // self.num_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class Qwen2VLDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Qwen2VLAttention(config, layer_idx)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size), nn.SiLU(),
            nn.Linear(config.intermediate_size, config.hidden_size),
        )

    def forward(self, h, position_embeddings, attention_mask, cache):
        h = h + self.self_attn(self.input_layernorm(h), position_embeddings, attention_mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2VLModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        tc = config.text_config
        self.embed_tokens = nn.Embedding(tc.vocab_size, tc.hidden_size)
        self.visual = nn.Linear(12, tc.hidden_size)  # stands in for the vision tower + patch merger
        self.layers = nn.ModuleList([Qwen2VLDecoderLayer(tc, i) for i in range(tc.num_hidden_layers)])
        self.norm = nn.RMSNorm(tc.hidden_size, eps=tc.rms_norm_eps)
        self.rotary_emb = Qwen2VLRotaryEmbedding(tc)
        self.rope_deltas = None  # cache rope_deltas here

    def get_vision_position_ids(self, start_position, grid_thw, temp_merge_size, spatial_merge_size, device=None):
        llm_grid_t = grid_thw[0].item() // temp_merge_size
        llm_grid_h = grid_thw[1].item() // spatial_merge_size
        llm_grid_w = grid_thw[2].item() // spatial_merge_size
        t_index = torch.arange(llm_grid_t, device=device).view(-1, 1).expand(-1, llm_grid_h * llm_grid_w).flatten()
        h_index = torch.arange(llm_grid_h, device=device).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
        w_index = torch.arange(llm_grid_w, device=device).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
        return torch.stack([t_index, h_index, w_index]) + start_position

    def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                       attention_mask=None, **kwargs):
        spatial_merge_size = self.config.vision_config.spatial_merge_size
        mrope_position_deltas = []
        position_ids = torch.zeros(3, input_ids.shape[0], input_ids.shape[1], dtype=input_ids.dtype)
        grid_iters = {
            1: iter(image_grid_thw) if image_grid_thw is not None else None,
            2: iter(video_grid_thw) if video_grid_thw is not None else None,
        }
        for batch_idx, current_input_ids in enumerate(input_ids):
            input_token_type = mm_token_type_ids[batch_idx]
            if attention_mask is not None:
                current_input_ids = current_input_ids[attention_mask[batch_idx].bool()]
                input_token_type = input_token_type[attention_mask[batch_idx].bool()]
            input_type_group = []
            for key, group in itertools.groupby(enumerate(input_token_type.tolist()), lambda x: x[1]):
                group = list(group)
                input_type_group.append((key, group[0][0], group[-1][0] + 1))
            current_pos = 0
            llm_pos_ids_list = []
            for modality_type, start_idx, end_idx in input_type_group:
                if modality_type == 0:
                    text_len = end_idx - start_idx
                    llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + current_pos)
                    current_pos += text_len
                else:
                    grid_thw = next(grid_iters[modality_type])
                    llm_pos_ids_list.append(self.get_vision_position_ids(current_pos, grid_thw, 1, spatial_merge_size))
                    current_pos += max(grid_thw[1], grid_thw[2]) // spatial_merge_size
            llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
            if attention_mask is not None:
                position_ids[:, batch_idx, attention_mask[batch_idx].bool()] = llm_positions
            else:
                position_ids[:, batch_idx] = llm_positions
            mrope_position_deltas.append(llm_positions.max() + 1 - len(current_input_ids))
        mrope_position_deltas = torch.tensor(mrope_position_deltas).unsqueeze(1)
        return position_ids, mrope_position_deltas

    def forward(self, input_ids, attention_mask, position_ids, cache, pixel_values=None):
        inputs_embeds = self.embed_tokens(input_ids)
        if pixel_values is not None:
            image_embeds = self.visual(pixel_values)
            image_mask = (input_ids == self.config.image_token_id).unsqueeze(-1).expand_as(inputs_embeds)
            inputs_embeds = inputs_embeds.masked_scatter(image_mask, image_embeds)

        # [4, bs, seq]: text positions first, then the three M-RoPE axes; otherwise usual 3D positions
        if position_ids.ndim == 3 and position_ids.shape[0] == 4:
            text_position_ids = position_ids[0]
            position_ids = position_ids[1:]
        else:
            text_position_ids = None

        # 4-D mask: causal over cache + new tokens, and the 2-D padding mask on the keys
        past = cache.get_seq_length()
        q_len = input_ids.shape[1]
        kv_len = past + q_len
        causal = torch.arange(kv_len)[None, :] <= (torch.arange(q_len) + past)[:, None]
        mask = causal[None, None] & attention_mask[:, None, None, :kv_len].bool()

        h = inputs_embeds
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, position_embeddings, mask, cache)
        return self.norm(h)


class Qwen2VLForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Qwen2VLModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)

    def _text_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        # GenerationMixin._prepare_position_ids_for_generation
        if (attention_mask := model_kwargs.get("attention_mask")) is not None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids = position_ids.masked_fill(attention_mask == 0, 0)
        else:
            past_length = 0
            if (cache := model_kwargs.get("past_key_values")) is not None:
                past_length = cache.get_seq_length()
            position_ids = torch.arange(inputs_tensor.shape[1] + past_length).unsqueeze(0)
        return position_ids

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        # Overwritten -- requires 3D position ids
        text_positions = self._text_position_ids_for_generation(inputs_tensor, model_kwargs)

        # Early exit in case we are continuing generation from past kv
        if FIXED:
            past_length = 0
            if (cache := model_kwargs.get("past_key_values")) is not None:
                past_length = cache.get_seq_length()
            if past_length != 0 and self.model.rope_deltas is not None:
                position_ids = text_positions[None, ...] + self.model.rope_deltas
                return position_ids
        else:
            if self.model.rope_deltas is not None:
                position_ids = text_positions[None, ...] + self.model.rope_deltas
                return position_ids

        # Otherwise compute 3d position ids for vision tokens and concat with text position ids
        if "input_ids" in model_kwargs and model_kwargs["input_ids"].shape[1] > 0:
            inputs_tensor = model_kwargs["input_ids"]

        is_input_ids = len(inputs_tensor.shape) == 2 and inputs_tensor.dtype in [torch.int, torch.long]
        if (
            is_input_ids
            and model_kwargs.get("mm_token_type_ids") is not None
            and (model_kwargs.get("image_grid_thw") is not None or model_kwargs.get("video_grid_thw") is not None)
        ):
            model_kwargs = {k: v for k, v in model_kwargs.items() if k != "input_ids"}
            vision_positions, rope_deltas = self.model.get_rope_index(inputs_tensor, **model_kwargs)
            self.model.rope_deltas = rope_deltas
        else:
            vision_positions = text_positions.unsqueeze(0).expand(3, -1, -1)
            self.model.rope_deltas = torch.zeros(inputs_tensor.shape[0], 1, dtype=torch.long)

        # Concatenate "text + vision" positions into [4, bs, seq-len]
        text_positions = text_positions[None, ...]
        return torch.cat([text_positions, vision_positions], dim=0)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, mm_token_type_ids, image_grid_thw, pixel_values,
                 max_new_tokens=4):
        cache = KVCache(self.config.text_config.num_hidden_layers)
        model_kwargs = dict(attention_mask=attention_mask, mm_token_type_ids=mm_token_type_ids,
                            image_grid_thw=image_grid_thw, past_key_values=cache)
        position_ids = self._prepare_position_ids_for_generation(input_ids, model_kwargs)
        step_ids, step_pixels = input_ids, pixel_values
        out_tokens, first_logits = [], None
        for _ in range(max_new_tokens):
            hidden = self.model(step_ids, attention_mask, position_ids, cache, pixel_values=step_pixels)
            logits = self.lm_head(hidden[:, -1])
            if first_logits is None:
                first_logits = logits
            next_tok = logits.argmax(-1, keepdim=True)
            out_tokens.append(next_tok)
            step_ids, step_pixels = next_tok, None
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_tok)], dim=-1)
            # decode steps: the next positions are the last ones plus one
            position_ids = position_ids[..., -1:] + 1
        return torch.cat(out_tokens, dim=-1), first_logits


def build_batch(prompts, images):
    """Left-pad the prompts (processor padding_side="left"); each image is grid (1, h, w) of patches."""
    merge = 2
    rows, grids, pixels = [], [], []
    for (pre, post), (h, w) in zip(prompts, images):
        n_img = (h // merge) * (w // merge)
        rows.append(pre + [VISION_START] + [IMAGE] * n_img + [VISION_END] + post)
        grids.append([1, h, w])
        pixels.append(torch.randn(n_img, 12))
    max_len = max(len(r) for r in rows)
    input_ids = torch.tensor([[PAD] * (max_len - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (max_len - len(r)) + [1] * len(r) for r in rows])
    mm_token_type_ids = (input_ids == IMAGE).long()
    return input_ids, attention_mask, mm_token_type_ids, torch.tensor(grids), torch.cat(pixels)


def main():
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2])),
        vision_config=dict(spatial_merge_size=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
        bos_token_id=1, eos_token_id=2,
    )
    model = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
        for layer in model.model.layers:  # sharper attention than the random init gives
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)

    # step 1 (e.g. a GRPO rollout): two prompts with large images
    batch1 = build_batch([([1, 5, 6], [7, 8]), ([1, 9], [10, 11, 12, 13])], [(8, 8), (8, 6)])
    toks1, logits1 = model.generate(*batch1)
    print("generate #1 tokens:", toks1.tolist(), "rope_deltas:", model.model.rope_deltas.flatten().tolist())

    # step 2: new prompts, new (smaller) images, generated from scratch
    batch2 = build_batch([([1, 14, 15, 16, 17], [18]), ([1, 19, 20], [21, 22])], [(4, 6), (6, 4)])
    toks2, logits2 = model.generate(*batch2)
    print("generate #2 tokens:", toks2.tolist(), "rope_deltas:", model.model.rope_deltas.flatten().tolist())
    print("generate #2 first-step logits[:, :6]:", [[round(v, 4) for v in row] for row in logits2[:, :6].tolist()])


if __name__ == "__main__":
    main()
