"""OpenTau pi07_paligemma low-level planner: the training forward's action expert reads the "Action: " indicator.

Citation: TensorAuto/OpenTau#260 (merge commit 45a34cb, "Fix/pi07 paligemma fixes"); bug state of
src/opentau/policies/pi07_paligemma/low_level_planner/modeling_pi07_low_level.py read at 45a34cb^,
src/opentau/policies/pi05/paligemma_with_expert.py (apply_rope, _run_layer, eager_attention_forward) at 45a34cb.

During training, embed_prefix appends the "Action: " indicator tokens and the FAST discrete-action tokens to the
prefix. PI07LowLevelPlannerFlowMatching.forward kept the first `prefix_len - discrete_action_max_length` prefix
tokens in the KV cache for the action expert's cross-attention and numbered the action expert's positions from
the valid tokens before the discrete actions, so the indicator tokens (absent at inference, where denoise_step
uses the whole prefix) were cross-attended and counted in the action positions. Fix: subtract
discrete_action_indicator_max_length as well, both for num_cross_att_tokens and for prefix_offsets.
"""

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv


@dataclass
class PI07LowLevelPlannerConfig:
    vocab_size: int = 64
    proj_width: int = 32  # action expert width
    vlm_width: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 8
    num_hidden_layers: int = 2
    prompt_max_length: int = 6
    chunk_size: int = 4
    n_action_steps: int = 4
    max_action_dim: int = 3
    max_delay: int = 0
    discrete_action_vocab_size: int = 16
    discrete_action_max_length: int = 5
    discrete_action_indicator_max_length: int = 2  # len(tokenizer.encode("Action: "))


# stand-in for language_tokenizer.encode(...) of the fixed strings
PREFIX_END_IDS = [11, 12]  # ";\n "
ACTION_START_IDS = [21, 22]  # "Action: "


def apply_rope(x: torch.Tensor, positions: torch.Tensor, max_wavelength: int = 10_000) -> torch.Tensor:
    d_half = x.shape[-1] // 2
    device = x.device
    dtype = x.dtype
    x = x.to(torch.float32)

    freq_exponents = (2.0 / x.shape[-1]) * torch.arange(d_half, dtype=torch.float32, device=device)
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


def make_att_2d_masks(
    pad_masks: Tensor,
    att_masks: Tensor,
    n_cross_att_tokens: int | None = None,
    cross_att_pad_masks: Tensor | None = None,
) -> Tensor:
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
            (att_masks.size(0), att_masks.size(1), n_cross_att_tokens),
            True,
            dtype=torch.bool,
            device=att_masks.device,
        )

        cross_att_mask = cross_att_mask & pad_masks[:, :, None] & cross_att_pad_masks[:, None, :]
        att_2d_masks = torch.cat((cross_att_mask, att_2d_masks), dim=2)

    return att_2d_masks


def create_sinusoidal_pos_embedding(time, dimension, min_period, max_period, device="cpu"):
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=torch.float32, device=device)
    period = min_period * (max_period / min_period) ** fraction
    scaling_factor = 1.0 / period * 2 * math.pi
    sin_input = scaling_factor[None, None, :] * time[:, :, None]
    pos_emb = torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=2)
    return pos_emb


class RMSNorm(nn.Module):
    def __init__(self, dim, cond_dim=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.dense = nn.Linear(cond_dim, dim * 3) if cond_dim is not None else None

    def forward(self, x, cond=None):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        if cond is None or self.dense is None:
            return normed * (1.0 + self.weight), None
        scale, shift, gate = self.dense(cond).chunk(3, dim=-1)
        return normed * (1.0 + scale) + shift, gate


def _gated_residual(x, y, gate):
    if gate is None:
        return x + y
    return x + y * gate


class Attn(nn.Module):
    def __init__(self, width, cfg):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, width, bias=False)


class Layer(nn.Module):
    def __init__(self, width, cfg, cond_dim=None):
        super().__init__()
        self.input_layernorm = RMSNorm(width, cond_dim)
        self.self_attn = Attn(width, cfg)
        self.post_attention_layernorm = RMSNorm(width, cond_dim)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(approximate="tanh"), nn.Linear(2 * width, width))


