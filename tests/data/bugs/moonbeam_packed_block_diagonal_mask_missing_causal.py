# guozixunnicolas/Moonbeam-MIDI-Foundation-Model commit a7d3f9f ("add causal mask (to given block diagonal masks)")
# Moonbeam (a MIDI foundation model, Llama with per-attribute RoPE) trains on packed chunks whose 2-D attention_mask
# holds each note's sample index. LlamaModel._update_causal_mask turned it into a same-sample block-diagonal mask but
# never intersected it with a causal mask, so every note attended to all later notes of its own piece during training.
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class LlamaConfig:
    hidden_size: int = 96
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 6
    num_key_value_heads: int = 6
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    rope_theta_onset: float = 199999
    rope_theta_dur: float = 1031
    rope_theta_octave: float = 19
    rope_theta_pitch: float = 20
    rope_theta_velocity: float = 131
    sos_token: int = -1
    eos_token: int = -2
    decode_vocab_size: int = 64
    onset_embedding: dict = field(default_factory=lambda: {"method": "FME", "base": 199999})
    dur_embedding: dict = field(default_factory=lambda: {"method": "FME", "base": 1031})
    octave_embedding: dict = field(default_factory=lambda: {"method": "FME", "base": 19})
    pitch_embedding: dict = field(default_factory=lambda: {"method": "FME", "base": 20})
    instrument_embedding: dict = field(default_factory=lambda: {"method": "FME", "base": 131})
    velocity_embedding: dict = field(default_factory=lambda: {"method": "FME", "base": 131})


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None, scaling_factor=1.0):
        super().__init__()
        self.scaling_factor = scaling_factor
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float().to(device) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos()
        sin = emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.mlp_bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaSdpaAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attention_dropout = config.attention_dropout
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=config.attention_bias)
        self.rotary_emb_onset = LlamaRotaryEmbedding(self.head_dim, self.max_position_embeddings, base=config.rope_theta_onset)
        self.rotary_emb_dur = LlamaRotaryEmbedding(self.head_dim, self.max_position_embeddings, base=config.rope_theta_dur)
        self.rotary_emb_octave = LlamaRotaryEmbedding(self.head_dim, self.max_position_embeddings, base=config.rope_theta_octave)
        self.rotary_emb_pitch = LlamaRotaryEmbedding(self.head_dim, self.max_position_embeddings, base=config.rope_theta_pitch)
        self.rotary_emb_velocity = LlamaRotaryEmbedding(self.head_dim, self.max_position_embeddings, base=config.rope_theta_velocity)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cache_position=None):
        bsz, q_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        where_sos = (position_ids[..., 0] == self.config.sos_token).unsqueeze(-1)
        where_eos = (position_ids[..., 0] == self.config.eos_token).unsqueeze(-1)
        position_ids_sos = torch.where(where_sos, torch.tensor([0 for _ in range(6)]).to(hidden_states.device), position_ids)
        position_ids_eos = torch.where(where_eos, torch.tensor([2**15 for _ in range(6)]).to(hidden_states.device), position_ids_sos)
        position_ids = position_ids_eos

        cos_onset, sin_onset = self.rotary_emb_onset(value_states, position_ids[:, :, 0])
        cos_dur, sin_dur = self.rotary_emb_dur(value_states, position_ids[:, :, 1])
        cos_octave, sin_octave = self.rotary_emb_octave(value_states, position_ids[:, :, 2])
        cos_pitch, sin_pitch = self.rotary_emb_pitch(value_states, position_ids[:, :, 3])
        cos_velocity, sin_velocity = self.rotary_emb_velocity(value_states, position_ids[:, :, 5])

        query_states_split = query_states.view(bsz, 6, -1, q_len, self.head_dim)
        key_states_split = key_states.view(bsz, 6, -1, q_len, self.head_dim)

        query_states_onset, key_states_onset = apply_rotary_pos_emb(query_states_split[:,0,:,:,:], key_states_split[:,0,:,:,:], cos_onset, sin_onset)
        query_states_dur, key_states_dur = apply_rotary_pos_emb(query_states_split[:,1,:,:,:], key_states_split[:,1,:,:,:], cos_dur, sin_dur)
        query_states_octave, key_states_octave = apply_rotary_pos_emb(query_states_split[:,2,:,:,:], key_states_split[:,2,:,:,:], cos_octave, sin_octave)
        query_states_pitch, key_states_pitch = apply_rotary_pos_emb(query_states_split[:,3,:,:,:], key_states_split[:,3,:,:,:], cos_pitch, sin_pitch)
        query_states_instr, key_states_instr = apply_rotary_pos_emb(query_states_split[:,4,:,:,:], key_states_split[:,4,:,:,:], cos_onset, sin_onset)
        query_states_velocity, key_states_velocity = apply_rotary_pos_emb(query_states_split[:,5,:,:,:], key_states_split[:,5,:,:,:], cos_velocity, sin_velocity)

        query_states = torch.cat((query_states_onset, query_states_dur, query_states_octave, query_states_pitch, query_states_instr, query_states_velocity), dim=1)
        key_states = torch.cat((key_states_onset, key_states_dur, key_states_octave, key_states_pitch, key_states_instr, key_states_velocity), dim=1)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = causal_mask[:, :, :, : key_states.shape[-2]]

        is_causal = True if causal_mask is None and q_len > 1 else False
        attn_output = torch.nn.functional.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            attn_mask=causal_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=is_causal,
        )

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.view(bsz, q_len, self.hidden_size)
        attn_output = self.o_proj(attn_output)
        return attn_output, None, past_key_value


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaSdpaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cache_position=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            output_attentions=output_attentions,
            use_cache=use_cache,
            cache_position=cache_position,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return (hidden_states,)


