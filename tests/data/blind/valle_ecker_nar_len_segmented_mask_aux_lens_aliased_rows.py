"""vall-e (mrq / e-c-k-e-r): NAR-len demasking under the segmented attention mask, every row's segments aliased.

Citation: e-c-k-e-r/vall-e commit 90b3509 ("... the regression came from dumb python aliasing rules"),
vall_e/models/base_v2.py Base_V2.forward; the aliased lists came in with commit d1d9129 ("add segmented
sliding attention, also found a bug with prom-less segments in the attention mask generation").

Base_V2 (the NAR-len "demasking" VALL-E) lays each row out as <phn><sep><lang><sep><prom><sep><resp> and,
when every row of the batch is non-causal and `use_segmented_attention_mask` is set, builds a
(bsz, 1, L, L) boolean mask from each row's segment lengths `aux_lens[b] = [text_len, prom_len, resp_len]`
(Model._update_segmented_mask: text sees text, prom sees text + prom, resp sees everything real).

The bug: `aux_lens = [[2, 0, 0]] * batch_size` makes every row the same inner list, so the loop that fills
`aux_lens[batch_index][...]` writes all rows' lengths into one list and every row's mask is built from the
last row's segment lengths. Rows whose phonemes / prompt / response lengths differ from the last row get
their segment boundaries in the wrong places (the response of a longer row partly sees nothing at all), in
the conditional pass and in the CFG null pass alike.

The fix: one fresh `lens = [2, 0, 0]` (and `windows`) list per row, appended to `aux_lens`.

This program keeps the project's layout (Base_V2.inputs / inputs_to_embeddings / forward / sample, the
Llama-style Model with its `_update_segmented_mask`, Attention's split_forward into SDPA, the
FiniteAudioEncoder / FiniteAudioDecoder, ar_nar_v2's forward_nar_masked loop with CFG and cfg_logits) at toy
sizes with random weights; config objects are trimmed to the fields read here.
"""

import math
import sys
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from transformers.activations import ACT2FN
from transformers.models.llama.configuration_llama import LlamaConfig as BaseConfig

FIXED = "--fixed" in sys.argv

Logits = namedtuple('Logits', ['logits', 'state', 'inputs', 'loss', 'attentions', 'hidden_states'])
Sampled = namedtuple('Sampled', ['ids', 'logits', 'scores', 'entropy'])

special_tasks = ["len", "stt", "phn", "text"]


def get_task_symmap():
	return {"tts": 0, "tts-c": 1, "ns": 2, "sr": 3, "tse": 4, "soe": 5, "mask": 6, "eoe": 7, "stt": 8, "len": 9, "phn": 10, "text": 11}


def clamp(n, lo, hi):
	return max(lo, min(n, hi))


# ---------------------------------------------------------------- config (vall_e/config.py, trimmed)

@dataclass
class ModelExperimental:
	unified_position_ids: bool = True
	noncausal_masks: bool = True  # to correct an oversight with Llama always using causal masks......
	parallel_attention_mask_dropout: float = 0.0
	use_segmented_attention_mask: bool = True  # each segment cannot attend after itself
	use_sliding_attention_mask: bool = False
	per_level_normalization: bool = True


@dataclass
class ModelCfg:
	resp_levels: int = 2
	attention: str = "sdpa"
	langs: int = 2
	tones: int = 1
	tasks: int = 12
	experimental: ModelExperimental = field(default_factory=ModelExperimental)


# ---------------------------------------------------------------- vall_e/models/arch/llama.py (trimmed)

class Config(BaseConfig):
	def __init__(
		self,
		attn_mode = "sdpa",
		output_norm = True,
		causal = True,
		layer_dropout = 0.0,
		*args, **kwargs
	):
		super().__init__(*args, **kwargs)

		self.attn_mode = attn_mode
		self.output_norm = output_norm
		self.causal = causal
		self.layer_dropout = layer_dropout


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
	batch, num_key_value_heads, slen, head_dim = hidden_states.shape
	if n_rep == 1:
		return hidden_states
	hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
	return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


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


class RMSNorm(nn.Module):
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


