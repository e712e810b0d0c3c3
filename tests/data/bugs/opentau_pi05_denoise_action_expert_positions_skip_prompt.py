# TensorAuto/OpenTau#72 (commit f77ce7f, closes TensorAuto/OpenTau#71)
# pi05 denoise_step numbered the action expert's RoPE positions from
# sum(prefix_pad_masks[:, :-discrete_action_max_length]), as in training, but at inference the prefix
# holds no discrete action tokens, so the last prompt tokens were dropped and the action queries sat at
# positions that overlap the cached image/language keys. The fix counts the whole prefix pad mask.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv


@dataclass
class PI05Config:
    n_action_steps: int = 8
    max_action_dim: int = 6
    tokenizer_max_length: int = 12
    discrete_action_max_length: int = 6
    proj_width: int = 64
    dropout: float = 0.0
    num_steps: int = 4
    use_cache: bool = True
    # small PaliGemma / Gemma expert stand-ins
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 16
    vocab_size: int = 100
    patch_dim: int = 12
    num_patches: int = 8


def create_sinusoidal_pos_embedding(time, dimension, min_period, max_period, device="cpu"):
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=torch.float64, device=device)
    period = min_period * (max_period / min_period) ** fraction
    scaling_factor = 1.0 / period * 2 * math.pi
    sin_input = scaling_factor[None, :] * time[:, None]
    pos_emb = torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1)
    return pos_emb.float()


def make_att_2d_masks(pad_masks, att_masks, n_cross_att_tokens=None, cross_att_pad_masks=None):
    if att_masks.ndim != 2:
        raise ValueError(att_masks.ndim)
    if pad_masks.ndim != 2:
        raise ValueError(pad_masks.ndim)

    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    att_2d_masks = att_2d_masks & pad_2d_masks

    if n_cross_att_tokens is not None:
        assert cross_att_pad_masks is not None
        assert cross_att_pad_masks.shape == (att_masks.size(0), n_cross_att_tokens)
        cross_att_mask = torch.full(
            (att_masks.size(0), att_masks.size(1), n_cross_att_tokens), True, dtype=torch.bool,
            device=att_masks.device,
        )
        cross_att_mask = cross_att_mask & pad_masks[:, :, None] & cross_att_pad_masks[:, None, :]
        att_2d_masks = torch.cat((att_2d_masks, cross_att_mask), dim=2)

    return att_2d_masks


def apply_rope(x, positions, max_wavelength=10_000):
    d_half = x.shape[-1] // 2
    dtype = x.dtype
    x = x.to(torch.float32)
    freq_exponents = (2.0 / x.shape[-1]) * torch.arange(d_half, dtype=torch.float32, device=x.device)
    timescale = max_wavelength**freq_exponents
    radians = positions[..., None].to(torch.float32) / timescale[None, None, :].to(torch.float32)
    radians = radians[..., None, :]
    sin = torch.sin(radians)
    cos = torch.cos(radians)
    x1, x2 = x.split(d_half, dim=-1)
    res = torch.empty_like(x)
    res[..., :d_half] = x1 * cos - x2 * sin
    res[..., d_half:] = x2 * cos + x1 * sin
    return res.to(dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, cond_dim=None, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.dense = nn.Linear(cond_dim, dim * 3) if cond_dim is not None else None

    def forward(self, x, cond=None):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if cond is None or self.dense is None:
            return normed * (1.0 + self.weight), None
        scale, shift, gate = self.dense(cond)[:, None, :].chunk(3, dim=-1)
        return normed * (1.0 + scale) + shift, gate


def _gated_residual(x, y, gate):
    if gate is None:
        return x + y
    return x + y * gate


class GemmaAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class GemmaMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, 2 * c.hidden_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, 2 * c.hidden_size, bias=False)
        self.down_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, c, cond_dim=None):
        super().__init__()
        self.self_attn = GemmaAttention(c)
        self.mlp = GemmaMLP(c)
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, cond_dim)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, cond_dim)


class GemmaModel(nn.Module):
    def __init__(self, c, cond_dim=None):
        super().__init__()
        self.layers = nn.ModuleList([GemmaDecoderLayer(c, cond_dim) for _ in range(c.num_hidden_layers)])
        self.norm = GemmaRMSNorm(c.hidden_size, cond_dim)