class Fundamental_Music_Embedding(nn.Module):
    def __init__(self, dim, base, padding_idx=None, device=None):
        super().__init__()
        self.d_model = dim
        self.base = base
        translation_bias = torch.rand((1, self.d_model), dtype=torch.float32).to(device)
        translation_bias = nn.Parameter(translation_bias, requires_grad=True)
        self.register_parameter("translation_bias", translation_bias)
        i = torch.arange(self.d_model)
        angle_rates = 1 / torch.pow(self.base, (2 * (i // 2)) / self.d_model)
        self.angles = angle_rates[None, ...]
        self.linear_fme = nn.Linear(self.d_model, self.d_model)

    def __call__(self, inp):
        assert inp.dim() == 2
        data_type = self.linear_fme.weight.dtype
        inp = inp[..., None]
        angle_rads = inp * self.angles.to(inp.device, dtype=data_type)
        angle_rads[:, :, 0::2] = torch.sin(angle_rads.clone()[:, :, 0::2])
        angle_rads[:, :, 1::2] = torch.cos(angle_rads.clone()[:, :, 1::2])
        pos_encoding = angle_rads.to(data_type)
        pos_encoding += self.translation_bias.to(data_type)
        out = self.linear_fme(pos_encoding)
        return out


EMBEDDING_METHODS = {
    "FME": Fundamental_Music_Embedding,
}


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.sos_token = config.sos_token
        self.eos_token = config.eos_token
        emb_size = config.hidden_size // 6
        self.onset_embedding = EMBEDDING_METHODS[config.onset_embedding['method']](dim=emb_size, **{k: v for k, v in config.onset_embedding.items() if k != 'method'})
        self.dur_embedding = EMBEDDING_METHODS[config.dur_embedding['method']](dim=emb_size, **{k: v for k, v in config.dur_embedding.items() if k != 'method'})
        self.octave_embedding = EMBEDDING_METHODS[config.octave_embedding['method']](dim=emb_size, **{k: v for k, v in config.octave_embedding.items() if k != 'method'})
        self.pitch_embedding = EMBEDDING_METHODS[config.pitch_embedding['method']](dim=emb_size, **{k: v for k, v in config.pitch_embedding.items() if k != 'method'})
        self.instrument_embedding = EMBEDDING_METHODS[config.instrument_embedding['method']](dim=emb_size, **{k: v for k, v in config.instrument_embedding.items() if k != 'method'})
        self.velocity_embedding = EMBEDDING_METHODS[config.velocity_embedding['method']](dim=emb_size, **{k: v for k, v in config.velocity_embedding.items() if k != 'method'})
        self.supplementary_embedding = nn.Embedding(2, config.hidden_size)
        self.supplementary_MLP = nn.Sequential(
            nn.Linear(config.hidden_size, config.hidden_size // 2),
            nn.ReLU(),
            nn.Linear(config.hidden_size // 2, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_tokens(self, input_ids):
        sos = self.supplementary_embedding(torch.tensor(0).to(input_ids.device))[None, None, ...].expand(input_ids.size(0), -1, -1)
        eos = self.supplementary_embedding(torch.tensor(1).to(input_ids.device))[None, None, ...].expand(input_ids.size(0), -1, -1)
        where_sos = (input_ids[:, :, 0] == self.sos_token).unsqueeze(-1)
        where_eos = (input_ids[:, :, 0] == self.eos_token).unsqueeze(-1)
        input_ids_tmp = torch.where((where_sos | where_eos), torch.tensor([0 for _ in range(6)]).to(input_ids), input_ids)
        onsets = self.onset_embedding(input_ids_tmp[..., 0])
        durs = self.dur_embedding(input_ids_tmp[..., 1])
        octaves = self.octave_embedding(input_ids_tmp[..., 2])
        pitch_classes = self.pitch_embedding(input_ids_tmp[..., 3])
        instruments = self.instrument_embedding(input_ids_tmp[..., 4])
        velocities = self.velocity_embedding(input_ids_tmp[..., 5])
        out_fme = torch.concat([onsets, durs, octaves, pitch_classes, instruments, velocities], dim=-1)
        out_fme_sos = torch.where(where_sos, sos, out_fme)
        out_fme_sos_eos = torch.where(where_eos, eos, out_fme_sos)
        out_final = self.supplementary_MLP(out_fme_sos_eos)
        return out_final

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache_position=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if cache_position is None:
            past_seen_tokens = 0
            cache_position = torch.arange(past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)

        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, past_key_values, False)

        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            layer_outputs = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_ids=position_ids,
                past_key_value=past_key_values,
                use_cache=use_cache,
                cache_position=cache_position,
            )
            hidden_states = layer_outputs[0]
        hidden_states = self.norm(hidden_states)
        return (hidden_states,)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_key_values, output_attentions):
        if attention_mask is None:
            past_seen_tokens = 0
            dtype, device = input_tensor.dtype, input_tensor.device
            min_dtype = torch.finfo(dtype).min
            sequence_length = input_tensor.shape[1]
            target_length = past_seen_tokens + sequence_length
            causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype, device=device)
            if sequence_length != 1:
                causal_mask = torch.triu(causal_mask, diagonal=1)
            causal_mask *= torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
            causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1)
            return causal_mask

        if len(attention_mask.shape) == 2:
            attention_mask = attention_mask[:, None, :]
            attention_mask_rep = attention_mask.expand(-1, attention_mask.shape[2], -1)
            if FIXED:
                block_mask = (attention_mask_rep == attention_mask_rep.transpose(1, 2))
                seq_len = attention_mask.shape[2]
                causal_mask = torch.tril(torch.ones((seq_len, seq_len), dtype=torch.bool, device=attention_mask.device))
                attention_mask = block_mask & causal_mask
            else:
                attention_mask = (attention_mask_rep == attention_mask_rep.transpose(1, 2))
            attention_mask = attention_mask.unsqueeze(1)
            return attention_mask


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.summary_projection = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.lm_head = nn.Linear(config.hidden_size, 7 * config.decode_vocab_size, bias=False)
        self.loss_func = nn.CrossEntropyLoss()

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=input_ids,
        )
        hidden_states = outputs[0]
        logits_shrinked = self.summary_projection(hidden_states)
        loss = None
        if labels is not None:
            shift_logits_x = logits_shrinked[..., :-1, :].contiguous()
            shift_labels_x = labels[..., 1:, :].contiguous()
            logits = self.lm_head(shift_logits_x).view(-1, self.config.decode_vocab_size)
            loss = self.loss_func(logits, shift_labels_x.reshape(-1))
        return loss, logits_shrinked


