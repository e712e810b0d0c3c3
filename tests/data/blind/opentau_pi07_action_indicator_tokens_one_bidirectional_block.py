# TensorAuto/OpenTau#229 (merged; "fix(pi07): gate optional prefix tokens in low- and high-level planners"):
# PI07LowLevelPlannerFlowMatching.embed_prefix gave the "Action: " indicator tokens that open the discrete
# (FAST) action span att_masks [1] + [0] * (N - 1), so after make_att_2d_masks' cumsum the N indicator
# tokens form one bidirectional block: the first indicator tokens see the later ones, and the discrete-action
# CE loss read off the VLM prefix changes. Fix: att_masks += [1] * N, each indicator token its own causal
# block like the rest of the text. Ported trimmed: Gemma 3 text backbone stream only (no video encoder, no
# action expert / flow-matching branch), the tokenizer a word-piece stand-in.
import re
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Gemma3TextConfig, Gemma3TextModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _preferred_dtype():
    return torch.float32


def make_att_2d_masks(pad_masks, att_masks, n_cross_att_tokens=None, cross_att_pad_masks=None):
    """Creates a 2-D attention mask given padding and 1-D attention masks.

    Args:
        pad_masks: bool[B, N] true if its part of the input, false if padding.
        att_masks: int32[B, N] mask that's 1 where previous tokens cannot depend on
            it and 0 where it shares the same attention mask as the previous token.
    """
    if att_masks.ndim != 2:
        raise ValueError(att_masks.ndim)
    if pad_masks.ndim != 2:
        raise ValueError(pad_masks.ndim)

    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    att_2d_masks = att_2d_masks & pad_2d_masks
    return att_2d_masks


def apply_rope(x, positions, max_wavelength=10_000.0):
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


