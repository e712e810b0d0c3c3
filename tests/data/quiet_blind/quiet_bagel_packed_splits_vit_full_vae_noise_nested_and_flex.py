"""BAGEL (ByteDance-Seed/Bagel @056b5fd): training packs several multimodal samples
into one row.  Each sample is cut into splits by PackedDataset.pack_sequence
(data/dataset_base.py): a text split is "causal", a ViT (understanding) image split
and a clean VAE image split are "full" (bidirectional over the image and its
<|startofimage|> / <|endofimage|> tokens, all sharing one RoPE position), and the
VAE image being denoised is a "noise" split: bidirectional inside, and hidden from
every other token of the sample.  Without flex attention the dataset builds one
dense float mask per sample (data/data_utils.py prepare_attention_mask_per_sample)
and PackedAttention.forward_train (modeling/bagel/qwen2_navit.py) splits the packed
q/k/v by sample_lens and calls SDPA per sample with that mask; with flex attention
the dataset appends a pad split (split_lens + [pad_len], attn_modes + ['causal'],
sample_lens + [pad_len]) and Bagel.forward (modeling/bagel/bagel.py) builds a
BlockMask from create_sparse_mask's mask_mod (causal | same full/noise split,
minus other noise splits, within one document).

Port trimmed to the mask paths: tiny Qwen2-style layers (transformers' Qwen2Config,
Qwen2RMSNorm, Qwen2MLP, Qwen2RotaryEmbedding, apply_rotary_pos_emb), the SigLIP ViT
replaced by the connector over patchified pixels, the VAE by the identity (latent =
image, z_channels 3), float32 on CPU instead of the bf16 EFFICIENT_ATTENTION SDPA
and the compiled flex kernel.  Flow noise and timesteps are drawn per sample so a
sample packed alone gets the same ones.

Reference: each sample packed alone, its attention computed by a double loop over
(query, key) pairs from the split rules (earlier splits that are not "noise"; inside
a split everything unless it is "causal", then only keys <= query), softmax over
the visible keys; the packed hidden states, the per-token CE and the MSE must match.
"""
import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention, or_masks
from torch.nn.functional import scaled_dot_product_attention
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2MLP,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
    apply_rotary_pos_emb,
)

BOS, EOS, SOI, EOI = 1, 2, 3, 4


# ---------------------------------------------------------------- data/data_utils.py
def create_sparse_mask(document_lens, split_lens, attn_modes, device):
    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def full_and_noise_mask(b, h, q_idx, kv_idx):
        return (full_and_noise_seq_id[q_idx] == full_and_noise_seq_id[kv_idx]) & (full_and_noise_seq_id[q_idx] >= 0)

    def remove_noise_mask(b, h, q_idx, kv_idx):
        return (~((noise_seq_id[kv_idx] >= 0) & (noise_seq_id[q_idx] != noise_seq_id[kv_idx])))

    def sample_mask(b, h, q_idx, kv_idx):
        return document_id[q_idx] == document_id[kv_idx]

    full_and_noise_tmp = []
    noise_tmp = []

    for i, (length, model) in enumerate(zip(split_lens, attn_modes)):
        value = i if model in ['full', 'noise'] else -1
        full_and_noise_tmp.extend([value] * length)
        value_noise = i if model == 'noise' else -1
        noise_tmp.extend([value_noise] * length)

    full_and_noise_seq_id = torch.Tensor(full_and_noise_tmp).to(device)
    noise_seq_id = torch.Tensor(noise_tmp).to(device)

    document_id = torch.cat([torch.full((l,), i) for i, l in enumerate(document_lens, start=1)]).to(device)

    return and_masks(or_masks(causal_mask, full_and_noise_mask), remove_noise_mask, sample_mask)


