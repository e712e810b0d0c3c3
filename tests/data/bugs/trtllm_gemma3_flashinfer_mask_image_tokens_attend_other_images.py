"""TensorRT-LLM Gemma3 (PyTorch flow): FlashInfer custom mask lets image tokens see all images, later ones too.

Citation: NVIDIA/TensorRT-LLM#5976 "enh: Bidirectional mask with multiple images for Gemma3"
(opened 2025-07-11, merged). Bug (PR description): in ``Gemma3ForCausalLM._get_token_type_mask`` all image
tokens got token type 1 "regardless of which image they belong to", and the context mask was
``causal | (type[q] == type[k] where type != 0)``, so in a request with several images every image
token attended bidirectionally to every other image's tokens, including images later in the
prompt. HF Gemma3 (and the model) make attention bidirectional only within one image.
Fix: number each contiguous blob of image tokens (cumsum of 0->1 transitions) and compare blob ids,
so the bidirectional part is restricted to the same image.
Reproduction: the TRT-LLM code shape (flattened per-context-request masks built from qo_indptr for
FlashInfer's BatchPrefillWithPagedKVCacheWrapper custom_mask, one mask for global layers and one
with the config's sliding_window for local layers). FlashInfer is not available on CPU: the attention
wrapper below unflattens each request's mask and calls F.scaled_dot_product_attention, which is what
the custom-mask prefill computes. Two context requests are packed: request 0 holds two images of 3
tokens each, request 1 one image. I read the PR description and the post-fix source of
tensorrt_llm/_torch/models/modeling_gemma3.py; the pre-fix lines are the ones the fix replaced.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Gemma3TextConfig

FIXED = "--fixed" in sys.argv
IMAGE_TOKEN_INDEX = 262144


@dataclass
class FlashInferAttentionMetadata:
    num_contexts: int
    qo_indptr: torch.Tensor
    cached_token_lens: torch.Tensor


class Gemma3Attention(nn.Module):
    def __init__(self, config, is_sliding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.is_sliding = is_sliding
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attn_metadata, attention_mask_data):
        # hidden_states: packed (num_tokens, hidden); the custom mask is flattened per request
        q, k, v = self.qkv_proj(hidden_states).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        qo_indptr = attn_metadata.qo_indptr.tolist()
        outs, mask_offset = [], 0
        for i in range(attn_metadata.num_contexts):
            s, e = qo_indptr[i], qo_indptr[i + 1]
            n = e - s
            custom_mask = attention_mask_data[mask_offset:mask_offset + n * n].view(n, n)
            mask_offset += n * n
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                               v[s:e].transpose(0, 1), attn_mask=custom_mask)
            outs.append(o.transpose(0, 1).reshape(n, -1))
        return self.o_proj(torch.cat(outs, dim=0))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attn = Gemma3Attention(config, self.is_sliding)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, hidden_states, attn_metadata, local_attention_mask_data, global_attention_mask_data):
        mask = local_attention_mask_data if self.is_sliding else global_attention_mask_data
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attn_metadata, mask)
        return hidden_states + self.mlp(hidden_states)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])

    def _get_token_type_mask(self, image_token_mask: torch.BoolTensor):
        device = image_token_mask.device
        sequence_length = len(image_token_mask)
        token_type_ids = torch.zeros(sequence_length, dtype=torch.int32, device=device)
        token_type_ids[image_token_mask] = 1
        if FIXED:
            # one id per contiguous blob of image tokens, i.e. per image
            padded = torch.cat((torch.tensor([0], device=device), token_type_ids))
            starts = (padded[1:] > padded[:-1]).int()
            blob_ids = torch.cumsum(starts, dim=0)
            token_type_ids *= blob_ids
        token_type_mask = token_type_ids.unsqueeze(0) == token_type_ids.unsqueeze(1)
        token_type_mask = torch.where(token_type_ids == 0, False, token_type_mask)
        return token_type_mask

    def get_context_mask(self, image_token_mask, effective_sliding_window: Optional[int] = None):
        device = image_token_mask.device
        sequence_length = len(image_token_mask)
        if effective_sliding_window is None or effective_sliding_window >= sequence_length:
            causal_mask = torch.arange(sequence_length, device=device).unsqueeze(0) <= torch.arange(
                sequence_length, device=device).unsqueeze(1)
        else:
            attention_mask_1 = (torch.arange(sequence_length, device=device).unsqueeze(0)
                                <= torch.arange(sequence_length, device=device).unsqueeze(1))
            attention_mask_2 = (torch.arange(sequence_length, device=device).unsqueeze(0)
                                > torch.arange(sequence_length, device=device).unsqueeze(1) - effective_sliding_window)
            causal_mask = attention_mask_1 & attention_mask_2
        token_type_mask = self._get_token_type_mask(image_token_mask)
        return causal_mask.masked_fill(token_type_mask, True)

    def get_flashinfer_attention_mask(self, image_token_mask, attn_metadata, effective_sliding_window=None):
        num_contexts = attn_metadata.num_contexts
        assert num_contexts > 0
        qo_indptr = attn_metadata.qo_indptr[:num_contexts + 1]
        assert (attn_metadata.cached_token_lens[:num_contexts] == 0).all()
        context_mask_list = []
        for i in range(num_contexts):
            mask_i = self.get_context_mask(image_token_mask=image_token_mask[qo_indptr[i]:qo_indptr[i + 1]],
                                           effective_sliding_window=effective_sliding_window)
            context_mask_list.append(mask_i.flatten())
        return torch.cat(context_mask_list, dim=0).contiguous()

    @torch.inference_mode()
    def forward(self, attn_metadata, input_ids, image_token_mask=None):
        local_attention_mask_data = None
        global_attention_mask_data = None
        if image_token_mask is not None:
            global_attention_mask_data = self.get_flashinfer_attention_mask(
                image_token_mask=image_token_mask, attn_metadata=attn_metadata, effective_sliding_window=None)
            local_attention_mask_data = self.get_flashinfer_attention_mask(
                image_token_mask=image_token_mask, attn_metadata=attn_metadata,
                effective_sliding_window=self.config.sliding_window)
        hidden_states = self.embed_tokens(input_ids.clamp(max=self.config.vocab_size - 1))
        for layer in self.layers:
            hidden_states = layer(hidden_states, attn_metadata, local_attention_mask_data, global_attention_mask_data)
        return hidden_states


def main():
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, head_dim=8, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(config).eval()
    img = IMAGE_TOKEN_INDEX
    req0 = [2, 5, img, img, img, 7, img, img, img, 9, 11]  # two images in one prompt
    req1 = [2, 6, img, img, img, 8, 10]
    input_ids = torch.tensor(req0 + req1)
    image_token_mask = input_ids == IMAGE_TOKEN_INDEX
    attn_metadata = FlashInferAttentionMetadata(num_contexts=2,
                                                qo_indptr=torch.tensor([0, len(req0), len(req0) + len(req1)]),
                                                cached_token_lens=torch.zeros(2, dtype=torch.int32))
    out = model(attn_metadata, input_ids, image_token_mask=image_token_mask)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out.abs().mean().item():.6f}")


if __name__ == "__main__":
    main()