class PaliGemmaWithExpertModel(nn.Module):
    def __init__(self, config: PI05Config):
        super().__init__()
        self.config = config
        self.vision_tower = nn.Linear(config.patch_dim, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.language_model = GemmaModel(config)
        self.gemma_expert = GemmaModel(config, cond_dim=config.proj_width)
        self.dropout = nn.Dropout(config.dropout)

    def embed_image(self, image):
        return self.vision_tower(image)

    def embed_language_tokens(self, tokens):
        return self.embed_tokens(tokens)

    def forward(self, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                n_cross_att_tokens=None, use_cache=None, fill_kv_cache=None, adarms_cond=None):
        if adarms_cond is None:
            adarms_cond = [None, None]

        models = [self.language_model, self.gemma_expert]

        for hidden_states in inputs_embeds:
            if hidden_states is None:
                continue
            batch_size = hidden_states.shape[0]

        num_layers = self.config.num_hidden_layers
        head_dim = self.config.head_dim
        for layer_idx in range(num_layers):
            query_states = []
            key_states = []
            value_states = []
            gates = []
            for i, hidden_states in enumerate(inputs_embeds):
                if hidden_states is None:
                    gates.append(None)
                    continue
                layer = models[i].layers[layer_idx]
                hidden_states, gate = layer.input_layernorm(hidden_states, cond=adarms_cond[i])
                gates.append(gate)
                input_shape = hidden_states.shape[:-1]
                hidden_shape = (*input_shape, -1, layer.self_attn.head_dim)

                query_state = layer.self_attn.q_proj(hidden_states).view(hidden_shape)
                key_state = layer.self_attn.k_proj(hidden_states).view(hidden_shape)
                value_state = layer.self_attn.v_proj(hidden_states).view(hidden_shape)

                query_states.append(query_state)
                key_states.append(key_state)
                value_states.append(value_state)

            query_states = torch.cat(query_states, dim=1)
            key_states = torch.cat(key_states, dim=1)
            value_states = torch.cat(value_states, dim=1)

            query_states = apply_rope(query_states, position_ids)
            key_states = apply_rope(key_states, position_ids)

            if use_cache and past_key_values is None:
                past_key_values = {}

            if use_cache:
                if fill_kv_cache:
                    if n_cross_att_tokens is None:
                        raise ValueError("n_cross_att_tokens must be provided when fill_kv_cache is True")
                    past_key_values[layer_idx] = {
                        "key_states": key_states[:, :n_cross_att_tokens, :, :],
                        "value_states": value_states[:, :n_cross_att_tokens, :, :],
                    }
                else:
                    key_states = torch.cat([key_states, past_key_values[layer_idx]["key_states"]], dim=1)
                    value_states = torch.cat([value_states, past_key_values[layer_idx]["value_states"]], dim=1)

            att_output = self.eager_attention_forward(
                attention_mask, batch_size, head_dim, query_states, key_states, value_states
            )

            outputs_embeds = []
            start = 0
            for i, hidden_states in enumerate(inputs_embeds):
                layer = models[i].layers[layer_idx]
                if hidden_states is not None:
                    end = start + hidden_states.shape[1]
                    out_emb = layer.self_attn.o_proj(att_output[:, start:end])
                    out_emb = self.dropout(out_emb)
                    out_emb = _gated_residual(hidden_states, out_emb, gates[i])
                    after_first_residual = out_emb.clone()
                    out_emb, gate = layer.post_attention_layernorm(out_emb, cond=adarms_cond[i])
                    out_emb = layer.mlp(out_emb)
                    out_emb = self.dropout(out_emb)
                    out_emb = _gated_residual(after_first_residual, out_emb, gate)
                    outputs_embeds.append(out_emb)
                    start = end
                else:
                    outputs_embeds.append(None)

            inputs_embeds = outputs_embeds

        outputs_embeds = []
        for i, hidden_states in enumerate(inputs_embeds):
            if hidden_states is not None:
                out_emb, _ = models[i].norm(hidden_states, cond=adarms_cond[i])
                outputs_embeds.append(out_emb)
            else:
                outputs_embeds.append(None)

        return outputs_embeds, past_key_values

    def eager_attention_forward(self, attention_mask, batch_size, head_dim, query_states, key_states,
                                value_states):
        num_att_heads = self.config.num_attention_heads
        num_key_value_heads = self.config.num_key_value_heads
        num_key_value_groups = num_att_heads // num_key_value_heads

        sequence_length = key_states.shape[1]

        key_states = key_states[:, :, :, None, :].expand(
            batch_size, sequence_length, num_key_value_heads, num_key_value_groups, head_dim
        )
        key_states = key_states.reshape(
            batch_size, sequence_length, num_key_value_heads * num_key_value_groups, head_dim
        )
        value_states = value_states[:, :, :, None, :].expand(
            batch_size, sequence_length, num_key_value_heads, num_key_value_groups, head_dim
        )
        value_states = value_states.reshape(
            batch_size, sequence_length, num_key_value_heads * num_key_value_groups, head_dim
        )

        query_states = query_states.to(dtype=torch.float32)
        key_states = key_states.to(dtype=torch.float32)

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)

        att_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        att_weights *= head_dim**-0.5
        big_neg = -2.3819763e38

        masked_att_weights = torch.where(attention_mask[:, None, :, :], att_weights, big_neg)

        probs = nn.functional.softmax(masked_att_weights, dim=-1)
        probs = probs.to(dtype=value_states.dtype)

        att_output = torch.matmul(probs, value_states.permute(0, 2, 1, 3))
        att_output = att_output.permute(0, 2, 1, 3)
        att_output = att_output.reshape(batch_size, -1, num_key_value_heads * num_key_value_groups * head_dim)
        return att_output


