# huggingface/transformers#42508 ("Fix Qwen-VL family with prompt tuning"; follows
# huggingface/transformers#41173's discussion with PEFT).
#
# PEFT's prompt tuning (PeftModelForCausalLM.prepare_inputs_for_generation) prepends the learned
# virtual tokens as inputs_embeds on the first step, extends the attention mask with ones, and
# drops `position_ids` and `cache_position` from the model kwargs, expecting the model to rebuild
# them from the length of its KV cache. Qwen2-VL's Qwen2VLModel.forward computes the 3-D (M-RoPE)
# position ids itself: on prefill from get_rope_index (storing self.rope_deltas), on later steps
# as arange(seq_length) + (cache_position[0] + rope_deltas) -- and with cache_position None the
# delta is the integer 0, so every generated token is rotated at position 0.
# Fix (per the PR: "rely on cache length"): the decode delta is the cache's length plus rope_deltas.
#
# Ported from src/transformers/models/qwen2_vl/modeling_qwen2_vl.py (Qwen2VLModel.forward,
# get_rope_index text branch, Qwen2VLRotaryEmbedding, apply_multimodal_rotary_pos_emb) and
# peft src/peft/peft_model.py (PeftModelForCausalLM prompt-tuning generate path), text only,
# tiny sizes, random weights, a left-padded batch of two prompts, greedy decoding.
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = SimpleNamespace(
    vocab_size=64,
    hidden_size=32,
    num_attention_heads=4,
    num_hidden_layers=2,
    rope_theta=10000.0,
    rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
    pad_token_id=0,
)
peft_config = SimpleNamespace(peft_type="PROMPT_TUNING", num_virtual_tokens=4, token_dim=32)


class DynamicCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(
        unsqueeze_dim
    )
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(
        unsqueeze_dim
    )
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class Qwen2VLRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        # position_ids: (3, batch, seq)
        inv_freq_expanded = self.inv_freq[None, None, :, None].float().expand(3, position_ids.shape[1], -1, 1)
        position_ids_expanded = position_ids[:, :, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(2, 3)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Qwen2VLAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.rope_scaling = config.rope_scaling
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_embeddings, past_key_values):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_multimodal_rotary_pos_emb(
            query_states, key_states, cos, sin, self.rope_scaling["mrope_section"]
        )
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=attention_mask)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class Qwen2VLDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Qwen2VLAttention(config, layer_idx)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, 2 * config.hidden_size), nn.SiLU(), nn.Linear(2 * config.hidden_size, config.hidden_size)
        )
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_embeddings, past_key_values):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_embeddings, past_key_values)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Qwen2VLTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([Qwen2VLDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)
        self.rotary_emb = Qwen2VLRotaryEmbedding(config)

    def forward(self, inputs_embeds, attention_mask, position_ids, past_key_values):
        past_seen_tokens = past_key_values.get_seq_length()
        q_len = inputs_embeds.shape[1]
        kv_len = past_seen_tokens + q_len
        # causal + padding mask over the cached keys (bool, True = attend)
        q_idx = torch.arange(past_seen_tokens, kv_len)[:, None]
        kv_idx = torch.arange(kv_len)[None, :]
        causal_mask = (kv_idx <= q_idx)[None, None] & attention_mask[:, None, None, :kv_len].bool()
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_embeddings, past_key_values)
        return self.norm(hidden_states)


class Qwen2VLModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.language_model = Qwen2VLTextModel(config)
        self.rope_deltas = None  # cache rope_deltas here

    def get_input_embeddings(self):
        return self.language_model.embed_tokens

    def get_rope_index(self, input_ids=None, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
        # text-only branch (no image_grid_thw / video_grid_thw)
        if attention_mask is not None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1).to(attention_mask.device)
            max_position_ids = position_ids.max(0, keepdim=False)[0].max(-1, keepdim=True)[0]
            mrope_position_deltas = max_position_ids + 1 - attention_mask.shape[-1]
        else:
            position_ids = (
                torch.arange(input_ids.shape[1], device=input_ids.device)
                .view(1, 1, -1)
                .expand(3, input_ids.shape[0], -1)
            )
            mrope_position_deltas = torch.zeros([input_ids.shape[0], 1], dtype=input_ids.dtype)
        return position_ids, mrope_position_deltas

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        cache_position=None,
        image_grid_thw=None,
        video_grid_thw=None,
    ):
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)

        if position_ids is None:
            # Calculate RoPE index once per generation in the pre-fill stage only.
            prefill_noncompiled_stage = (cache_position is not None and cache_position[0] == 0) or (
                past_key_values is None or past_key_values.get_seq_length() == 0
            )
            if prefill_noncompiled_stage or self.rope_deltas is None:
                position_ids, rope_deltas = self.get_rope_index(
                    input_ids, image_grid_thw, video_grid_thw, attention_mask=attention_mask
                )
                self.rope_deltas = rope_deltas
            # then use the prev pre-calculated rope-deltas to get the correct position ids
            else:
                batch_size, seq_length, _ = inputs_embeds.shape
                if FIXED:
                    past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
                    delta = (past_seen_tokens + self.rope_deltas).to(inputs_embeds.device)
                else:
                    delta = (
                        (cache_position[0] + self.rope_deltas).to(inputs_embeds.device)
                        if cache_position is not None
                        else 0
                    )
                position_ids = torch.arange(seq_length, device=inputs_embeds.device)
                position_ids = position_ids.view(1, -1).expand(batch_size, -1)
                if FIXED or cache_position is not None:  # otherwise `deltas` is an int `0`
                    delta = delta.repeat_interleave(batch_size // delta.shape[0], dim=0)
                position_ids = position_ids.add(delta)
                position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)

        return self.language_model(inputs_embeds, attention_mask, position_ids, past_key_values)