def make_piece(rng, length, config):
    onset = torch.cumsum(torch.randint(0, 4, (length,), generator=rng), 0)
    dur = torch.randint(1, 8, (length,), generator=rng)
    octave = torch.randint(2, 7, (length,), generator=rng)
    pitch_class = torch.randint(0, 12, (length,), generator=rng)
    instrument = torch.zeros(length, dtype=torch.long)
    velocity = torch.randint(40, 100, (length,), generator=rng)
    notes = torch.stack([onset, dur, octave, pitch_class, instrument, velocity], dim=-1)
    sos = torch.full((1, 6), config.sos_token)
    eos = torch.full((1, 6), config.eos_token)
    input_ids = torch.cat([sos, notes, eos], dim=0)
    labels = torch.cat([torch.zeros(input_ids.shape[0], 1, dtype=torch.long),
                        input_ids.clamp(min=0) % config.decode_vocab_size], dim=-1)
    return {"input_ids": input_ids.tolist(), "attention_mask": [1] * input_ids.shape[0], "labels": labels.tolist()}


class ConcatDataset_vanilla(torch.utils.data.Dataset):
    def __init__(self, dataset, chunk_size=4096):
        self.dataset = dataset
        self.chunk_size = chunk_size
        self.samples = []
        buffer = {
            "input_ids": [],
            "attention_mask": [],
            "labels": [],
            }
        sample_count = 0
        for sample in self.dataset:
            sample['attention_mask'] = [sample_count] * len(sample['attention_mask'])
            buffer = {k: v + sample[k] for k, v in buffer.items()}
            while len(next(iter(buffer.values()))) > self.chunk_size:
                self.samples.append({k: v[:self.chunk_size] for k, v in buffer.items()})
                buffer = {k: v[self.chunk_size:] for k, v in buffer.items()}
            sample_count += 1

    def __getitem__(self, idx):
        return self.samples[idx]

    def __len__(self):
        return len(self.samples)


torch.manual_seed(0)
config = LlamaConfig()
model = LlamaForCausalLM(config)
rng = torch.Generator().manual_seed(0)
pieces = [make_piece(rng, int(torch.randint(8, 30, (1,), generator=rng)), config) for _ in range(12)]
train_dataset = ConcatDataset_vanilla(pieces, chunk_size=64)
batch = {k: torch.tensor([train_dataset[i][k] for i in range(2)]) for k in ["input_ids", "attention_mask", "labels"]}
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model.train()
for step in range(3):
    loss, _ = model(**batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")