class RotaryEmbedding(nn.Module):
	# the "default" rope_init_fn written out
	def __init__(self, config, device=None):
		super().__init__()
		base = config.rope_parameters["rope_theta"]
		dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
		inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
		self.attention_scaling = 1.0
		self.register_buffer("inv_freq", inv_freq, persistent=False)

	@torch.no_grad()
	def forward(self, x, position_ids):
		inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
		position_ids_expanded = position_ids[:, None, :].float()
		freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
		emb = torch.cat((freqs, freqs), dim=-1)
		cos = emb.cos() * self.attention_scaling
		sin = emb.sin() * self.attention_scaling
		return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Attention(nn.Module):
	def __init__(self, config, layer_idx):
		super().__init__()

		self.config = config
		self.attn_mode = config.attn_mode
		self.layer_idx = layer_idx
		self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
		self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
		self.scaling = self.head_dim**-0.5
		self.attention_dropout = config.attention_dropout
		self.hidden_size = config.hidden_size
		self.num_heads = config.num_attention_heads
		self.num_key_value_heads = config.num_key_value_heads

		self.q_proj = nn.Linear( config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias )
		self.k_proj = nn.Linear( config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias )
		self.v_proj = nn.Linear( config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias )
		self.o_proj = nn.Linear( config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias )

	# extracts inputs from a batch based on requested causality
	def split_forward(
		self,
		hidden_states,
		attention_mask = None,
		is_causal = None,
		target_causal_state = True,
		position_ids = None,
		past_key_value = None,
		output_attentions = False,
		use_cache = False,
		cache_position = None,
		position_embeddings = None,
		**kwargs,
	):
		indices = [ i for i, state in enumerate( is_causal ) if state == target_causal_state ]

		# no matching inputs in batch
		if not indices:
			return indices, None, None, None

		# entire batch is homogenous
		if len( indices ) == hidden_states.shape[0]:
			output_hidden_states, output_self_attn_weights, output_present_key_values = self.forward(
				hidden_states=hidden_states,
				attention_mask=attention_mask,
				is_causal=target_causal_state,
				position_ids=position_ids,
				past_key_value=past_key_value,
				output_attentions=output_attentions,
				use_cache=False,
				cache_position=cache_position,
				position_embeddings=position_embeddings,
				**kwargs,
			)
			return indices, output_hidden_states, output_self_attn_weights, output_present_key_values

		input_hidden_states = torch.stack( [ hidden_states[i] for i in indices ] )
		input_attention_mask = torch.stack( [ attention_mask[i] for i in indices ] ) if attention_mask is not None else None
		input_position_ids = torch.stack( [ position_ids[i] for i in indices ] ) if position_ids is not None else None
		input_position_embeddings = (
			torch.stack( [ position_embeddings[0][i] for i in indices ] ),
			torch.stack( [ position_embeddings[1][i] for i in indices ] ),
		) if position_embeddings is not None else None

		output_hidden_states, output_self_attn_weights, output_present_key_values = self.forward(
			hidden_states=input_hidden_states,
			attention_mask=input_attention_mask,
			is_causal=target_causal_state,
			position_ids=input_position_ids,
			past_key_value=past_key_value,
			output_attentions=output_attentions,
			use_cache=False,
			cache_position=cache_position,
			position_embeddings=input_position_embeddings,
			**kwargs,
		)
		return indices, output_hidden_states, output_self_attn_weights, output_present_key_values

	def forward(
		self,
		hidden_states: torch.Tensor,
		attention_mask: Optional[torch.Tensor] = None,
		is_causal: bool = True,
		position_ids: Optional[torch.LongTensor] = None,
		past_key_value = None,
		output_attentions: bool = False,
		use_cache: bool = False,
		cache_position: Optional[torch.LongTensor] = None,
		position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
		**kwargs,
	):
		mode = "default" if output_attentions else self.attn_mode
		non_split_attention = [
			"default",
			torch.nn.attention.SDPBackend.MATH,
			torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
			torch.nn.attention.SDPBackend.FLASH_ATTENTION,
			torch.nn.attention.SDPBackend.CUDNN_ATTENTION
		]

		# split per batch because other attention mechanisms do not have a conditional is_causal per-batch, only for the entire input
		if isinstance( is_causal, list ) and mode not in non_split_attention:
			attn_hidden_states = [ None for _ in is_causal ]

			causal_indices, causal_hidden_states, _, _ = self.split_forward(
				hidden_states=hidden_states, attention_mask=attention_mask, is_causal=is_causal, target_causal_state=True,
				position_ids=position_ids, past_key_value=past_key_value, output_attentions=output_attentions,
				use_cache=False, cache_position=cache_position, position_embeddings=position_embeddings, **kwargs,
			)
			non_causal_indices, non_causal_hidden_states, _, _ = self.split_forward(
				hidden_states=hidden_states, attention_mask=attention_mask, is_causal=is_causal, target_causal_state=False,
				position_ids=position_ids, past_key_value=past_key_value, output_attentions=output_attentions,
				use_cache=False, cache_position=cache_position, position_embeddings=position_embeddings, **kwargs,
			)

			for i, idx in enumerate( causal_indices ):
				attn_hidden_states[idx] = causal_hidden_states[i]
			for i, idx in enumerate( non_causal_indices ):
				attn_hidden_states[idx] = non_causal_hidden_states[i]

			attn_hidden_states = torch.stack( attn_hidden_states, dim=0 )
			return attn_hidden_states, None, []

		dropout_rate = self.attention_dropout if self.training else 0.0
		bsz, q_len, _ = hidden_states.size()

		query_states = self.q_proj(hidden_states)
		key_states = self.k_proj(hidden_states)
		value_states = self.v_proj(hidden_states)

		query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
		key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
		value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

		cos, sin = position_embeddings
		query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

		key_states = repeat_kv(key_states, self.num_key_value_groups)
		value_states = repeat_kv(value_states, self.num_key_value_groups)

		x_mask = attention_mask

		if attention_mask is not None:
			x_mask = x_mask[:, :, :, : key_states.shape[-2]]

		if mode in ["default"]:
			attn_scores = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
			if x_mask is not None:
				if x_mask.dtype == torch.bool:
					attn_weights = attn_scores.masked_fill_(x_mask.logical_not(), float("-inf"))
				else:
					attn_weights = attn_scores + x_mask
			else:
				attn_weights = attn_scores
			attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
			attn_output = torch.matmul(attn_weights, value_states)
		else:  # mode == "sdpa"
			attn_output = torch.nn.functional.scaled_dot_product_attention(
				query_states,
				key_states,
				value_states,
				attn_mask=None if is_causal else x_mask,
				dropout_p=dropout_rate,
				is_causal=is_causal,
			)

		attn_output = attn_output.transpose(1, 2).contiguous()
		attn_output = attn_output.view(bsz, q_len, -1)
		attn_output = self.o_proj(attn_output)

		return attn_output, None, past_key_value