def patchify(image, patch_size):
    p = patch_size
    c, h, w = image.shape
    assert h % p == 0 and w % p == 0
    image = image.reshape(c, h // p, p, w // p, p)
    image = torch.einsum("chpwq->hwpqc", image)
    image = image.reshape(-1, p**2 * c)
    return image


def get_flattened_position_ids_extrapolate(img_h, img_w, patch_size, max_num_patches_per_side):
    num_patches_h, num_patches_w = img_h // patch_size, img_w // patch_size
    coords_h = torch.arange(0, num_patches_h)
    coords_w = torch.arange(0, num_patches_w)
    pos_ids = (coords_h[:, None] * max_num_patches_per_side + coords_w).flatten()
    return pos_ids


def prepare_attention_mask_per_sample(split_lens, attn_modes, device="cpu"):
    sample_len = sum(split_lens)
    attention_mask = torch.zeros((sample_len, sample_len), dtype=torch.bool, device=device)

    csum = 0
    for s, attn_mode in zip(split_lens, attn_modes):
        assert attn_mode in ['causal', 'full', 'noise']
        if attn_mode == "causal":
            attention_mask[csum:csum + s, csum:csum + s] = torch.ones((s, s), device=device).tril()
            attention_mask[csum:csum + s, :csum] = 1
        else:
            attention_mask[csum:csum + s, csum:csum + s] = torch.ones((s, s))
            attention_mask[csum:csum + s, :csum] = 1
        csum += s

    csum = 0
    for s, attn_mode in zip(split_lens, attn_modes):
        if attn_mode == "noise":
            attention_mask[:, csum : csum + s] = torch.zeros((sample_len, s))
            attention_mask[csum : csum + s, csum : csum + s] = torch.ones((s, s))
        csum += s

    attention_mask = torch.zeros_like(attention_mask, dtype=torch.float).masked_fill_(
        ~attention_mask, float("-inf")
    )

    return attention_mask


def len2weight(x):
    return 1.0 / math.sqrt(x)


# ---------------------------------------------------------------- data/dataset_base.py
class DataConfig:
    vit_patch_size = 2
    max_num_patch_per_side = 8
    vae_image_downsample = 2
    max_latent_size = 8


class PackedDataset:
    def __init__(self, use_flex, max_num_tokens=128):
        self.use_flex = use_flex
        self.max_num_tokens = max_num_tokens
        self.data_config = DataConfig()
        self.bos_token_id, self.eos_token_id = BOS, EOS
        self.start_of_image, self.end_of_image = SOI, EOI
        self.get_flattened_position_ids = get_flattened_position_ids_extrapolate

    def set_sequence_status(self):
        return dict(
            curr=0, sample_lens=list(), packed_position_ids=list(), nested_attention_masks=list(),
            split_lens=list(), attn_modes=list(), packed_text_ids=list(), packed_text_indexes=list(),
            packed_label_ids=list(), ce_loss_indexes=list(), ce_loss_weights=list(),
            vae_image_tensors=list(), packed_latent_position_ids=list(), vae_latent_shapes=list(),
            packed_vae_token_indexes=list(), packed_timesteps=list(), mse_loss_indexes=list(),
            packed_vit_tokens=list(), vit_token_seqlens=list(), packed_vit_position_ids=list(),
            packed_vit_token_indexes=list(), packed_noise=list(),
        )

    def to_tensor(self, sequence_status):
        data = dict(
            sequence_length=sum(sequence_status['sample_lens']),
            sample_lens=list(sequence_status['sample_lens']),
            packed_text_ids=torch.tensor(sequence_status['packed_text_ids']),
            packed_text_indexes=torch.tensor(sequence_status['packed_text_indexes']),
            packed_position_ids=torch.tensor(sequence_status['packed_position_ids']),
        )
        if not self.use_flex:
            data['nested_attention_masks'] = sequence_status['nested_attention_masks']
        else:
            sequence_len = data['sequence_length']
            pad_len = self.max_num_tokens - sequence_len
            data['split_lens'] = sequence_status['split_lens'] + [pad_len]
            data['attn_modes'] = sequence_status['attn_modes'] + ['causal']
            data['sample_lens'] += [pad_len]

        if len(sequence_status['vae_image_tensors']) > 0:
            image_tensors = sequence_status['vae_image_tensors']
            image_sizes = [item.shape for item in image_tensors]
            max_image_size = [max(item) for item in list(zip(*image_sizes))]
            padded_images = torch.zeros(size=(len(image_tensors), *max_image_size))
            for i, image_tensor in enumerate(image_tensors):
                padded_images[i, :, :image_tensor.shape[1], :image_tensor.shape[2]] = image_tensor
            data['padded_images'] = padded_images
            data['patchified_vae_latent_shapes'] = sequence_status['vae_latent_shapes']
            data['packed_latent_position_ids'] = torch.cat(sequence_status['packed_latent_position_ids'], dim=0)
            data['packed_vae_token_indexes'] = torch.tensor(sequence_status['packed_vae_token_indexes'])
            data['packed_noise'] = torch.cat(sequence_status['packed_noise'], dim=0)

        if len(sequence_status['packed_vit_tokens']) > 0:
            data['packed_vit_tokens'] = torch.cat(sequence_status['packed_vit_tokens'], dim=0)
            data['packed_vit_position_ids'] = torch.cat(sequence_status['packed_vit_position_ids'], dim=0)
            data['packed_vit_token_indexes'] = torch.tensor(sequence_status['packed_vit_token_indexes'])
            data['vit_token_seqlens'] = torch.tensor(sequence_status['vit_token_seqlens'])

        if len(sequence_status['packed_timesteps']) > 0:
            data['packed_timesteps'] = torch.tensor(sequence_status['packed_timesteps'], dtype=torch.float)
            data['mse_loss_indexes'] = torch.tensor(sequence_status['mse_loss_indexes'])
        if len(sequence_status['packed_label_ids']) > 0:
            data['packed_label_ids'] = torch.tensor(sequence_status['packed_label_ids'])
            data['ce_loss_indexes'] = torch.tensor(sequence_status['ce_loss_indexes'])
            data['ce_loss_weights'] = torch.tensor(sequence_status['ce_loss_weights'])
        return data

    def pack_sequence(self, sample, sequence_status):
        image_tensor_list = list(sample['image_tensor_list'])
        text_ids_list = list(sample['text_ids_list'])
        sequence_plan = sample['sequence_plan']
        rng = np.random.default_rng(sample['seed'])   # per-sample draws (np.random.randn upstream)

        split_lens, attn_modes = list(), list()
        curr = sequence_status['curr']
        curr_rope_id = 0
        sample_lens = 0

        for item in sequence_plan:
            split_start = item.get('split_start', True)
            if split_start:
                curr_split_len = 0

            if item['type'] == 'text':
                text_ids = text_ids_list.pop(0)
                shifted_text_ids = [self.bos_token_id] + text_ids
                sequence_status['packed_text_ids'].extend(shifted_text_ids)
                sequence_status['packed_text_indexes'].extend(range(curr, curr + len(shifted_text_ids)))
                if item['loss'] == 1:
                    sequence_status['ce_loss_indexes'].extend(range(curr, curr + len(shifted_text_ids)))
                    sequence_status['ce_loss_weights'].extend(
                        [len2weight(len(shifted_text_ids))] * len(shifted_text_ids)
                    )
                    sequence_status['packed_label_ids'].extend(text_ids + [self.eos_token_id])
                curr += len(shifted_text_ids)
                curr_split_len += len(shifted_text_ids)

                # add a <|im_end|> token
                sequence_status['packed_text_ids'].append(self.eos_token_id)
                sequence_status['packed_text_indexes'].append(curr)
                curr += 1
                curr_split_len += 1

                attn_modes.append("causal")
                sequence_status['packed_position_ids'].extend(range(curr_rope_id, curr_rope_id + curr_split_len))
                curr_rope_id += curr_split_len

            elif item['type'] == 'vit_image':
                image_tensor = image_tensor_list.pop(0)
                sequence_status['packed_text_ids'].append(self.start_of_image)
                sequence_status['packed_text_indexes'].append(curr)
                curr += 1
                curr_split_len += 1

                vit_tokens = patchify(image_tensor, self.data_config.vit_patch_size)
                num_img_tokens = vit_tokens.shape[0]
                sequence_status['packed_vit_token_indexes'].extend(range(curr, curr + num_img_tokens))
                curr += num_img_tokens
                curr_split_len += num_img_tokens

                sequence_status['packed_vit_tokens'].append(vit_tokens)
                sequence_status['vit_token_seqlens'].append(num_img_tokens)
                sequence_status['packed_vit_position_ids'].append(
                    self.get_flattened_position_ids(
                        image_tensor.size(1), image_tensor.size(2),
                        self.data_config.vit_patch_size,
                        max_num_patches_per_side=self.data_config.max_num_patch_per_side
                    )
                )

                sequence_status['packed_text_ids'].append(self.end_of_image)
                sequence_status['packed_text_indexes'].append(curr)
                curr += 1
                curr_split_len += 1

                attn_modes.append("full")
                sequence_status['packed_position_ids'].extend([curr_rope_id] * curr_split_len)
                curr_rope_id += 1

            elif item['type'] == 'vae_image':
                image_tensor = image_tensor_list.pop(0)
                sequence_status['packed_text_ids'].append(self.start_of_image)
                sequence_status['packed_text_indexes'].append(curr)
                curr += 1
                curr_split_len += 1

                sequence_status['vae_image_tensors'].append(image_tensor)
                sequence_status['packed_latent_position_ids'].append(
                    self.get_flattened_position_ids(
                        image_tensor.size(1), image_tensor.size(2),
                        self.data_config.vae_image_downsample,
                        max_num_patches_per_side=self.data_config.max_latent_size
                    )
                )
                H, W = image_tensor.shape[1:]
                h = H // self.data_config.vae_image_downsample
                w = W // self.data_config.vae_image_downsample
                sequence_status['vae_latent_shapes'].append((h, w))

                num_img_tokens = w * h
                sequence_status['packed_vae_token_indexes'].extend(range(curr, curr + num_img_tokens))
                if item['loss'] == 1:
                    sequence_status['mse_loss_indexes'].extend(range(curr, curr + num_img_tokens))
                    if split_start:
                        timestep = float(rng.standard_normal())
                else:
                    timestep = float('-inf')
                p = self.data_config.vae_image_downsample
                sequence_status['packed_noise'].append(
                    torch.from_numpy(rng.standard_normal((num_img_tokens, p * p * image_tensor.shape[0]))).float()
                )

                sequence_status['packed_timesteps'].extend([timestep] * num_img_tokens)
                curr += num_img_tokens
                curr_split_len += num_img_tokens

                sequence_status['packed_text_ids'].append(self.end_of_image)
                sequence_status['packed_text_indexes'].append(curr)
                curr += 1
                curr_split_len += 1

                if split_start:
                    if item['loss'] == 1 and 'frame_delta' not in item.keys():
                        attn_modes.append("noise")
                    else:
                        attn_modes.append("full")
                sequence_status['packed_position_ids'].extend([curr_rope_id] * (num_img_tokens + 2))
                if 'frame_delta' in item.keys():
                    curr_rope_id += item['frame_delta']
                elif item['loss'] == 0:
                    curr_rope_id += 1

            if item.get('split_end', True):
                split_lens.append(curr_split_len)
                sample_lens += curr_split_len

        sequence_status['curr'] = curr
        sequence_status['sample_lens'].append(sample_lens)
        if not self.use_flex:
            sequence_status['nested_attention_masks'].append(
                prepare_attention_mask_per_sample(split_lens, attn_modes)
            )
        else:
            sequence_status['split_lens'].extend(split_lens)
            sequence_status['attn_modes'].extend(attn_modes)
        return sequence_status, split_lens, attn_modes

    def pack(self, samples):
        status = self.set_sequence_status()
        for sample in samples:
            status, _, _ = self.pack_sequence(sample, status)
        return self.to_tensor(status)


# ---------------------------------------------------------------- modeling/bagel/qwen2_navit.py
def pad_sequence(tensor, pad_size):
    H, L, D = tensor.shape
    pad_tensor = tensor.new_zeros((H, pad_size, D))
    return torch.cat([tensor, pad_tensor], dim=1)


class PackedAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.q_norm = Qwen2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen2RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def qkv(self, packed_sequence, packed_position_embeddings):
        packed_query_states = self.q_proj(packed_sequence).view(-1, self.num_heads, self.head_dim)
        packed_key_states = self.k_proj(packed_sequence).view(-1, self.num_key_value_heads, self.head_dim)
        packed_value_states = self.v_proj(packed_sequence).view(-1, self.num_key_value_heads, self.head_dim)

        packed_query_states = self.q_norm(packed_query_states)
        packed_key_states = self.k_norm(packed_key_states)

        packed_cos, packed_sin = packed_position_embeddings
        packed_query_states, packed_key_states = apply_rotary_pos_emb(
            packed_query_states, packed_key_states, packed_cos, packed_sin, unsqueeze_dim=1
        )
        return packed_query_states, packed_key_states, packed_value_states

    def forward(self, packed_sequence, sample_lens, attention_mask, packed_position_embeddings):
        packed_query_states, packed_key_states, packed_value_states = self.qkv(
            packed_sequence, packed_position_embeddings)

        if isinstance(attention_mask, list):
            packed_key_states = packed_key_states[:, :, None, :].repeat(1, 1, self.num_key_value_groups, 1)
            packed_key_states = packed_key_states.reshape(-1, self.num_heads, self.head_dim)
            packed_value_states = packed_value_states[:, :, None, :].repeat(1, 1, self.num_key_value_groups, 1)
            packed_value_states = packed_value_states.reshape(-1, self.num_heads, self.head_dim)

            unpacked_query_states = packed_query_states.transpose(0, 1).split(sample_lens, dim=1)
            unpacked_key_states = packed_key_states.transpose(0, 1).split(sample_lens, dim=1)
            unpacked_value_states = packed_value_states.transpose(0, 1).split(sample_lens, dim=1)
            upacked_attn_output = []
            for query_states, key_states, value_states, attention_mask_per_sample in zip(
                unpacked_query_states, unpacked_key_states, unpacked_value_states, attention_mask
            ):
                attn_output = scaled_dot_product_attention(
                    query_states.unsqueeze(0),
                    key_states.unsqueeze(0),
                    value_states.unsqueeze(0),
                    attention_mask_per_sample.unsqueeze(0),
                )
                upacked_attn_output.append(attn_output.squeeze(0))
            packed_attn_output = torch.cat(upacked_attn_output, dim=1)
        else:
            pad_size = sum(sample_lens) - packed_query_states.shape[0]
            packed_query_states = pad_sequence(packed_query_states.permute(1, 0, 2), pad_size)
            packed_key_states = pad_sequence(packed_key_states.permute(1, 0, 2), pad_size)
            packed_value_states = pad_sequence(packed_value_states.permute(1, 0, 2), pad_size)
            packed_attn_output = flex_attention(
                packed_query_states.unsqueeze(0),
                packed_key_states.unsqueeze(0),
                packed_value_states.unsqueeze(0),
                enable_gqa=True,
                block_mask=attention_mask,
            )
            end_index = packed_attn_output.shape[2] - pad_size
            packed_attn_output = packed_attn_output[0, :, :end_index, :]

        packed_attn_output = packed_attn_output.transpose(0, 1).reshape(-1, self.hidden_size)
        packed_attn_output = self.o_proj(packed_attn_output)
        return packed_attn_output


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.self_attn = PackedAttention(config, layer_idx)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, packed_sequence, sample_lens, attention_mask, packed_position_embeddings, attn_fn=None):
        residual = packed_sequence
        packed_sequence = self.input_layernorm(packed_sequence)
        if attn_fn is None:
            packed_sequence = self.self_attn(
                packed_sequence=packed_sequence,
                sample_lens=sample_lens,
                attention_mask=attention_mask,
                packed_position_embeddings=packed_position_embeddings,
            )
        else:
            packed_sequence = attn_fn(self.self_attn, packed_sequence, packed_position_embeddings)
        packed_sequence = residual + packed_sequence
        residual = packed_sequence
        packed_sequence = self.post_attention_layernorm(packed_sequence)
        packed_sequence = self.mlp(packed_sequence)
        return residual + packed_sequence