class PI05FlowMatching(nn.Module):
    def __init__(self, config: PI05Config):
        super().__init__()
        self.config = config
        self.paligemma_with_expert = PaliGemmaWithExpertModel(config)
        self.action_in_proj = nn.Linear(self.config.max_action_dim, self.config.proj_width)
        self.action_out_proj = nn.Linear(self.config.proj_width, self.config.max_action_dim)
        self.time_mlp_in = nn.Linear(self.config.proj_width, self.config.proj_width)
        self.time_mlp_out = nn.Linear(self.config.proj_width, self.config.proj_width)

        self._init_model()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def _init_model(self):
        # init_strategy == "full_he_init"
        for m in self.modules():
            self._init_weights(m)

    def sample_noise(self, shape, device):
        return torch.normal(mean=0.0, std=1.0, size=shape, dtype=torch.float32, device=device)

    def embed_prefix(self, images, img_masks, lang_tokens, lang_masks, discrete_actions=None,
                     discrete_action_masks=None):
        embs = []
        pad_masks = []
        att_masks = []

        for img, img_mask in zip(images, img_masks, strict=False):
            img_emb = self.paligemma_with_expert.embed_image(img)
            bsize, num_img_embs = img_emb.shape[:2]
            img_mask = img_mask[:, None].expand(bsize, num_img_embs)
            embs.append(img_emb)
            pad_masks.append(img_mask)
            att_masks += [0] * num_img_embs

        lang_emb = self.paligemma_with_expert.embed_language_tokens(lang_tokens)
        lang_emb_dim = lang_emb.shape[-1]
        lang_emb = lang_emb * math.sqrt(lang_emb_dim)

        embs.append(lang_emb)
        pad_masks.append(lang_masks)

        num_lang_embs = lang_emb.shape[1]
        att_masks += [0] * num_lang_embs

        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=torch.bool, device=pad_masks.device)
        att_masks = att_masks[None, :].expand(bsize, len(att_masks))
        return embs, pad_masks, att_masks

    def embed_suffix(self, noisy_actions, timestep):
        embs = []
        pad_masks = []
        att_masks = []

        bsize = noisy_actions.shape[0]
        device = noisy_actions.device

        time_emb = create_sinusoidal_pos_embedding(
            timestep, self.config.proj_width, min_period=4e-3, max_period=4.0, device=device
        )
        action_emb = self.action_in_proj(noisy_actions)

        def time_mlp_func(time_emb):
            x = self.time_mlp_in(time_emb)
            x = F.silu(x)
            x = self.time_mlp_out(x)
            return F.silu(x)

        adarms_cond = time_mlp_func(time_emb)

        embs.append(action_emb)
        bsize, action_dim = action_emb.shape[:2]
        action_mask = torch.ones(bsize, action_dim, dtype=torch.bool, device=device)
        pad_masks.append(action_mask)

        att_masks += [1] + ([0] * (self.config.n_action_steps - 1))

        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=embs.dtype, device=embs.device)
        att_masks = att_masks[None, :].expand(bsize, len(att_masks))
        return embs, pad_masks, att_masks, adarms_cond

    @torch.no_grad()
    def sample_actions(self, images, img_masks, lang_tokens, lang_masks, noise=None):
        bsize = lang_tokens.shape[0]
        device = lang_tokens.device

        if noise is None:
            actions_shape = (bsize, self.config.n_action_steps, self.config.max_action_dim)
            noise = self.sample_noise(actions_shape, device)

        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(
            images, img_masks, lang_tokens, lang_masks
        )
        prefix_att_2d_masks = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
        prefix_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1

        num_cross_att_tokens = prefix_embs.shape[1]

        _, past_key_values = self.paligemma_with_expert.forward(
            attention_mask=prefix_att_2d_masks,
            position_ids=prefix_position_ids,
            past_key_values=None,
            inputs_embeds=[prefix_embs, None],
            n_cross_att_tokens=num_cross_att_tokens,
            use_cache=self.config.use_cache,
            fill_kv_cache=True,
        )

        dt = -1.0 / self.config.num_steps
        dt = torch.tensor(dt, dtype=torch.float32, device=device)

        x_t = noise
        time = torch.tensor(1.0, dtype=torch.float32, device=device)
        while time >= -dt / 2:
            expanded_time = time.expand(bsize)
            v_t = self.denoise_step(prefix_pad_masks, past_key_values, x_t, expanded_time)
            x_t += dt * v_t
            time += dt
        return x_t

    def denoise_step(self, prefix_pad_masks, past_key_values, x_t, timestep):
        suffix_embs, suffix_pad_masks, suffix_att_masks, adarms_cond = self.embed_suffix(x_t, timestep)

        num_cross_att_tokens = prefix_pad_masks.shape[1]
        action_expert_2d_attention_mask = make_att_2d_masks(
            suffix_pad_masks,
            suffix_att_masks,
            n_cross_att_tokens=num_cross_att_tokens,
            cross_att_pad_masks=prefix_pad_masks[:, :num_cross_att_tokens],
        )
        if FIXED:
            prefix_offsets = torch.sum(prefix_pad_masks, dim=-1)[
                :, None
            ]  # action expert position ids start after prefix
        else:
            # We should skip the response tokens when numbering the position ids for the action expert
            prefix_offsets = torch.sum(prefix_pad_masks[:, : -self.config.discrete_action_max_length], dim=-1)[
                :, None
            ]  # action expert position ids start after prefix
        action_expert_position_ids = prefix_offsets + torch.cumsum(suffix_pad_masks, dim=1) - 1

        outputs_embeds, _ = self.paligemma_with_expert.forward(
            attention_mask=action_expert_2d_attention_mask,
            position_ids=action_expert_position_ids,
            past_key_values=past_key_values,
            inputs_embeds=[None, suffix_embs],
            use_cache=True,
            fill_kv_cache=False,
            adarms_cond=[None, adarms_cond],
        )
        suffix_out = outputs_embeds[1]
        suffix_out = suffix_out[:, -self.config.n_action_steps :]
        v_t = self.action_out_proj(suffix_out)
        return v_t


def main():
    torch.manual_seed(0)
    config = PI05Config()
    model = PI05FlowMatching(config).eval()

    bsize = 2
    images = [torch.randn(bsize, config.num_patches, config.patch_dim)]
    img_masks = [torch.ones(bsize, dtype=torch.bool)]
    lang_tokens = torch.randint(1, config.vocab_size, (bsize, config.tokenizer_max_length))
    lang_lengths = torch.tensor([12, 7])
    lang_masks = torch.arange(config.tokenizer_max_length)[None, :] < lang_lengths[:, None]
    lang_tokens = lang_tokens.masked_fill(~lang_masks, 0)

    noise = torch.randn(bsize, config.n_action_steps, config.max_action_dim)
    actions = model.sample_actions(images, img_masks, lang_tokens, lang_masks, noise=noise)
    print(f"fixed={FIXED} actions norm={actions.norm().item():.6f}")


if __name__ == "__main__":
    main()