class WordPieceTokenizer:
    """Stand-in for the Gemma 3 tokenizer: words and punctuation/space pieces hashed into the vocab."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def encode(self, text, add_special_tokens=False):
        pieces = re.findall(r"\w+|[^\w]", text)
        return [3 + sum(ord(c) * 31**i for i, c in enumerate(p)) % (self.vocab_size - 3) for p in pieces]


class Gemma3WithExpert(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self._text_config = config.gemma3_config
        self.gemma3 = Gemma3TextModel(self._text_config)
        text_hidden = self._text_config.hidden_size
        self.discrete_action_embedding = nn.Embedding(
            num_embeddings=config.discrete_action_vocab_size,
            embedding_dim=text_hidden,
            padding_idx=0,
        )
        self.da_head = nn.Linear(in_features=text_hidden, out_features=config.discrete_action_vocab_size)
        self.dropout = nn.Dropout(config.dropout)
        self._head_dim = self._text_config.head_dim
        self._num_layers = self._text_config.num_hidden_layers
        self._layer_types = self._text_config.layer_types
        rope = self._text_config.rope_parameters
        self._rope_global = float(rope["full_attention"]["rope_theta"])
        self._rope_local = float(rope["sliding_attention"]["rope_theta"])
        self._query_pre_attn_scaling = float(self._text_config.query_pre_attn_scalar) ** -0.5

    def embed_language_tokens(self, tokens):
        return self.gemma3.embed_tokens(tokens)

    def embed_discrete_actions(self, actions):
        if actions.dtype != torch.long:
            actions = actions.long()
        return self.discrete_action_embedding(actions)

    def eager_attention_forward(self, attention_mask, batch_size, head_dim, query_states, key_states,
                                value_states, scaling=None):
        """Standard eager scaled-dot-product attention. `attention_mask` is a
        boolean 2D mask of shape `(B, Q, K)` (True = attend)."""
        num_att_heads = self._text_config.num_attention_heads
        num_key_value_heads = self._text_config.num_key_value_heads
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
        att_weights *= scaling if scaling is not None else head_dim**-0.5
        big_neg = -2.3819763e38

        masked_att_weights = torch.where(attention_mask[:, None, :, :], att_weights, big_neg)

        probs = nn.functional.softmax(masked_att_weights, dim=-1)
        probs = probs.to(dtype=value_states.dtype)

        att_output = torch.matmul(probs, value_states.permute(0, 2, 1, 3))
        att_output = att_output.permute(0, 2, 1, 3)
        att_output = att_output.reshape(batch_size, -1, num_key_value_heads * num_key_value_groups * head_dim)
        return att_output

    def forward(self, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                n_cross_att_tokens=None, use_cache=None, fill_kv_cache=None):
        # backbone stream only (inputs_embeds = [prefix_embs, None])
        hidden_states = inputs_embeds[0]
        batch_size = hidden_states.shape[0]
        head_dim = self._head_dim
        if fill_kv_cache and past_key_values is None:
            past_key_values = {}
        for layer_idx in range(self._num_layers):
            layer = self.gemma3.layers[layer_idx]
            is_sliding = self._layer_types[layer_idx] == "sliding_attention"
            layer_rope_theta = self._rope_local if is_sliding else self._rope_global

            backbone_preattn_residual = hidden_states
            h = layer.input_layernorm(hidden_states)
            bsize, seq_len, _ = h.shape
            q = layer.self_attn.q_proj(h).view(bsize, seq_len, -1, head_dim)
            k = layer.self_attn.k_proj(h).view(bsize, seq_len, -1, head_dim)
            v = layer.self_attn.v_proj(h).view(bsize, seq_len, -1, head_dim)
            q = layer.self_attn.q_norm(q)
            k = layer.self_attn.k_norm(k)
            q = apply_rope(q, position_ids, max_wavelength=layer_rope_theta)
            k = apply_rope(k, position_ids, max_wavelength=layer_rope_theta)

            if fill_kv_cache:
                past_key_values[layer_idx] = {
                    "key_states": k[:, :n_cross_att_tokens, :, :],
                    "value_states": v[:, :n_cross_att_tokens, :, :],
                }

            att_output = self.eager_attention_forward(
                attention_mask, batch_size, head_dim, q, k, v, scaling=self._query_pre_attn_scaling
            )
            part = layer.self_attn.o_proj(att_output)
            part = self.dropout(part)

            post_attn = layer.post_attention_layernorm(part)
            h = backbone_preattn_residual + post_attn
            ff_residual = h
            h = layer.pre_feedforward_layernorm(h)
            h = layer.mlp(h)
            h = self.dropout(h)
            h = layer.post_feedforward_layernorm(h)
            hidden_states = ff_residual + h

        return [self.gemma3.norm(hidden_states), None], past_key_values


class PI07LowLevelPlannerFlowMatching(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gemma3_with_expert = Gemma3WithExpert(config)
        self.language_tokenizer = WordPieceTokenizer(config.gemma3_config.vocab_size)
        hidden = config.gemma3_config.hidden_size
        self.video_proj = nn.Linear(config.video_feature_dim, hidden)
        self.state_proj = nn.Linear(config.max_state_dim, hidden)
        self._action_indicator_len = len(self.language_tokenizer.encode("Action: ", add_special_tokens=False))

    def embed_video(self, vid):
        return self.video_proj(vid)

    def embed_prefix(self, videos, vid_masks, lang_tokens, lang_masks, state, discrete_actions=None,
                     discrete_action_masks=None, obs_history_is_pad=None):
        embs = []
        pad_masks = []
        att_masks = []
        bsize = lang_tokens.shape[0]

        for vid, vid_mask in zip(videos, vid_masks, strict=True):
            vid_emb = self.embed_video(vid)  # (B, num_video_tokens, vlm_hidden)
            vid_emb = vid_emb.to(dtype=_preferred_dtype())

            num_vid_embs = vid_emb.shape[1]
            vid_mask_expanded = vid_mask[:, None].expand(bsize, num_vid_embs)

            embs.append(vid_emb)
            pad_masks.append(vid_mask_expanded)

            att_masks += [0] * num_vid_embs

        lang_emb = self.gemma3_with_expert.embed_language_tokens(lang_tokens)

        embs.append(lang_emb)
        pad_masks.append(lang_masks)

        num_lang_embs = lang_emb.shape[1]
        att_masks += [1] * num_lang_embs

        state_start_indicator_ids = self.language_tokenizer.encode("State: ", add_special_tokens=False)
        state_start_tokens = torch.tensor(
            [state_start_indicator_ids] * bsize,
            device=lang_tokens.device,
            dtype=torch.long,
        )
        state_start_emb = self.gemma3_with_expert.embed_language_tokens(state_start_tokens)

        num_state_start_embs = state_start_emb.shape[1]
        state_start_mask = torch.ones(bsize, num_state_start_embs, dtype=torch.bool, device=lang_tokens.device)

        embs.append(state_start_emb)
        pad_masks.append(state_start_mask)
        att_masks += [1] * num_state_start_embs

        state_emb = self.state_proj(state.to(dtype=_preferred_dtype()))
        num_state_tokens = state_emb.shape[1]  # T
        if obs_history_is_pad is not None:
            state_mask = ~obs_history_is_pad  # True = real, False = padded
        else:
            state_mask = torch.ones(bsize, num_state_tokens, dtype=torch.bool, device=state.device)

        embs.append(state_emb)
        pad_masks.append(state_mask)
        att_masks += [1] + [0] * (num_state_tokens - 1)

        state_end_indicator_ids = self.language_tokenizer.encode(":\n", add_special_tokens=False)
        state_end_tokens = torch.tensor(
            [state_end_indicator_ids] * bsize,
            device=lang_tokens.device,
            dtype=torch.long,
        )
        state_end_emb = self.gemma3_with_expert.embed_language_tokens(state_end_tokens)
        num_state_end_embs = state_end_emb.shape[1]
        state_end_mask = torch.ones(bsize, num_state_end_embs, dtype=torch.bool, device=lang_tokens.device)
        embs.append(state_end_emb)
        pad_masks.append(state_end_mask)
        att_masks += [1] * num_state_end_embs

        if discrete_actions is not None:
            discrete_action_start_indicator_ids = self.language_tokenizer.encode(
                "Action: ", add_special_tokens=False
            )
            discrete_action_start_tokens = torch.tensor(
                [discrete_action_start_indicator_ids] * bsize,
                device=lang_tokens.device,
                dtype=torch.long,
            )
            discrete_action_start_emb = self.gemma3_with_expert.embed_language_tokens(
                discrete_action_start_tokens
            )

            num_discrete_action_start_embs = discrete_action_start_emb.shape[1]
            discrete_action_start_mask = torch.ones(
                bsize, num_discrete_action_start_embs, dtype=torch.bool, device=lang_tokens.device
            )

            embs.append(discrete_action_start_emb)
            pad_masks.append(discrete_action_start_mask)
            if FIXED:
                att_masks += [1] * num_discrete_action_start_embs
            else:
                att_masks += [1] + [0] * (num_discrete_action_start_embs - 1)

            discrete_action_emb = self.gemma3_with_expert.embed_discrete_actions(discrete_actions)
            embs.append(discrete_action_emb.to(dtype=_preferred_dtype()))
            pad_masks.append(discrete_action_masks)
            att_masks += [1] * discrete_action_emb.shape[1]

        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=torch.bool, device=pad_masks.device)
        att_masks = att_masks[None, :].expand(bsize, len(att_masks))

        return embs, pad_masks, att_masks

    def forward(self, videos, vid_masks, lang_tokens, lang_masks, state, discrete_actions,
                discrete_action_masks, obs_history_is_pad=None):
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(
            videos,
            vid_masks,
            lang_tokens,
            lang_masks,
            state,
            discrete_actions=discrete_actions,
            discrete_action_masks=discrete_action_masks,
            obs_history_is_pad=obs_history_is_pad,
        )

        vlm_2d_attention_mask = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
        vlm_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1

        num_cross_att_tokens = (
            prefix_embs.shape[1] - self._action_indicator_len - self.config.discrete_action_max_length
        )

        (prefix_out, _), past_key_values = self.gemma3_with_expert.forward(
            attention_mask=vlm_2d_attention_mask,
            position_ids=vlm_position_ids,
            past_key_values=None,
            inputs_embeds=[prefix_embs, None],
            n_cross_att_tokens=num_cross_att_tokens,
            use_cache=False,
            fill_kv_cache=True,
        )
        # (the action expert's flow-matching MSE over the cached prefix runs here)

        batch_size, seq_len = discrete_actions.shape
        discrete_token_start = -self.config.discrete_action_max_length
        discrete_action_slice_object = slice(discrete_token_start - 1, -1)
        discrete_action_out = prefix_out[:, discrete_action_slice_object]
        logits = self.gemma3_with_expert.da_head(discrete_action_out)

        logits = logits.to(dtype=torch.float32)
        logits = logits.reshape(-1, logits.shape[-1])  # "b s d -> (b s) d"
        labels = discrete_actions.reshape(-1)  # "b s -> (b s)"
        discrete_action_ce_loss = F.cross_entropy(logits, labels, reduction="none")

        discrete_action_ce_loss = discrete_action_ce_loss.reshape(batch_size, seq_len)  # "(b s) -> b s"
        discrete_action_ce_loss = (discrete_action_ce_loss * discrete_action_masks).sum() / (
            discrete_action_masks.sum() + 1e-8
        )
        return {"CE": discrete_action_ce_loss}


config = SimpleNamespace(
    gemma3_config=Gemma3TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=512,
    ),
    discrete_action_vocab_size=40,
    discrete_action_max_length=6,
    max_state_dim=8,
    video_feature_dim=12,
    dropout=0.0,
)
policy = PI07LowLevelPlannerFlowMatching(config).eval()

B, prompt_max_length, n_vid, T = 2, 7, 5, 3
videos = [torch.randn(B, n_vid, config.video_feature_dim)]
vid_masks = [torch.ones(B, dtype=torch.bool)]
lang_tokens = torch.randint(3, config.gemma3_config.vocab_size, (B, prompt_max_length))
lang_masks = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
lang_tokens = lang_tokens.masked_fill(~lang_masks, 0)
state = torch.randn(B, T, config.max_state_dim)
obs_history_is_pad = torch.tensor([[False, False, False], [True, False, False]])
discrete_actions = torch.randint(1, config.discrete_action_vocab_size, (B, config.discrete_action_max_length))
discrete_action_masks = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
discrete_actions = discrete_actions.masked_fill(~discrete_action_masks, 0)

with torch.no_grad():
    losses = policy(videos, vid_masks, lang_tokens, lang_masks, state, discrete_actions, discrete_action_masks,
                    obs_history_is_pad=obs_history_is_pad)
print("discrete-action CE:", round(losses["CE"].item(), 6))