class MLP(nn.Module):
	def __init__(self, config):
		super().__init__()
		self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
		self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
		self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
		self.act_fn = ACT2FN[config.hidden_act]

	def forward(self, x):
		return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
	def __init__(self, config, layer_idx):
		super().__init__()
		self.config = config
		self.self_attn = Attention(config=config, layer_idx=layer_idx)
		self.mlp = MLP(config)
		self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
		self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

	def forward(
		self,
		hidden_states,
		attention_mask = None,
		is_causal = None,
		position_ids = None,
		past_key_value = None,
		output_attentions = False,
		use_cache = False,
		cache_position = None,
		position_embeddings = None,
		**kwargs,
	):
		residual = hidden_states
		hidden_states = self.input_layernorm(hidden_states)

		# ugh
		if isinstance( is_causal, list ) and len(is_causal) == 1:
			is_causal = is_causal[0]

		hidden_states, self_attn_weights, present_key_value = self.self_attn(
			hidden_states=hidden_states,
			attention_mask=attention_mask,
			is_causal=is_causal,
			position_ids=position_ids,
			past_key_value=past_key_value,
			output_attentions=output_attentions,
			use_cache=use_cache,
			cache_position=cache_position,
			position_embeddings=position_embeddings,
			**kwargs,
		)
		hidden_states = residual + hidden_states

		residual = hidden_states
		hidden_states = self.post_attention_layernorm(hidden_states)
		hidden_states = self.mlp(hidden_states)
		hidden_states = residual + hidden_states

		return (hidden_states,)