class Qwen2VLForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Qwen2VLModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, **kwargs):
        return self.lm_head(self.model(**kwargs))


class PromptEmbedding(nn.Module):
    def __init__(self, config, word_embeddings):
        super().__init__()
        self.embedding = nn.Embedding(config.num_virtual_tokens, config.token_dim)
        # PromptTuningInit.RANDOM

    def forward(self, indices):
        return self.embedding(indices)


class PeftModelForCausalLM(nn.Module):
    def __init__(self, model, peft_config):
        super().__init__()
        self.base_model = model
        self.peft_config = peft_config
        self.word_embeddings = model.get_input_embeddings()
        self.prompt_encoder = PromptEmbedding(peft_config, self.word_embeddings)
        self.prompt_tokens = torch.arange(peft_config.num_virtual_tokens).long()

    def get_prompt(self, batch_size):
        prompt_tokens = self.prompt_tokens.unsqueeze(0).expand(batch_size, -1)
        return self.prompt_encoder(prompt_tokens)

    def prepare_inputs_for_generation(self, input_ids, attention_mask, past_key_values, cache_position):
        peft_config = self.peft_config
        model_kwargs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "cache_position": cache_position,
        }
        if past_key_values.get_seq_length() > 0:
            model_kwargs["input_ids"] = input_ids[:, -1:]
        # prompt learning: the positions are recomputed by the model from the (longer) cache
        if model_kwargs.get("position_ids", None) is not None:
            model_kwargs["position_ids"] = None
        model_kwargs["cache_position"] = None

        if model_kwargs.get("attention_mask", None) is not None:
            if past_key_values.get_seq_length() == 0:
                size = model_kwargs["input_ids"].shape[0], peft_config.num_virtual_tokens
                prefix_attention_mask = torch.ones(size).to(model_kwargs["input_ids"].device)
                model_kwargs["attention_mask"] = torch.cat(
                    (prefix_attention_mask, model_kwargs["attention_mask"]), dim=1
                ).long()
            else:
                # the mask carried over already holds the virtual tokens
                pass

        if past_key_values.get_seq_length() == 0:
            inputs_embeds = self.word_embeddings(model_kwargs["input_ids"])
            prompts = self.get_prompt(batch_size=model_kwargs["input_ids"].shape[0])
            prompts = prompts.to(inputs_embeds.dtype)
            model_kwargs["inputs_embeds"] = torch.cat((prompts, inputs_embeds), dim=1)
            model_kwargs["input_ids"] = None
        return model_kwargs

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens):
        past_key_values = DynamicCache()
        cache_position = torch.arange(input_ids.shape[1])
        generated = input_ids
        model_mask = None
        all_logits = []
        for _ in range(max_new_tokens):
            model_kwargs = self.prepare_inputs_for_generation(
                generated, attention_mask if model_mask is None else model_mask, past_key_values, cache_position
            )
            model_mask = model_kwargs["attention_mask"]
            logits = self.base_model(**model_kwargs)[:, -1, :]
            all_logits.append(logits)
            next_tokens = logits.argmax(-1)
            generated = torch.cat([generated, next_tokens[:, None]], dim=-1)
            model_mask = torch.cat([model_mask, model_mask.new_ones((model_mask.shape[0], 1))], dim=-1)
            cache_position = cache_position[-1:] + 1
        return generated, torch.stack(all_logits, 1)


def main():
    base = Qwen2VLForConditionalGeneration(config).eval()
    model = PeftModelForCausalLM(base, peft_config).eval()
    # tokenizer.padding_side = "left" for batched generation
    input_ids = torch.tensor(
        [
            [0, 0, 0, 11, 23, 35, 47, 9],
            [5, 17, 29, 41, 53, 8, 20, 32],
        ]
    )
    attention_mask = (input_ids != config.pad_token_id).long()
    generated, logits = model.generate(input_ids, attention_mask, max_new_tokens=8)
    print("generated:", generated[:, input_ids.shape[1]:].tolist())
    print("rope_deltas:", base.model.rope_deltas.view(-1).tolist())
    print("last-step logits sum: %.6f" % logits[:, -1].sum().item())


if __name__ == "__main__":
    main()