class Tower(nn.Module):
    def __init__(self, width, cfg, cond_dim=None):
        super().__init__()
        self.layers = nn.ModuleList([Layer(width, cfg, cond_dim) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(width, cond_dim)


class PaliGemmaWithExpertModel(nn.Module):
    """The dual-tower decoder of opentau/policies/pi05/paligemma_with_expert.py, trimmed (eager attention)."""

    def __init__(self, cfg: PI07LowLevelPlannerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.vlm_width)
        self.discrete_action_embedding = nn.Embedding(cfg.discrete_action_vocab_size, cfg.vlm_width)
        self.language_model = Tower(cfg.vlm_width, cfg)
        self.gemma_expert = Tower(cfg.proj_width, cfg, cond_dim=cfg.proj_width)
        self.lm_head = nn.Linear(cfg.vlm_width, cfg.discrete_action_vocab_size, bias=False)

    def embed_language_tokens(self, tokens):
        return self.embed_tokens(tokens)

    def embed_discrete_actions(self, actions):
        return self.discrete_action_embedding(actions)

    def forward(
        self,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        n_cross_att_tokens=None,
        use_cache=None,
        fill_kv_cache=None,
        adarms_cond=None,
    ):
        if adarms_cond is None:
            adarms_cond = [None, None]
        if fill_kv_cache and past_key_values is None:
            past_key_values = {}
        batch_size = next(h for h in inputs_embeds if h is not None).shape[0]
        for layer_idx in range(self.cfg.num_hidden_layers):
            inputs_embeds = self._run_layer(
                layer_idx, inputs_embeds, attention_mask, position_ids, past_key_values,
                n_cross_att_tokens, use_cache, fill_kv_cache, adarms_cond, batch_size, self.cfg.head_dim,
            )
        models = [self.language_model, self.gemma_expert]
        outputs = []
        for i, h in enumerate(inputs_embeds):
            outputs.append(None if h is None else models[i].norm(h, cond=adarms_cond[i])[0])
        return outputs, past_key_values

    def _run_layer(self, layer_idx, inputs_embeds, attention_mask, position_ids, past_key_values,
                   n_cross_att_tokens, use_cache, fill_kv_cache, adarms_cond, batch_size, head_dim):
        models = [self.language_model, self.gemma_expert]

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

            query_states.append(layer.self_attn.q_proj(hidden_states).view(hidden_shape))
            key_states.append(layer.self_attn.k_proj(hidden_states).view(hidden_shape))
            value_states.append(layer.self_attn.v_proj(hidden_states).view(hidden_shape))

        query_states = torch.cat(query_states, dim=1)
        key_states = torch.cat(key_states, dim=1)
        value_states = torch.cat(value_states, dim=1)

        query_states = apply_rope(query_states, position_ids)
        key_states = apply_rope(key_states, position_ids)

        if use_cache:
            key_states = torch.cat([past_key_values[layer_idx]["key_states"], key_states], dim=1)
            value_states = torch.cat([past_key_values[layer_idx]["value_states"], value_states], dim=1)
        if fill_kv_cache:
            if n_cross_att_tokens is None:
                raise ValueError("n_cross_att_tokens must be provided when fill_kv_cache is True")
            past_key_values[layer_idx] = {
                # save the first n_cross_att_tokens for action expert cross attention
                "key_states": key_states[:, :n_cross_att_tokens, :, :],
                "value_states": value_states[:, :n_cross_att_tokens, :, :],
            }

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
                out_emb = _gated_residual(hidden_states, out_emb, gates[i])
                after_first_residual = out_emb.clone()
                out_emb, gate = layer.post_attention_layernorm(out_emb, cond=adarms_cond[i])
                out_emb = layer.mlp(out_emb)
                out_emb = _gated_residual(after_first_residual, out_emb, gate)
                outputs_embeds.append(out_emb)
                start = end
            else:
                outputs_embeds.append(None)
        return outputs_embeds

    def eager_attention_forward(self, attention_mask, batch_size, head_dim, query_states, key_states, value_states):
        num_att_heads = self.cfg.num_attention_heads
        num_key_value_heads = self.cfg.num_key_value_heads
        num_key_value_groups = num_att_heads // num_key_value_heads

        sequence_length = key_states.shape[1]

        key_states = key_states[:, :, :, None, :].expand(
            batch_size, sequence_length, num_key_value_heads, num_key_value_groups, head_dim
        )
        key_states = key_states.reshape(batch_size, sequence_length, num_key_value_heads * num_key_value_groups, head_dim)

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
        big_neg = -2.3819763e38  # See gemma/modules.py

        masked_att_weights = torch.where(attention_mask[:, None, :, :], att_weights, big_neg)

        probs = nn.functional.softmax(masked_att_weights, dim=-1)
        probs = probs.to(dtype=value_states.dtype)

        att_output = torch.matmul(probs, value_states.permute(0, 2, 1, 3))

        att_output = att_output.permute(0, 2, 1, 3)
        att_output = att_output.reshape(batch_size, -1, num_key_value_heads * num_key_value_groups * head_dim)

        return att_output


class PI07LowLevelPlannerFlowMatching(nn.Module):
    def __init__(self, config: PI07LowLevelPlannerConfig):
        super().__init__()
        self.config = config
        self.paligemma_with_expert = PaliGemmaWithExpertModel(config)
        self.state_proj = nn.Linear(config.max_action_dim, config.vlm_width)
        self.action_in_proj = nn.Linear(config.max_action_dim, config.proj_width)
        self.action_out_proj = nn.Linear(config.proj_width, config.max_action_dim)
        self.time_mlp_in = nn.Linear(config.proj_width, config.proj_width)
        self.time_mlp_out = nn.Linear(config.proj_width, config.proj_width)

    def embed_prefix(self, lang_tokens, lang_masks, state, discrete_actions=None, discrete_action_masks=None):
        """[language | state | ";\\n " | ("Action: " + discrete_actions only when training)]"""
        embs = []
        pad_masks = []
        att_masks = []
        bsize = lang_tokens.shape[0]

        lang_emb = self.paligemma_with_expert.embed_language_tokens(lang_tokens)
        lang_emb_dim = lang_emb.shape[-1]
        lang_emb = lang_emb * math.sqrt(lang_emb_dim)

        embs.append(lang_emb)
        pad_masks.append(lang_masks)

        num_lang_embs = lang_emb.shape[1]
        att_masks += [0] * num_lang_embs

        state_emb = self.state_proj(state)[:, None, :]
        embs.append(state_emb)
        pad_masks.append(torch.ones(bsize, 1, dtype=torch.bool, device=state.device))
        att_masks += [0]

        prefix_end_tokens = torch.tensor([PREFIX_END_IDS] * bsize, device=lang_tokens.device, dtype=torch.long)
        prefix_end_emb = self.paligemma_with_expert.embed_language_tokens(prefix_end_tokens)
        prefix_end_emb = prefix_end_emb * math.sqrt(prefix_end_emb.shape[-1])
        num_prefix_end_embs = prefix_end_emb.shape[1]
        prefix_end_mask = torch.ones(bsize, num_prefix_end_embs, dtype=torch.bool, device=lang_tokens.device)
        embs.append(prefix_end_emb)
        pad_masks.append(prefix_end_mask)
        att_masks += [0] * num_prefix_end_embs

        if discrete_actions is not None:
            discrete_action_start_tokens = torch.tensor(
                [ACTION_START_IDS] * bsize, device=lang_tokens.device, dtype=torch.long
            )
            discrete_action_start_emb = self.paligemma_with_expert.embed_language_tokens(discrete_action_start_tokens)
            discrete_action_start_dim = discrete_action_start_emb.shape[-1]
            discrete_action_start_emb = discrete_action_start_emb * math.sqrt(discrete_action_start_dim)

            num_discrete_action_start_embs = discrete_action_start_emb.shape[1]
            discrete_action_start_mask = torch.ones(
                bsize, num_discrete_action_start_embs, dtype=torch.bool, device=lang_tokens.device
            )

            embs.append(discrete_action_start_emb)
            pad_masks.append(discrete_action_start_mask)
            att_masks += [1] * num_discrete_action_start_embs

            discrete_action_emb = self.paligemma_with_expert.embed_discrete_actions(discrete_actions)
            embs.append(discrete_action_emb)
            pad_masks.append(discrete_action_masks)
            att_masks += [1] * discrete_action_emb.shape[1]

        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=torch.bool, device=pad_masks.device)
        att_masks = att_masks[None, :].expand(bsize, len(att_masks))

        return embs, pad_masks, att_masks

    def embed_suffix(self, noisy_actions, timestep):
        embs = []
        pad_masks = []
        att_masks = []

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

        att_masks += [1] + ([0] * (self.config.chunk_size - 1))

        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=torch.bool, device=embs.device)
        att_masks = att_masks[None, :].expand(bsize, len(att_masks))

        return embs, pad_masks, att_masks, adarms_cond

    def forward(self, lang_tokens, lang_masks, state, actions, actions_is_pad=None, noise=None, time=None,
                discrete_actions=None, discrete_action_masks=None):
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(
            lang_tokens, lang_masks, state,
            discrete_actions=discrete_actions, discrete_action_masks=discrete_action_masks,
        )

        vlm_2d_attention_mask = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
        vlm_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1

        if FIXED:
            # avoids using discrete action for predicting continuous flow matching action
            num_cross_att_tokens = (
                prefix_embs.shape[1]
                - self.config.discrete_action_indicator_max_length
                - self.config.discrete_action_max_length
            )
        else:
            num_cross_att_tokens = prefix_embs.shape[1] - self.config.discrete_action_max_length

        (prefix_out, _), past_key_values = self.paligemma_with_expert.forward(
            attention_mask=vlm_2d_attention_mask,
            position_ids=vlm_position_ids,
            past_key_values=None,
            inputs_embeds=[prefix_embs, None],
            n_cross_att_tokens=num_cross_att_tokens,
            use_cache=False,
            fill_kv_cache=True,
        )

        batch_size = actions.shape[0]
        delay = torch.randint(0, self.config.max_delay + 1, (batch_size,))
        prefix_mask = torch.arange(self.config.chunk_size)[None, :] < delay[:, None]
        prefix_mask = prefix_mask.to(device=actions.device)
        time = torch.where(prefix_mask, 0, time[:, None])

        time_expanded = time[:, :, None]
        x_t = time_expanded * noise + (1 - time_expanded) * actions
        u_t = noise - actions

        suffix_embs, suffix_pad_masks, suffix_att_masks, adarms_cond = self.embed_suffix(x_t, time)

        action_expert_2d_attention_mask = make_att_2d_masks(
            suffix_pad_masks,
            suffix_att_masks,
            n_cross_att_tokens=num_cross_att_tokens,
            cross_att_pad_masks=prefix_pad_masks[:, :num_cross_att_tokens],
        )
        if FIXED:
            prefix_offsets = torch.sum(
                prefix_pad_masks[
                    :,
                    : -self.config.discrete_action_indicator_max_length - self.config.discrete_action_max_length,
                ],
                dim=-1,
            )[:, None]
        else:
            prefix_offsets = torch.sum(prefix_pad_masks[:, : -self.config.discrete_action_max_length], dim=-1)[
                :, None
            ]
        action_expert_position_ids = prefix_offsets + torch.cumsum(suffix_pad_masks, dim=1) - 1

        kv_cache: dict = past_key_values
        for layer_idx in kv_cache:
            kv_cache[layer_idx]["key_states"] = kv_cache[layer_idx]["key_states"].detach()
            kv_cache[layer_idx]["value_states"] = kv_cache[layer_idx]["value_states"].detach()

        (_, suffix_out), _ = self.paligemma_with_expert.forward(
            attention_mask=action_expert_2d_attention_mask,
            position_ids=action_expert_position_ids,
            past_key_values=kv_cache,
            inputs_embeds=[None, suffix_embs],
            use_cache=True,
            fill_kv_cache=False,
            adarms_cond=[None, adarms_cond],
        )

        suffix_out = suffix_out[:, -self.config.n_action_steps :]
        v_t = self.action_out_proj(suffix_out)
        v_t = v_t.to(dtype=torch.float32)

        mse_loss = F.mse_loss(u_t, v_t, reduction="none")
        postfix_mask = torch.logical_not(prefix_mask)[:, :, None]
        if actions_is_pad is not None:
            in_episode_bound = (~actions_is_pad)[:, :, None]
            postfix_mask = torch.logical_and(postfix_mask, in_episode_bound)
        mse_loss = mse_loss * postfix_mask
        mse_loss = mse_loss[:, :, : self.config.max_action_dim]
        postfix_mask_expanded = postfix_mask.expand(-1, -1, mse_loss.shape[-1])
        mse_loss = mse_loss.sum() / (postfix_mask_expanded.sum() + 1e-8)

        # discrete action CE loss: the token before each discrete action predicts it
        discrete_token_start = -self.config.discrete_action_max_length
        logits = self.paligemma_with_expert.lm_head(prefix_out[:, discrete_token_start - 1 : -1])
        ce = F.cross_entropy(logits.transpose(1, 2), discrete_actions, reduction="none")
        ce_loss = (ce * discrete_action_masks).sum() / discrete_action_masks.sum()

        return {"MSE": mse_loss, "CE": ce_loss}


