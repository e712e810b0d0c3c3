# parler-tts (huggingface/parler-tts#225): ParlerTTSForCausalLM.generate calls
# self._prepare_attention_mask_for_generation(...) but never stores the result in model_kwargs, so the
# decoder runs a left-padded batch of audio-code prompts with a causal-only mask and attends to the pad codes.
import sys
import math
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, H, L, V, NCB = 32, 4, 2, 40, 1
PAD, EOS, BOS = 38, 39, 37  # pad != eos, so generate can infer the padding mask from the pad codes


class ParlerTTSSinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, dim):
        super().__init__()
        half = dim // 2
        emb = math.log(10000) / (half - 1)
        emb = torch.exp(torch.arange(half, dtype=torch.float) * -emb)
        emb = torch.arange(num_positions, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        self.register_buffer("weights", torch.cat([torch.cos(emb), torch.sin(emb)], dim=1), persistent=False)

    def forward(self, input_ids, past_key_values_length=0):
        bsz, codebooks, seq_len = input_ids.size()
        position_ids = torch.arange(seq_len) + past_key_values_length
        return self.weights.index_select(0, position_ids.view(-1))


# transformers.modeling_attn_mask_utils (AttentionMaskConverter, is_causal=True) as used by the decoder
def _make_causal_mask(input_ids_shape, dtype, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, dtype, past_key_values_length):
    key_value_length = input_shape[-1] + past_key_values_length
    if attention_mask is not None:
        causal_4d_mask = None
        if input_shape[-1] > 1:
            causal_4d_mask = _make_causal_mask(input_shape, dtype, key_value_length - input_shape[-1])
        expanded = _expand_mask(attention_mask, dtype, tgt_len=input_shape[-1])
        if causal_4d_mask is not None:
            expanded = causal_4d_mask.masked_fill(expanded.bool(), torch.finfo(dtype).min)
        return expanded
    if input_shape[-1] > 1:  # to_causal_4d
        return _make_causal_mask(input_shape, dtype, past_key_values_length)
    return None


class ParlerTTSAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.h, self.hd = H, D // H
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, hidden_states, past_key_value=None, attention_mask=None):
        bsz, tgt, _ = hidden_states.shape
        sh = lambda x: x.view(bsz, -1, self.h, self.hd).transpose(1, 2)
        q = sh(self.q_proj(hidden_states)) * self.hd ** -0.5
        k, v = sh(self.k_proj(hidden_states)), sh(self.v_proj(hidden_states))
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        w = q @ k.transpose(-1, -2)
        if attention_mask is not None:
            w = w + attention_mask
        w = w.softmax(-1)
        out = (w @ v).transpose(1, 2).reshape(bsz, tgt, D)
        return self.out_proj(out), w, (k, v)


class ParlerTTSDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = ParlerTTSAttention()
        self.self_attn_layer_norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.final_layer_norm = nn.LayerNorm(D)

    def forward(self, x, attention_mask, past_key_value):
        a, w, present = self.self_attn(self.self_attn_layer_norm(x), past_key_value, attention_mask)
        x = x + a
        x = x + self.fc2(torch.relu(self.fc1(self.final_layer_norm(x))))
        return x, w, present


class ParlerTTSDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_codebooks = NCB
        self.embed_tokens = nn.ModuleList([nn.Embedding(V, D) for _ in range(NCB)])
        self.embed_positions = ParlerTTSSinusoidalPositionalEmbedding(64, D)
        self.layers = nn.ModuleList([ParlerTTSDecoderLayer() for _ in range(L)])
        self.layer_norm = nn.LayerNorm(D)

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        input = input_ids.reshape(-1, self.num_codebooks, input_ids.shape[-1])
        bsz, seq_len = input.shape[0], input.shape[-1]
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        inputs_embeds = sum(self.embed_tokens[cb](input[:, cb]) for cb in range(self.num_codebooks))
        # attention_mask None -> causal-only 4D mask (what the buggy generate ends up with)
        attention_mask = _prepare_4d_causal_attention_mask(attention_mask, (bsz, seq_len), inputs_embeds.dtype, past_len)
        hidden = inputs_embeds + self.embed_positions(input, past_len)
        presents, attns = [], []
        for i, layer in enumerate(self.layers):
            hidden, w, present = layer(hidden, attention_mask, past_key_values[i] if past_key_values else None)
            presents.append(present)
            attns.append(w)
        return self.layer_norm(hidden), presents, attns


class ParlerTTSForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.decoder = ParlerTTSDecoder()
        self.lm_heads = nn.ModuleList([nn.Linear(D, V, bias=False) for _ in range(NCB)])
        self.pad_token_id, self.eos_token_id = PAD, EOS

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        hidden, presents, attns = self.model.decoder(input_ids, attention_mask, past_key_values)
        lm_logits = torch.stack([head(hidden) for head in self.lm_heads], dim=1)
        return lm_logits, presents, attns

    @staticmethod
    def _prepare_attention_mask_for_generation(inputs, pad_token_id, eos_token_id):
        # transformers GenerationMixin: infer the mask from pad tokens when possible
        is_pad_in = pad_token_id is not None and bool((inputs == pad_token_id).any())
        pad_ne_eos = eos_token_id is None or pad_token_id != eos_token_id
        if inputs.dim() == 2 and is_pad_in and pad_ne_eos:
            return inputs.ne(pad_token_id).long()
        return torch.ones(inputs.shape[:2], dtype=torch.long)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, past_key_values=None):
        if past_key_values is not None:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values}

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens=6, **model_kwargs):
        requires_attention_mask = "encoder_outputs" not in model_kwargs
        if model_kwargs.get("attention_mask", None) is None and requires_attention_mask:
            if FIXED:
                model_kwargs["attention_mask"] = self._prepare_attention_mask_for_generation(
                    input_ids, self.pad_token_id, self.eos_token_id
                )
            else:
                self._prepare_attention_mask_for_generation(input_ids, self.pad_token_id, self.eos_token_id)
        past, all_logits, pad_mass = None, [], 0.0
        pad_cols = input_ids.eq(self.pad_token_id)
        while True:
            inputs = self.prepare_inputs_for_generation(input_ids, model_kwargs.get("attention_mask"), past)
            logits, past, attns = self(**inputs)
            q_real = ~pad_cols if inputs["past_key_values"] is None else torch.ones(pad_cols.shape[0], 1, dtype=torch.bool)
            for w in attns:  # attention mass that real (non-pad) queries put on the prompt's pad codes
                m = (w[..., : pad_cols.shape[1]] * pad_cols[:, None, None, :]).sum(-1) * q_real[:, None, :]
                pad_mass = max(pad_mass, m.max().item())
            next_logits = logits[:, :, -1, :].reshape(-1, V)
            all_logits.append(next_logits)
            next_tokens = next_logits.argmax(-1)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if model_kwargs.get("attention_mask") is not None:
                am = model_kwargs["attention_mask"]
                model_kwargs["attention_mask"] = torch.cat([am, am.new_ones((am.shape[0], 1))], dim=-1)
            if len(all_logits) == max_new_tokens:
                break
        return input_ids, torch.stack(all_logits, 1), pad_mass


model = ParlerTTSForCausalLM().eval()
# two audio-code prompts, the second left-padded with the decoder pad code
prompts = [[BOS, 5, 9, 12, 3, 7, 21, 14], [BOS, 8, 2, 30]]
T = max(map(len, prompts))
batch = torch.tensor([[PAD] * (T - len(p)) + p for p in prompts])

out, logits, pad_mass = model.generate(batch)
print("generated codes:", out[:, T:].tolist())
print(f"max attention weight on prompt pad codes: {pad_mass:.6f}")
