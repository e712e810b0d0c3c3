"""OpenTau π0.6: language tokens continue the bidirectional image block (TensorAuto/OpenTau#235).

Citation: TensorAuto/OpenTau PR #235 "fix(pi06): align with π0.6 model card paper", merged as commit
d92085d. Read in the upstream git history: `PI06FlowMatching.embed_prefix` in
src/opentau/policies/pi06/modeling_pi06.py before and after d92085d, `make_att_2d_masks` in the same file and
`Gemma3WithExpertModel.eager_attention_forward` / `forward` in gemma3_with_expert.py.

Bug: the π0.6 model card (§2) keeps bidirectional attention among image tokens but uses *causal* attention among
the text tokens. `embed_prefix` appended the language tokens with `att_masks += [0] * num_lang_embs`, i.e. they
continued the image block, so every prompt token saw every later prompt token and the image tokens saw the whole
prompt as well.

Fix: `att_masks += [1] * num_lang_embs` -- one new block per language token (causal among the text, each still
seeing the image prefix). Response and discrete-action (FAST) blocks were already `[1] * N`.

This program: a small PI06Config, the pi06 prefix/suffix embedding with the 1-D `att_masks` block pattern and
`make_att_2d_masks` (cumsum), and a two-layer backbone + action-expert stack that concatenates both streams' Q/K/V
and runs the project's eager attention (`torch.where(mask, scores, big_neg)` then softmax). The training forward
runs the prefix (two cameras, right-padded prompt, FAST tokens) filling the KV cache, then the action expert over
the cached prefix. The printed MSE differs between the buggy and the fixed prefix mask.
"""

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv


@dataclass
class PI06Config:
    chunk_size: int = 4
    n_action_steps: int = 4
    max_action_dim: int = 6
    max_delay: int = 0
    proj_width: int = 24
    discrete_action_max_length: int = 3
    discrete_action_vocab_size: int = 16
    vocab_size: int = 32
    hidden_size: int = 32
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 8
    num_hidden_layers: int = 2
    patch_dim: int = 12
    attention_implementation: str = "eager"


def create_sinusoidal_pos_embedding(time: Tensor, dimension: int, min_period: float, max_period: float) -> Tensor:
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    scaling_factor = 1.0 / period * 2 * math.pi
    sin_input = scaling_factor[None, None, :] * time[..., None].to(torch.float64)
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=-1).float()


def make_att_2d_masks(pad_masks, att_masks, n_cross_att_tokens=None, cross_att_pad_masks=None):
    """Tokens attend to valid tokens whose cumulative `att_masks` is <= theirs (1 opens a block, 0 continues)."""
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    att_2d_masks = att_2d_masks & pad_2d_masks
    if n_cross_att_tokens is not None:
        cross_att_mask = torch.full(
            (att_masks.size(0), att_masks.size(1), n_cross_att_tokens), True, dtype=torch.bool
        )
        cross_att_mask = cross_att_mask & pad_masks[:, :, None] & cross_att_pad_masks[:, None, :]
        att_2d_masks = torch.cat((cross_att_mask, att_2d_masks), dim=2)
    return att_2d_masks


def apply_rope(x: Tensor, positions: Tensor, max_wavelength: float = 10_000.0) -> Tensor:
    d_half = x.shape[-1] // 2
    freq_exponents = (2.0 / x.shape[-1]) * torch.arange(d_half, dtype=torch.float32)
    timescale = max_wavelength**freq_exponents
    radians = positions[..., None].float() / timescale[None, None, :]
    radians = radians[..., None, :]
    sin, cos = torch.sin(radians), torch.cos(radians)
    x1, x2 = x.split(d_half, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Layer(nn.Module):
    def __init__(self, width, cfg):
        super().__init__()
        hd = cfg.head_dim
        self.input_layernorm = nn.LayerNorm(width)
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, width, bias=False)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