def main():
    torch.manual_seed(0)
    config = PI07LowLevelPlannerConfig()
    model = PI07LowLevelPlannerFlowMatching(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)

    bsize = 2
    # right-padded prompts of 6 and 4 tokens
    lang_tokens = torch.randint(30, config.vocab_size, (bsize, config.prompt_max_length))
    lang_masks = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    lang_tokens[~lang_masks] = 0
    state = torch.randn(bsize, config.max_action_dim)
    actions = torch.randn(bsize, config.chunk_size, config.max_action_dim)
    actions_is_pad = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)
    discrete_actions = torch.randint(1, config.discrete_action_vocab_size, (bsize, config.discrete_action_max_length))
    discrete_action_masks = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    discrete_actions[~discrete_action_masks] = 0
    noise = torch.randn(bsize, config.chunk_size, config.max_action_dim)
    time = torch.tensor([0.3, 0.7])

    with torch.no_grad():
        losses = model(
            lang_tokens, lang_masks, state, actions, actions_is_pad=actions_is_pad, noise=noise, time=time,
            discrete_actions=discrete_actions, discrete_action_masks=discrete_action_masks,
        )
    print(f"fixed={FIXED} MSE={losses['MSE'].item():.6f} CE={losses['CE'].item():.6f}")


if __name__ == "__main__":
    main()