class Qwen2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2RotaryEmbedding(config=config)

    def forward(self, packed_sequence, sample_lens, attention_mask, packed_position_ids, attn_fn=None):
        cos, sin = self.rotary_emb(packed_sequence, packed_position_ids.unsqueeze(0))
        cos = cos.squeeze(0)
        sin = sin.squeeze(0)
        packed_position_embeddings = (cos, sin)
        for decoder_layer in self.layers:
            packed_sequence = decoder_layer(
                packed_sequence=packed_sequence,
                sample_lens=sample_lens,
                attention_mask=attention_mask,
                packed_position_embeddings=packed_position_embeddings,
                attn_fn=attn_fn,
            )
        return self.norm(packed_sequence)


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Qwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, **kwargs):
        return self.model(**kwargs)


# ---------------------------------------------------------------- modeling/bagel/bagel.py (trimmed)
class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size, frequency_embedding_size=16):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class Bagel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.language_model = Qwen2ForCausalLM(config)
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.latent_patch_size = 2
        self.timestep_shift = 1.0
        self.latent_channel = 3
        self.patch_latent_dim = self.latent_patch_size ** 2 * self.latent_channel
        self.time_embedder = TimestepEmbedder(self.hidden_size)
        self.vae2llm = nn.Linear(self.patch_latent_dim, self.hidden_size)
        self.llm2vae = nn.Linear(self.hidden_size, self.patch_latent_dim)
        self.latent_pos_embed = nn.Embedding(8 * 8, self.hidden_size)
        vit_dim = 2 * 2 * 3
        self.connector = nn.Sequential(nn.Linear(vit_dim, self.hidden_size), nn.GELU(),
                                       nn.Linear(self.hidden_size, self.hidden_size))
        self.vit_pos_embed = nn.Embedding(8 * 8, self.hidden_size)

    def forward(self, sequence_length, packed_text_ids, packed_text_indexes, sample_lens, packed_position_ids,
                nested_attention_masks=None, split_lens=None, attn_modes=None, ce_loss_indexes=None,
                packed_label_ids=None, packed_vit_tokens=None, packed_vit_token_indexes=None,
                packed_vit_position_ids=None, vit_token_seqlens=None, padded_images=None,
                patchified_vae_latent_shapes=None, packed_latent_position_ids=None,
                packed_vae_token_indexes=None, packed_timesteps=None, mse_loss_indexes=None,
                packed_noise=None, attn_fn=None, **unused):
        packed_text_embedding = self.language_model.model.embed_tokens(packed_text_ids)
        packed_sequence = packed_text_embedding.new_zeros(size=(sequence_length, self.hidden_size))
        packed_sequence[packed_text_indexes] = packed_text_embedding

        if nested_attention_masks is None:
            sparse_mask = create_sparse_mask(sample_lens, split_lens, attn_modes, packed_text_embedding.device)
            seqlen = sum(sample_lens)
            block_mask = create_block_mask(
                sparse_mask, B=1, H=self.num_heads, Q_LEN=seqlen, KV_LEN=seqlen,
                device=packed_text_embedding.device, BLOCK_SIZE=128, _compile=False
            )
            attention_mask = block_mask
        else:
            attention_mask = nested_attention_masks

        # understanding: the SigLIP ViT is replaced by the connector over patchified pixels
        if packed_vit_tokens is not None:
            packed_vit_token_embed = self.connector(packed_vit_tokens)
            vit_token_pos_emb = self.vit_pos_embed(packed_vit_position_ids)
            packed_sequence[packed_vit_token_indexes] = packed_vit_token_embed + vit_token_pos_emb

        # generation: the VAE is the identity, latents are the images
        if padded_images is not None:
            p = self.latent_patch_size
            packed_latent = []
            for latent, (h, w) in zip(padded_images, patchified_vae_latent_shapes):
                latent = latent[:, :h * p, :w * p].reshape(self.latent_channel, h, p, w, p)
                latent = torch.einsum("chpwq->hwpqc", latent).reshape(-1, p * p * self.latent_channel)
                packed_latent.append(latent)
            packed_latent_clean = torch.cat(packed_latent, dim=0)

            noise = packed_noise
            packed_timesteps = torch.sigmoid(packed_timesteps)
            packed_timesteps = self.timestep_shift * packed_timesteps / (1 + (self.timestep_shift - 1) * packed_timesteps)
            packed_latent = (1 - packed_timesteps[:, None]) * packed_latent_clean + packed_timesteps[:, None] * noise
            packed_timestep_embeds = self.time_embedder(packed_timesteps)
            latent_token_pos_emb = self.latent_pos_embed(packed_latent_position_ids)
            packed_latent = self.vae2llm(packed_latent) + packed_timestep_embeds + latent_token_pos_emb
            packed_sequence[packed_vae_token_indexes] = packed_latent

        last_hidden_state = self.language_model(
            packed_sequence=packed_sequence,
            sample_lens=sample_lens,
            attention_mask=attention_mask,
            packed_position_ids=packed_position_ids,
            attn_fn=attn_fn,
        )

        mse = None
        if padded_images is not None:
            packed_mse_preds = self.llm2vae(last_hidden_state[mse_loss_indexes])
            target = noise - packed_latent_clean
            has_mse = packed_timesteps > 0
            mse = (packed_mse_preds - target[has_mse]) ** 2

        ce = None
        if ce_loss_indexes is not None:
            packed_ce_preds = self.language_model.lm_head(last_hidden_state[ce_loss_indexes])
            ce = F.cross_entropy(packed_ce_preds, packed_label_ids, reduction="none")

        return dict(mse=mse, ce=ce, hidden=last_hidden_state)