class Model(nn.Module):
	def __init__(self, config):
		super().__init__()
		self.config = config
		self.layers = nn.ModuleList([DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)])
		self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if config.output_norm else nn.Identity()
		self.rotary_emb = RotaryEmbedding(config=config)

	# shamelessly inspired from https://github.com/open-mmlab/Amphion/blob/main/models/tts/maskgct/llama_nar.py#L256
	def _update_noncausal_mask(
		self,
		attention_mask,
		inputs_embeds,
		past_key_values_length,
	):
		# [bsz, seq_len] -> [bsz, 1, seq_len, seq_len]
		bsz, seq_len, _ = inputs_embeds.size()
		dtype = torch.bool
		device = inputs_embeds.device

		if attention_mask is None:
			attention_mask = torch.ones( (bsz, seq_len), dtype=dtype, device=device )

		mask = attention_mask[:, None, None, :].expand( bsz, 1, seq_len, seq_len ).to(dtype)
		return mask

	# some funky segmented-attention mask because my gut says to do this
	def _update_segmented_mask(
		self,
		attention_mask,
		inputs_embeds,
		aux_lens, # (bsz, lens), where [batch_index, 0] = text_len, and [batch_index, 1] = prom_len
		window_sizes = None, # (bsz, lens), same as above
		past_key_values_length=0,
	):
		# [bsz, seq_len] -> [bsz, 1, seq_len, seq_len]
		bsz, seq_len, _ = inputs_embeds.size()

		dtype = torch.bool
		device = inputs_embeds.device

		if attention_mask is None:
			attention_mask = torch.ones((bsz, seq_len), dtype=dtype, device=device)

		expanded_mask = torch.zeros( (bsz, 1, seq_len, seq_len), dtype=dtype, device=device )

		for batch_index, aux_len in enumerate( aux_lens ):
			window_size = window_sizes[batch_index] if window_sizes is not None else None
			text_len = aux_len[0]
			prom_len = aux_len[1]
			output_len = aux_len[2]

			text_window = window_size[0] if window_size is not None else 0
			prom_window = window_size[1] if window_size is not None else 0
			output_window = window_size[2] if window_size is not None else 0

			text_start, text_end = 0, text_len
			prom_start, prom_end = text_end, text_end + prom_len
			output_start, output_end = prom_end, prom_end + output_len

			if text_len:
				expanded_mask[batch_index, 0, text_start:text_end, text_start:text_end] = True if not text_window else self._sliding_window( text_len, text_window )
			if prom_len:
				expanded_mask[batch_index, 0, prom_start:prom_end, text_start:text_end] = True
				expanded_mask[batch_index, 0, prom_start:prom_end, prom_start:prom_end] = True if not prom_window else self._sliding_window( prom_len, prom_window )
			if output_len:
				expanded_mask[batch_index, 0, output_start:output_end, text_start:text_end] = True
				expanded_mask[batch_index, 0, output_start:output_end, prom_start:prom_end] = True
				expanded_mask[batch_index, 0, output_start:output_end, output_start:output_end] = True if not output_window else self._sliding_window( output_len, output_window )

		# apply the original attention mask
		mask = expanded_mask * attention_mask[:, None, None, :].expand(bsz, 1, seq_len, seq_len).to(dtype)
		return mask

	# generate a sliding window pattern
	def _sliding_window( self, seq_len, window_size ):
		if not window_size:
			return True
		half_window = int(window_size // 2)
		mask = torch.zeros( seq_len, seq_len, dtype=torch.bool )
		for i in range( seq_len ):
			window_start = max( 0, i - half_window )
			window_end = min( seq_len, i + half_window + 1 )
			mask[i, window_start:window_end] = True
		return mask

	def forward(
		self,
		attention_mask = None,
		is_causal = None,
		position_ids = None,
		inputs_embeds = None,
		cache_position = None,
	):
		if cache_position is None:
			cache_position = torch.arange(0, inputs_embeds.shape[1], device=inputs_embeds.device)
		if position_ids is None:
			position_ids = cache_position.unsqueeze(0)

		# use already crafted mask
		if attention_mask.dim() > 2:
			x_mask = attention_mask
		# (the per-row causal / noncausal pick; only the noncausal builder is kept here)
		else:
			x_mask = self._update_noncausal_mask(attention_mask, inputs_embeds, 0)

		hidden_states = inputs_embeds
		position_embeddings = self.rotary_emb(hidden_states, position_ids)

		for decoder_layer in self.layers:
			layer_outputs = decoder_layer(
				hidden_states,
				attention_mask=x_mask,
				is_causal=is_causal,
				position_ids=position_ids,
				cache_position=cache_position,
				position_embeddings=position_embeddings,
			)
			hidden_states = layer_outputs[0]

		hidden_states = self.norm(hidden_states)
		return {"last_hidden_state": hidden_states}


# ---------------------------------------------------------------- vall_e/models/base_v2.py (trimmed)

def _create_mask(l, device):
	seq = torch.arange(max(l), device=device).unsqueeze(0)  # (1 t)
	stop = torch.tensor(l, device=device).unsqueeze(1)  # (b 1)
	return (seq < stop).float()  # (b t)


def _join(x: tuple, sep: Tensor):
	ret = x[0]
	for i in range(1, len(x)):
		ret = torch.cat((ret, sep[None], x[i]), dim=0)
	return ret


def list_to_tensor(x_list: list):
	l = list(map(len, x_list))
	x = pad_sequence(x_list, batch_first=True)
	m = _create_mask(l, x_list[0].device)
	m = m.to(x).int()
	return x, m


class FiniteAudioEncoder(nn.Module):
	def __init__(self, n_tokens, n_levels, token_dim, use_ln=True, use_ffn=True, d_model=None, d_ffn=2):
		super().__init__()
		if not d_model:
			d_model = token_dim
		self.embs = nn.ModuleList([nn.Embedding(n_tokens, token_dim) for _ in range(n_levels)])
		self.pos_embedding = nn.Parameter(torch.randn(1, n_levels, token_dim) * 0.02)
		self.norm = nn.LayerNorm(token_dim) if use_ln else nn.Identity()
		self.proj = nn.Sequential(
			nn.Linear(token_dim, token_dim * d_ffn),
			nn.GELU(),
			nn.Linear(token_dim * d_ffn, d_model),
		)
		self.level_weights = nn.Parameter(torch.ones(n_levels) / math.sqrt(n_levels))
		for emb in self.embs:
			torch.nn.init.normal_(emb.weight, mean=0.0, std=0.02)
		self.use_ffn = use_ffn
		nn.init.xavier_uniform_(self.proj[0].weight)
		nn.init.xavier_uniform_(self.proj[2].weight)
		nn.init.zeros_(self.proj[0].bias)
		nn.init.zeros_(self.proj[2].bias)

	def forward(self, xi: Tensor, dropout_mask = None, dropout_token = None) -> Tensor:
		x = torch.stack([ emb(xi[:, i].long()) for i, emb in enumerate(self.embs) ], dim=1)
		x = x + self.pos_embedding
		x = self.norm(x)
		x = x + self.proj( x )
		weights = F.softmax(self.level_weights, dim=0).view(1, -1, 1)
		x = (x * weights).sum(dim=1)
		return x


class FiniteAudioDecoder(nn.Module):
	def __init__(self, d_model, vocab_size, n_levels, d_ffn=2, use_ln=True):
		super().__init__()
		self.n_levels = n_levels
		self.head = nn.ModuleList([nn.Sequential(
			(nn.LayerNorm(d_model) if use_ln else nn.Identity()),
			nn.Linear(d_model, d_ffn * d_model),
			nn.GELU(),
			nn.Linear(d_ffn * d_model, d_model),
			nn.Linear(d_model, vocab_size)
		) for _ in range(n_levels)])

	def forward(self, x: Tensor) -> Tensor:
		return torch.stack([head(x) for head in self.head], dim=1)


AudioEncoder = FiniteAudioEncoder
AudioDecoder = FiniteAudioDecoder


class Base_V2(nn.Module):
	def __init__(
		self,
		n_phn_tokens: int = 256,
		n_audio_tokens: int = 1024,
		d_model: int = 512,
		d_ffn: int = 4,
		n_heads: int = 8,
		n_layers: int = 12,
		config = None,
	):
		super().__init__()
		self.config = config
		attention_backend = config.attention
		per_level_normalization = config.experimental.per_level_normalization

		self.n_resp_levels = config.resp_levels
		self.n_audio_tokens = n_audio_tokens
		self.stop_token = self.n_audio_tokens
		self.mask_token = self.stop_token + 1

		self.unified_position_ids = config.experimental.unified_position_ids
		self.noncausal_masks = config.experimental.noncausal_masks
		self.use_segmented_attention_mask = config.experimental.use_segmented_attention_mask
		self.use_sliding_attention_mask = config.experimental.use_sliding_attention_mask
		self.parallel_attention_mask_dropout = config.experimental.parallel_attention_mask_dropout
		self.audio_frames_per_second = 75
		self.l_padding = 0

		self.sep = nn.Parameter(torch.randn(d_model))

		self.phn_emb = nn.Embedding(n_phn_tokens, d_model)
		self.langs_emb = nn.Embedding(config.langs, d_model)
		self.tones_emb = nn.Embedding(config.tones, d_model)

		self.proms_emb = AudioEncoder(n_tokens=n_audio_tokens, n_levels=self.n_resp_levels, token_dim=d_model)
		self.resps_emb = AudioEncoder(n_tokens=n_audio_tokens + 2, n_levels=self.n_resp_levels, token_dim=d_model)  # stop + masked token
		self.audio_decoder = AudioDecoder(d_model, (n_audio_tokens + 1), self.n_resp_levels, use_ln=per_level_normalization)

		self.model_config = Config(
			vocab_size=256,
			hidden_size=d_model,
			max_position_embeddings=75 * 60 * 5,
			intermediate_size=d_model*d_ffn,
			num_hidden_layers=n_layers,
			num_attention_heads=n_heads,
			attention_dropout=0.0,
			num_key_value_heads=n_heads,
			hidden_act="gelu",
			is_encoder_decoder=False,
			is_decoder=True,
			output_norm = not per_level_normalization,
			attn_mode = attention_backend,
			causal = True,
		)
		self.model = Model(self.model_config)

	def _forward(self, inputs, mask=None, is_causal=None, position_ids=None, state=None):
		output = self.model(inputs_embeds=inputs, attention_mask=mask, position_ids=position_ids, is_causal=is_causal)
		return Logits(output["last_hidden_state"], state, inputs, None, None, None)

	def inputs(self, phns_list=None, proms_list=None, resps_list=None, lang_list=None, tone_list=None,
	           task_list=None, time_list=None, quant_levels=None):
		batch_size = len(phns_list)
		inputs = [ [] for _ in range(batch_size) ]
		for i in range(batch_size):
			quant_level = quant_levels[i] if quant_levels is not None else 0
			task_type = task_list[i] if task_list is not None else "tts"
			timestep = time_list[i] if time_list is not None else None

			inputs[i].append( ( "task", task_type ) )

			# Sequence: <phn><sep><rvq lvl><sep><prom><sep><resp>
			if task_type in get_task_symmap() and task_type not in special_tasks:
				if phns_list is not None and phns_list[i] is not None:
					inputs[i].append( ( "phn", phns_list[i] ) )
				if lang_list is not None and lang_list[i] is not None:
					inputs[i].append( ( "lang", lang_list[i] ) )
				if proms_list is not None and proms_list[i] is not None:
					inputs[i].append( ( "prom", proms_list[i] ) )
				if tone_list is not None and tone_list[i] is not None:
					inputs[i].append( ( "tone", tone_list[i] ) )
				if resps_list is not None and resps_list[i] is not None:
					inputs[i].append( ( "resp", resps_list[i] ) )

				classifier_level = f"{'N' if timestep is not None else ''}AR:{quant_level}:{quant_level}"
				inputs[i].append( ("classifier_level", classifier_level) )
		return inputs

	def inputs_to_embeddings(self, inputs, quant_levels=None):
		x_list = []
		for batch_index, batch_input in enumerate(inputs):
			batch = []
			for name, input in batch_input:
				embedding = None
				if name == "task":
					continue
				elif name == "phn":
					embedding = self.phn_emb( input )
				elif name == "lang" and self.langs_emb is not None:
					embedding = self.langs_emb( input )
				elif name == "prom":
					proms = [ input ] if isinstance(input, torch.Tensor) else input
					embedding = torch.cat( [ self.proms_emb( input ) for input in proms if input is not None ] )
				elif name == "tone" and self.tones_emb is not None:
					embedding = self.tones_emb( input )
				elif name == "resp":
					embedding = self.resps_emb( input, dropout_mask=None, dropout_token=self.mask_token )
				else:
					continue
				batch.append(embedding)

			x_list.append( _join( batch, self.sep ) )
		return x_list

	def get_input(self, inputs, name):
		res = []
		for batch_input in inputs:
			for n, input in batch_input:
				if n == name:
					res.append( input )
		return res

	def forward(self, inputs, quant_levels=None, state=None):
		x_list = self.inputs_to_embeddings( inputs, quant_levels )

		x, mask = list_to_tensor(x_list)

		batch_size = len(x_list)

		position_ids = None  # unified_position_ids
		classifier_levels = self.get_input( inputs, name="classifier_level" )
		causal_levels = [ "phn", "text" ] + [ f"AR:{_}:{_}" for _ in range( self.n_resp_levels) ]

		is_causal = [ l in causal_levels for l in classifier_levels ] if self.noncausal_masks else [ True for l in classifier_levels ]

		# create special masks
		text_window = 32 if self.use_sliding_attention_mask else 0
		audio_window = self.audio_frames_per_second // 2 if self.use_sliding_attention_mask else 0

		if not FIXED:
			aux_lens = [[2, 0, 0]] * batch_size
			aux_windows = [[text_window, audio_window, audio_window]] * batch_size
			# fill aux lens
			for batch_index, batch_input in enumerate( inputs ):
				for name, input in batch_input:
					if name in ["phn", "text"]:
						aux_lens[batch_index][0] = input.shape[0] + 1
					elif name == "lang":
						aux_lens[batch_index][0] += 2
					elif name == "prom":
						aux_lens[batch_index][1] = input.shape[0] + 1
					elif name == "tone":
						aux_lens[batch_index][1] += 2
					elif name == "resp":
						aux_lens[batch_index][2] = input.shape[0]
		else:
			aux_lens = []
			aux_windows = []
			# fill aux lens
			for batch_index, batch_input in enumerate( inputs ):
				lens = [2, 0, 0]
				windows = [text_window, audio_window, audio_window]

				for name, input in batch_input:
					if name in ["phn", "text"]:
						lens[0] = input.shape[0] + 1
					elif name == "lang":
						lens[0] += 2
					elif name == "prom":
						lens[1] = input.shape[0] + 1
					elif name == "tone":
						lens[1] += 2
					elif name == "resp":
						lens[2] = input.shape[0]

				aux_lens.append( lens )
				aux_windows.append( windows )

		if self.use_segmented_attention_mask and not any(is_causal):
			mask = self.model._update_segmented_mask( mask, x, aux_lens, window_sizes=aux_windows )

		output = self._forward(inputs=x, mask=mask, state=state, is_causal=is_causal, position_ids=position_ids)

		logits = self.audio_decoder( output.logits )
		return Logits(logits, output.state, inputs, None, None, None)

	def sample(self, logits, prev_list=None, temperature=0.0, **sampling_kwargs):
		seq_lens = [ prev.shape[0] for prev in prev_list ]
		logits = [ logit[..., -l:, :] for l, logit in zip(seq_lens, logits) ]

		probabilities = [ F.softmax(logit, dim=-1) for logit in logits ]
		res = [ prob.argmax(dim=-1) for prob in probabilities ]  # greedy (temperature <= 0)
		scores = [
			torch.gather(prob, 2, tokens.unsqueeze(-1)).squeeze(-1)
			for prob, tokens in zip(probabilities, res)
		]
		return Sampled(res, logits, scores, None)


# ---------------------------------------------------------------- vall_e/samplers.py

def cfg_logits( logits, null, strength, lens, rescale=0.0 ):
	for i, seq_len in enumerate( lens ):
		pos = logits[i][..., -seq_len:, :]
		neg = null[i][..., -seq_len:, :]

		summed = neg + (pos - neg) * strength

		if rescale <= 0:
			logits[i][..., -seq_len:, :] = summed
		else:
			dims = tuple(range(1, summed.ndim - 1))
			factor = rescale * (pos.std(dims, keepdim=True) / summed.std(dims, keepdim=True)) + (1 - rescale)
			logits[i][..., -seq_len:, :] = summed * factor

	return logits


# ---------------------------------------------------------------- vall_e/models/ar_nar_v2.py forward_nar_masked (trimmed)

class AR_NAR_V2(Base_V2):
	@torch.no_grad()
	def forward_nar_masked(self, phns_list=None, proms_list=None, lang_list=None, tone_list=None, len_list=None,
	                       max_steps=25, minimum_cfg_strength=2.5, cfg_rescale=0.75, remasking=True):
		device = phns_list[0].device
		batch_size = len(phns_list)
		level = 0

		start_noise, end_noise = 0.0, 1.0
		temperature = 0.0
		cfg_strength = minimum_cfg_strength

		resps_list = [ torch.ones((seq_len, self.n_resp_levels), dtype=torch.int16, device=device) * self.mask_token for seq_len in len_list ]
		scores = [ torch.ones((seq_len, self.n_resp_levels), dtype=torch.float32, device=device) for seq_len in len_list ]

		quant_levels = [ level for _ in range(batch_size) ]
		null_text = [ torch.tensor([1, 2], device=device, dtype=torch.long) for _ in range(batch_size) ]
		null_prom = [ None for _ in range(batch_size) ]

		for timestep in torch.linspace(start_noise, end_noise, max_steps):
			timestep = float(timestep)
			noise_p = math.cos( timestep * math.pi * 0.5 )
			remask_p = 1.0 / (max_steps * 2) if remasking else 0
			masked_indices = [ score.topk( clamp( int( noise_p * seq_len + remask_p * seq_len ), 1, seq_len), dim=0 ).indices for score, seq_len in zip(scores, len_list) ]

			resps_list = [ torch.stack([resp[:, l].scatter(0, indices.t()[l], self.mask_token) for l in range(self.n_resp_levels)], dim=-1) for resp, indices in zip( resps_list, masked_indices ) ]
			is_masked = [ resps == self.mask_token for resps in resps_list ]
			time_list = [ timestep for _ in range(batch_size) ]

			input_resps_list = resps_list

			inputs = self.inputs(
				phns_list=phns_list, proms_list=proms_list, resps_list=input_resps_list,
				lang_list=lang_list, tone_list=tone_list, time_list=time_list, quant_levels=quant_levels,
			)
			output = self.forward(inputs=inputs, quant_levels=quant_levels)

			logits = output.logits
			if cfg_strength > 0:
				null_inputs = self.inputs(
					phns_list=null_text, proms_list=null_prom, resps_list=input_resps_list,
					lang_list=lang_list, tone_list=tone_list, time_list=time_list, quant_levels=quant_levels,
				)
				null_output = self.forward(inputs=null_inputs, quant_levels=quant_levels)

				logits = cfg_logits( logits=output.logits, null=null_output.logits, strength=cfg_strength, rescale=cfg_rescale, lens=[ l for l in len_list ] )

			sampled = self.sample(logits=logits, prev_list=resps_list, temperature=temperature)

			resps_list = [ torch.where( masked, ids.t(), resps ).to(torch.int16) for masked, ids, resps in zip( is_masked, sampled.ids, resps_list ) ]
			scores = [ 1.0 - torch.where( masked, scores.t(), 1 ) for masked, scores in zip( is_masked, sampled.scores ) ]

		return resps_list


def main():
	torch.manual_seed(0)

	cfg = ModelCfg()
	model = AR_NAR_V2(n_phn_tokens=64, n_audio_tokens=32, d_model=32, d_ffn=2, n_heads=4, n_layers=2, config=cfg).eval()

	# two utterances of different phoneme / prompt / target lengths
	phns_list = [ torch.randint(3, 64, (7,)), torch.randint(3, 64, (3,)) ]
	proms_list = [ torch.randint(0, 32, (4, cfg.resp_levels)), torch.randint(0, 32, (6, cfg.resp_levels)) ]
	lang_list = [ torch.tensor([0]), torch.tensor([1]) ]
	len_list = [ 6, 3 ]

	resps_list = model.forward_nar_masked(
		phns_list=phns_list, proms_list=proms_list, lang_list=lang_list, len_list=len_list, max_steps=4,
	)

	for i, resps in enumerate(resps_list):
		print(f"utterance {i}: level 0 codes {resps[:, 0].tolist()}  level 1 codes {resps[:, 1].tolist()}")


if __name__ == "__main__":
	main()