class Gemma3WithExpertModel(nn.Module):
    def __init__(self, cfg: PI06Config):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_fast = nn.Embedding(cfg.discrete_action_vocab_size, cfg.hidden_size)
        self.vision_proj = nn.Linear(cfg.patch_dim, cfg.hidden_size)
        self.backbone_layers = nn.ModuleList(Layer(cfg.hidden_size, cfg) for _ in range(cfg.num_hidden_layers))
        self.expert_layers = nn.ModuleList(Layer(cfg.proj_width, cfg) for _ in range(cfg.num_hidden_layers))

    def embed_image(self, image: Tensor) -> Tensor:
        return self.vision_proj(image)

    def embed_language_tokens(self, tokens: Tensor) -> Tensor:
        return self.embed_tokens(tokens) * math.sqrt(self.config.hidden_size)

    def embed_discrete_actions(self, actions: Tensor) -> Tensor:
        return self.embed_fast(actions)

    def eager_attention_forward(self, attention_mask, batch_size, head_dim, query_states, key_states, value_states):
        """`attention_mask` is a boolean `(B, Q, K)` mask (True = attend)."""
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        key_states = key_states.repeat_interleave(groups, dim=2).transpose(1, 2)
        value_states = value_states.repeat_interleave(groups, dim=2).transpose(1, 2)
        query_states = query_states.transpose(1, 2)
        att_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * head_dim**-0.5
        big_neg = -2.3819763e38
        masked_att_weights = torch.where(attention_mask[:, None, :, :], att_weights, big_neg)
        probs = F.softmax(masked_att_weights, dim=-1)
        att_output = torch.matmul(probs, value_states).transpose(1, 2)
        return att_output.reshape(batch_size, -1, self.config.num_attention_heads * head_dim)

    def forward(self, attention_mask, position_ids, past_key_values, inputs_embeds, n_cross_att_tokens=None,
                use_cache=False, fill_kv_cache=False):
        hd = self.config.head_dim
        batch_size = next(h for h in inputs_embeds if h is not None).shape[0]
        for layer_idx in range(self.config.num_hidden_layers):
            layers = [self.backbone_layers[layer_idx], self.expert_layers[layer_idx]]
            qs, ks, vs = [], [], []
            for stream_idx, hidden in enumerate(inputs_embeds):
                if hidden is None:
                    continue
                layer = layers[stream_idx]
                h = layer.input_layernorm(hidden)
                b, n, _ = h.shape
                qs.append(apply_rope(layer.q_proj(h).view(b, n, -1, hd), position_ids))
                ks.append(apply_rope(layer.k_proj(h).view(b, n, -1, hd), position_ids))
                vs.append(layer.v_proj(h).view(b, n, -1, hd))
            q, k, v = torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1)
            if use_cache and past_key_values is not None and layer_idx in past_key_values:
                k = torch.cat([past_key_values[layer_idx]["key_states"], k], dim=1)
                v = torch.cat([past_key_values[layer_idx]["value_states"], v], dim=1)
            if fill_kv_cache:
                if past_key_values is None:
                    past_key_values = {}
                past_key_values[layer_idx] = {
                    "key_states": k[:, :n_cross_att_tokens],
                    "value_states": v[:, :n_cross_att_tokens],
                }
            att_output = self.eager_attention_forward(attention_mask, batch_size, hd, q, k, v)
            start, new_embeds = 0, []
            for stream_idx, hidden in enumerate(inputs_embeds):
                if hidden is None:
                    new_embeds.append(None)
                    continue
                layer = layers[stream_idx]
                n = hidden.shape[1]
                out = hidden + layer.o_proj(att_output[:, start:start + n])
                new_embeds.append(out + layer.mlp(out))
                start += n
            inputs_embeds = new_embeds
        return inputs_embeds, past_key_values