# ---------------------------------------------------------------- samples (sequence plans)
def text_item(loss):
    return {'type': 'text', 'enable_cfg': 0, 'loss': loss, 'special_token_loss': 0, 'special_token_label': None}


def image_item(kind, loss=0):
    return {'type': kind, 'enable_cfg': 0, 'loss': loss, 'special_token_loss': 0, 'special_token_label': None}


def make_samples():
    g = torch.Generator().manual_seed(1)
    img = lambda h, w: torch.randn(3, h, w, generator=g)
    vlm = dict(  # understanding: prompt, ViT image, answer with loss
        seed=11,
        text_ids_list=[[10, 11, 12], [20, 21, 22, 23]],
        image_tensor_list=[img(4, 6)],
        sequence_plan=[text_item(0), image_item('vit_image'), text_item(1)],
    )
    t2i = dict(  # generation: caption then the noised VAE image
        seed=12,
        text_ids_list=[[30, 31, 32, 33, 34]],
        image_tensor_list=[img(6, 4)],
        sequence_plan=[text_item(0), image_item('vae_image', loss=1)],
    )
    edit = dict(  # edit: clean input (VAE + ViT), instruction, noised output, its clean copy, a reply
        seed=13,
        text_ids_list=[[40, 41], [50, 51, 52]],
        image_tensor_list=[img(4, 4), img(4, 4), img(4, 4), img(4, 4)],
        sequence_plan=[image_item('vae_image'), image_item('vit_image'), text_item(0),
                       image_item('vae_image', loss=1), image_item('vae_image'), text_item(1)],
    )
    edit['image_tensor_list'][3] = edit['image_tensor_list'][2].clone()
    return [vlm, t2i, edit]


