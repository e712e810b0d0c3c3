# parler-tts (huggingface/parler-tts commit e51113f, "fix fp16 training and attention mask in generation"):
# StableSpeechDecoder.forward merged prompt_attention_mask into the decoder mask only inside
# `if prompt_hidden_states is not None`; after the first generate step prompt_hidden_states is dropped (it lives in
# the KV cache), so every cached decode step ran with attention_mask=None and attended to the padded prompt tokens.
import sys
import math
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, H, L, V, NCB = 32, 4, 2, 48, 1
BOS = 47


# --- transformers.modeling_attn_mask_utils (AttentionMaskConverter, is_causal=True) as used by the decoder ---
def _make_causal_mask(input_ids_shape, dtype, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    key_value_length = input_shape[-1] + past_key_values_length
    dtype = inputs_embeds.dtype
    if attention_mask is not None:
        causal_4d_mask = None
        if input_shape[-1] > 1:
            causal_4d_mask = _make_causal_mask(input_shape, dtype, key_value_length - input_shape[-1])
        expanded = _expand_mask(attention_mask, dtype, tgt_len=input_shape[-1])
        if causal_4d_mask is not None:
            expanded = causal_4d_mask.masked_fill(expanded.bool(), torch.finfo(dtype).min)
        return expanded
    # to_causal_4d: only builds a mask when there is more than one query
    if input_shape[-1] > 1:
        return _make_causal_mask(input_shape, dtype, past_key_values_length)
    return None


class StableSpeechSinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, embedding_dim):
        super().__init__()
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.int64).float() * -emb)
        emb = torch.arange(num_positions, dtype=torch.int64).float().unsqueeze(1) * emb.unsqueeze(0)
        self.weights = nn.Parameter(torch.cat([torch.cos(emb), torch.sin(emb)], dim=1), requires_grad=False)

    @torch.no_grad()
    def forward(self, input_ids, past_key_values_length=0):
        bsz, seq_len, _ = input_ids.size()
        position_ids = torch.arange(seq_len) + past_key_values_length
        return self.weights.index_select(0, position_ids.view(-1)).detach()


class StableSpeechAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=False):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, past_key_value=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, tgt_len, src_len):
                raise ValueError(f"Attention mask should be of size {(bsz, 1, tgt_len, src_len)}")
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), past_key_value


class StableSpeechDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = StableSpeechAttention(D, H)
        self.self_attn_layer_norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D, bias=False)
        self.fc2 = nn.Linear(2 * D, D, bias=False)
        self.final_layer_norm = nn.LayerNorm(D)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states, present = self.self_attn(self.self_attn_layer_norm(hidden_states), past_key_value, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(nn.functional.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states, present


class StableSpeechDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_codebooks = NCB
        self.embed_tokens = nn.ModuleList([nn.Embedding(V, D) for _ in range(NCB)])
        self.embed_positions = StableSpeechSinusoidalPositionalEmbedding(128, D)
        self.layers = nn.ModuleList([StableSpeechDecoderLayer() for _ in range(L)])
        self.layer_norm = nn.LayerNorm(D)

    def forward(self, input_ids, attention_mask=None, prompt_hidden_states=None, prompt_attention_mask=None,
                past_key_values=None):
        input = input_ids.reshape(-1, self.num_codebooks, input_ids.shape[-1])
        bsz, num_codebooks, seq_len = input.shape
        input_shape = (bsz, seq_len)
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        inputs_embeds = sum([self.embed_tokens[codebook](input[:, codebook]) for codebook in range(num_codebooks)])

        if not FIXED:
            # if prompt_hidden_states, fuse to inputs_embeds and update input shape
            if prompt_hidden_states is not None:
                inputs_embeds = torch.cat([prompt_hidden_states, inputs_embeds], dim=1)
                if prompt_attention_mask is not None and attention_mask is not None:
                    attention_mask = torch.cat([prompt_attention_mask, attention_mask], dim=1)
                elif prompt_attention_mask is not None:
                    attention_mask = torch.cat(
                        [prompt_attention_mask, torch.ones(input_shape, dtype=prompt_attention_mask.dtype)], dim=1
                    )
        else:
            if prompt_hidden_states is not None:
                inputs_embeds = torch.cat([prompt_hidden_states, inputs_embeds], dim=1)
            # As it is, the masked ids from the prompt will still count in the positions embeddings
            if prompt_attention_mask is not None and attention_mask is not None:
                attention_mask = torch.cat([prompt_attention_mask, attention_mask], dim=1)
            elif prompt_attention_mask is not None:
                if past_key_values is None:
                    attention_mask = torch.cat(
                        [prompt_attention_mask, torch.ones(input_shape, dtype=prompt_attention_mask.dtype)], dim=1
                    )
                else:
                    generated_length = past_key_values_length - prompt_attention_mask.shape[1] + 1
                    attention_mask = torch.cat(
                        [prompt_attention_mask,
                         torch.ones((input_shape[0], generated_length), dtype=prompt_attention_mask.dtype)], dim=1
                    )

        input_shape = inputs_embeds.size()[:-1]
        attention_mask = _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length)
        positions = self.embed_positions(inputs_embeds, past_key_values_length)
        hidden_states = inputs_embeds + positions
        next_cache = ()
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(hidden_states, attention_mask=attention_mask, past_key_value=past_key_value)
            next_cache += (present,)
        return self.layer_norm(hidden_states), next_cache


class StableSpeechForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = StableSpeechDecoder()
        self.embed_prompts = nn.Embedding(30, D)
        self.lm_heads = nn.ModuleList([nn.Linear(D, V, bias=False) for _ in range(NCB)])

    def forward(self, input_ids, prompt_input_ids=None, prompt_hidden_states=None, prompt_attention_mask=None,
                past_key_values=None):
        if prompt_hidden_states is None and prompt_input_ids is not None:
            prompt_hidden_states = self.embed_prompts(prompt_input_ids)
        hidden, cache = self.decoder(input_ids, prompt_hidden_states=prompt_hidden_states,
                                     prompt_attention_mask=prompt_attention_mask, past_key_values=past_key_values)
        return torch.stack([head(hidden) for head in self.lm_heads], dim=1), cache

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, prompt_input_ids=None,
                                      prompt_attention_mask=None):
        if past_key_values is not None:
            input_ids = input_ids[:, -1:]
            # we only want to use prompt signal in the 1st generation step but keeping the attention mask
            prompt_input_ids = None
        return {"input_ids": input_ids, "past_key_values": past_key_values, "prompt_input_ids": prompt_input_ids,
                "prompt_attention_mask": prompt_attention_mask}


model = StableSpeechForCausalLM().eval()
# transcript prompts, the second one right-padded (pad id 0) to the batch length
prompt_input_ids = torch.tensor([[5, 9, 12, 3, 7, 21, 14, 2], [8, 2, 26, 0, 0, 0, 0, 0]])
prompt_attention_mask = torch.tensor([[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]])

input_ids = torch.full((2, 1), BOS)
past, max_diff = None, 0.0
with torch.no_grad():
    for step in range(8):
        inputs = model.prepare_inputs_for_generation(input_ids, past, prompt_input_ids, prompt_attention_mask)
        logits, past = model(**inputs)
        # reference: the same step recomputed without the KV cache (prompt and its mask passed in full)
        ref_logits, _ = model(input_ids, prompt_input_ids=prompt_input_ids, prompt_attention_mask=prompt_attention_mask)
        max_diff = max(max_diff, (logits[:, :, -1] - ref_logits[:, :, -1]).abs().max().item())
        next_tokens = logits[:, 0, -1].argmax(-1)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
print("generated codes:", input_ids[:, 1:].tolist())
print(f"max |cached decode logits - uncached logits| = {max_diff:.6f}")