class PI06FlowMatching(nn.Module):
    def __init__(self, config: PI06Config):
        super().__init__()
        self.config = config
        self.gemma3_with_expert = Gemma3WithExpertModel(config)
        self.action_in_proj = nn.Linear(config.max_action_dim, config.proj_width)
        self.action_out_proj = nn.Linear(config.proj_width, config.max_action_dim)
        self.time_mlp_in = nn.Linear(config.proj_width, config.proj_width)
        self.time_mlp_out = nn.Linear(config.proj_width, config.proj_width)

    def embed_prefix(self, images, img_masks, lang_tokens, lang_masks, discrete_actions=None,
                     discrete_action_masks=None):
        embs, pad_masks, att_masks = [], [], []
        bsize = None
        for img, img_mask in zip(images, img_masks):
            img_emb = self.gemma3_with_expert.embed_image(img)
            bsize, num_img_embs = img_emb.shape[:2]
            embs.append(img_emb)
            pad_masks.append(img_mask[:, None].expand(bsize, num_img_embs))
            # Image tokens share a bidirectional block.
            att_masks += [0] * num_img_embs

        lang_emb = self.gemma3_with_expert.embed_language_tokens(lang_tokens)
        embs.append(lang_emb)
        pad_masks.append(lang_masks)
        num_lang_embs = lang_emb.shape[1]
        if FIXED:
            # π0.6 model card §2: "use causal attention among the text tokens".
            att_masks += [1] * num_lang_embs
        else:
            # Language tokens continue the image block (bidirectional within prefix).
            att_masks += [0] * num_lang_embs

        if discrete_actions is not None:
            discrete_action_emb = self.gemma3_with_expert.embed_discrete_actions(discrete_actions)
            embs.append(discrete_action_emb)
            pad_masks.append(discrete_action_masks)
            # Discrete action tokens start another causal block.
            att_masks += [1] * discrete_action_emb.shape[1]

        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=torch.bool)
        att_masks = att_masks[None, :].expand(bsize, len(att_masks))
        return embs, pad_masks, att_masks

    def embed_suffix(self, noisy_actions, timestep):
        bsize = noisy_actions.shape[0]
        time_emb = create_sinusoidal_pos_embedding(timestep, self.config.proj_width, min_period=4e-3, max_period=4.0)
        action_emb = self.action_in_proj(noisy_actions)
        adarms_cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time_emb))))
        embs = action_emb + adarms_cond
        pad_masks = torch.ones(bsize, action_emb.shape[1], dtype=torch.bool)
        # The leading 1 breaks the prefix-to-suffix boundary; the 0s keep the action chunk bidirectional.
        att_masks = [1] + ([0] * (self.config.n_action_steps - 1))
        att_masks = torch.tensor(att_masks, dtype=torch.bool)[None, :].expand(bsize, len(att_masks))
        return embs, pad_masks, att_masks

    def forward(self, images, img_masks, lang_tokens, lang_masks, actions, noise, time, discrete_actions,
                discrete_action_masks):
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(
            images, img_masks, lang_tokens, lang_masks, discrete_actions, discrete_action_masks
        )
        vlm_2d_attention_mask = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
        vlm_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1
        # The continuous action expert must not cross-attend to the discrete action tokens.
        num_cross_att_tokens = prefix_embs.shape[1] - self.config.discrete_action_max_length
        _, past_key_values = self.gemma3_with_expert.forward(
            attention_mask=vlm_2d_attention_mask,
            position_ids=vlm_position_ids,
            past_key_values=None,
            inputs_embeds=[prefix_embs, None],
            n_cross_att_tokens=num_cross_att_tokens,
            use_cache=False,
            fill_kv_cache=True,
        )

        time = time[:, None].expand(-1, self.config.chunk_size)
        x_t = time[..., None] * noise + (1 - time[..., None]) * actions
        u_t = noise - actions
        suffix_embs, suffix_pad_masks, suffix_att_masks = self.embed_suffix(x_t, time)
        action_expert_2d_attention_mask = make_att_2d_masks(
            suffix_pad_masks,
            suffix_att_masks,
            n_cross_att_tokens=num_cross_att_tokens,
            cross_att_pad_masks=prefix_pad_masks[:, :num_cross_att_tokens],
        )
        prefix_offsets = torch.sum(prefix_pad_masks[:, : -self.config.discrete_action_max_length], dim=-1)[:, None]
        action_expert_position_ids = prefix_offsets + torch.cumsum(suffix_pad_masks, dim=1) - 1
        (_, suffix_out), _ = self.gemma3_with_expert.forward(
            attention_mask=action_expert_2d_attention_mask,
            position_ids=action_expert_position_ids,
            past_key_values=past_key_values,
            inputs_embeds=[None, suffix_embs],
            use_cache=True,
            fill_kv_cache=False,
        )
        v_t = self.action_out_proj(suffix_out[:, -self.config.n_action_steps:])
        return F.mse_loss(u_t, v_t)


def main():
    torch.manual_seed(0)
    cfg = PI06Config()
    model = PI06FlowMatching(cfg).eval()
    bsize = 2
    images = [torch.randn(bsize, 4, cfg.patch_dim), torch.randn(bsize, 4, cfg.patch_dim)]  # two cameras, 4 patches
    img_masks = [torch.ones(bsize, dtype=torch.bool), torch.tensor([True, False])]  # row 1: empty wrist camera
    lang_tokens = torch.randint(1, cfg.vocab_size, (bsize, 6))
    lang_masks = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)  # right-padded prompt
    lang_tokens[~lang_masks] = 0
    discrete_actions = torch.randint(0, cfg.discrete_action_vocab_size, (bsize, cfg.discrete_action_max_length))
    discrete_action_masks = torch.ones(bsize, cfg.discrete_action_max_length, dtype=torch.bool)
    actions = torch.randn(bsize, cfg.chunk_size, cfg.max_action_dim)
    noise = torch.randn_like(actions)
    time = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        loss = model(images, img_masks, lang_tokens, lang_masks, actions, noise, time, discrete_actions,
                     discrete_action_masks)
    print(f"flow-matching MSE: {loss.item():.5f}")


if __name__ == "__main__":
    main()