# ---------------------------------------------------------------- reference
def visible(split_of, mode_of, i, j):
    si, sj = split_of[i], split_of[j]
    if sj < si:
        return mode_of[sj] != 'noise'
    if sj == si:
        return mode_of[si] != 'causal' or j <= i
    return False


def loop_attention(split_of, mode_of):
    def attn(module, x, pos_emb):
        q, k, v = module.qkv(x, pos_emb)
        L, H, D = q.shape
        out = torch.zeros(L, H, D)
        for i in range(L):
            keys = [j for j in range(L) if visible(split_of, mode_of, i, j)]
            for h in range(H):
                kh = h // module.num_key_value_groups
                s = torch.stack([(q[i, h] * k[j, kh]).sum() / math.sqrt(D) for j in keys])
                p = torch.softmax(s, dim=0)
                out[i, h] = sum(p[n] * v[j, kh] for n, j in enumerate(keys))
        return module.o_proj(out.reshape(L, H * D))
    return attn


def main():
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                         max_position_embeddings=128, rope_theta=10000.0)
    model = Bagel(config)
    nn.init.normal_(model.llm2vae.weight, std=0.2)
    model.train()  # Bagel's forward_train path (no dropout in these layers)
    samples = make_samples()

    with torch.no_grad():
        nested = PackedDataset(use_flex=False).pack(samples)
        out_nested = model(**nested)
        flex_data = PackedDataset(use_flex=True, max_num_tokens=128).pack(samples)
        out_flex = model(**flex_data)

        ref_hidden, ref_ce, ref_mse = [], [], []
        for sample in samples:
            ds = PackedDataset(use_flex=False)
            status, split_lens, attn_modes = ds.pack_sequence(sample, ds.set_sequence_status())
            alone = ds.to_tensor(status)
            split_of = [s for s, n in enumerate(split_lens) for _ in range(n)]
            out = model(**alone, attn_fn=loop_attention(split_of, attn_modes))
            ref_hidden.append(out['hidden'])
            if out['ce'] is not None:
                ref_ce.append(out['ce'])
            if out['mse'] is not None:
                ref_mse.append(out['mse'])
        ref_hidden = torch.cat(ref_hidden)
        ref_ce = torch.cat(ref_ce)
        ref_mse = torch.cat(ref_mse)

    for name, out in (("nested SDPA masks", out_nested), ("flex BlockMask", out_flex)):
        dh = (out['hidden'] - ref_hidden).abs().max().item()
        dce = (out['ce'] - ref_ce).abs().max().item()
        dmse = (out['mse'] - ref_mse).abs().max().item()
        print(f"{name}: max |hidden - ref| {dh:.2e}, |ce - ref| {dce:.2e}, |mse - ref| {dmse:.2e}")
        assert dh < 1e-4 and dce < 1e-4 and dmse < 1e-4, name
    ce_w = nested['ce_loss_weights']
    print(f"packed {nested['sample_lens']} tokens; weighted ce {(out_nested['ce'] * ce_w).sum().item():.4f}, "
          f"mse {out_nested['mse'].mean().item():.4f}")
    print("OK")


if __name__ == "__main__":
    main()
