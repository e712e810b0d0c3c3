"""LLaVA: prepare_inputs_labels_for_multimodal pads the batch but returns attention_mask=None.

Citation: haotian-liu/LLaVA#1720 ("[Bug]: Need to return attention_mask when padding"); the issue
links the batch-inference reports #1149 and #1305. The fix below is the one written in the issue
(the thread shows no merged commit).

Bug: LlavaMetaForCausalLM.prepare_inputs_labels_for_multimodal (llava/model/llava_arch.py) splices
each sample's image features into its text embeddings; with v1.6 "anyres" images of different
shapes the samples get different lengths, so it re-pads them (left, when
config.tokenizer_padding_side == "left") and builds a fresh attention_mask for that padding. But
at the end it does ``if _attention_mask is None: attention_mask = None``, so when the caller gave
no mask (the prompts themselves had equal length) the padding it just added is thrown away and
the language model attends the zero pad embeddings.
Fix (from the issue): return the rebuilt mask whenever it pads, i.e. only drop it when
``attention_mask.all()``.

Reproduction: two prompts of the same token length, no attention_mask, images giving 6 and 3
feature tokens; a small Llama-style decoder that, like LlamaModel under SDPA, uses is_causal when
it is handed no mask and otherwise a causal & padding mask.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

IGNORE_INDEX = -100
IMAGE_TOKEN_INDEX = -200


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.SiLU(),
                                 nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, hidden_states, causal_mask):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask,
                                              is_causal=causal_mask is None and q_len > 1)
        attn = attn.transpose(1, 2).reshape(bsz, q_len, -1)
        hidden_states = hidden_states + self.o_proj(attn)
        return hidden_states + self.mlp(hidden_states)


class LlavaLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mm_projector = nn.Sequential(nn.Linear(config.mm_hidden_size, config.hidden_size), nn.GELU(),
                                          nn.Linear(config.hidden_size, config.hidden_size))
        self.layers = nn.ModuleList([LlamaDecoderLayer(config.hidden_size, config.num_attention_heads)
                                     for _ in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def encode_images(self, images):
        # stand-in for the CLIP tower output: one (num_patches, mm_hidden_size) tensor per image
        return [self.mm_projector(image) for image in images]

    def prepare_inputs_labels_for_multimodal(self, input_ids, position_ids, attention_mask,
                                             past_key_values, labels, images):
        image_features = self.encode_images(images)

        _labels = labels
        _position_ids = position_ids
        _attention_mask = attention_mask
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            attention_mask = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(0, input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        if labels is None:
            labels = torch.full_like(input_ids, IGNORE_INDEX)

        input_ids = [cur_input_ids[cur_attention_mask]
                     for cur_input_ids, cur_attention_mask in zip(input_ids, attention_mask)]
        labels = [cur_labels[cur_attention_mask] for cur_labels, cur_attention_mask in zip(labels, attention_mask)]

        new_input_embeds = []
        new_labels = []
        cur_image_idx = 0
        for batch_idx, cur_input_ids in enumerate(input_ids):
            image_token_indices = [-1] + torch.where(cur_input_ids == IMAGE_TOKEN_INDEX)[0].tolist() + \
                [cur_input_ids.shape[0]]
            cur_input_ids_noim = []
            cur_labels = labels[batch_idx]
            cur_labels_noim = []
            for i in range(len(image_token_indices) - 1):
                cur_input_ids_noim.append(cur_input_ids[image_token_indices[i] + 1:image_token_indices[i + 1]])
                cur_labels_noim.append(cur_labels[image_token_indices[i] + 1:image_token_indices[i + 1]])
            split_sizes = [x.shape[0] for x in cur_labels_noim]
            cur_input_embeds = self.embed_tokens(torch.cat(cur_input_ids_noim))
            cur_input_embeds_no_im = torch.split(cur_input_embeds, split_sizes, dim=0)
            cur_new_input_embeds = []
            cur_new_labels = []
            for i in range(len(image_token_indices) - 1):
                cur_new_input_embeds.append(cur_input_embeds_no_im[i])
                cur_new_labels.append(cur_labels_noim[i])
                if i < len(image_token_indices) - 2:
                    cur_image_features = image_features[cur_image_idx]
                    cur_image_idx += 1
                    cur_new_input_embeds.append(cur_image_features)
                    cur_new_labels.append(torch.full((cur_image_features.shape[0],), IGNORE_INDEX,
                                                     device=cur_labels.device, dtype=cur_labels.dtype))
            new_input_embeds.append(torch.cat(cur_new_input_embeds))
            new_labels.append(torch.cat(cur_new_labels))

        # Combine them
        max_len = max(x.shape[0] for x in new_input_embeds)
        batch_size = len(new_input_embeds)

        new_input_embeds_padded = []
        new_labels_padded = torch.full((batch_size, max_len), IGNORE_INDEX, dtype=new_labels[0].dtype)
        attention_mask = torch.zeros((batch_size, max_len), dtype=attention_mask.dtype)
        position_ids = torch.zeros((batch_size, max_len), dtype=position_ids.dtype)

        for i, (cur_new_embed, cur_new_labels) in enumerate(zip(new_input_embeds, new_labels)):
            cur_len = cur_new_embed.shape[0]
            if getattr(self.config, 'tokenizer_padding_side', 'right') == "left":
                new_input_embeds_padded.append(torch.cat((
                    torch.zeros((max_len - cur_len, cur_new_embed.shape[1]), dtype=cur_new_embed.dtype),
                    cur_new_embed), dim=0))
                if cur_len > 0:
                    new_labels_padded[i, -cur_len:] = cur_new_labels
                    attention_mask[i, -cur_len:] = True
                    position_ids[i, -cur_len:] = torch.arange(0, cur_len, dtype=position_ids.dtype)
            else:
                new_input_embeds_padded.append(torch.cat((
                    cur_new_embed,
                    torch.zeros((max_len - cur_len, cur_new_embed.shape[1]), dtype=cur_new_embed.dtype)), dim=0))
                if cur_len > 0:
                    new_labels_padded[i, :cur_len] = cur_new_labels
                    attention_mask[i, :cur_len] = True
                    position_ids[i, :cur_len] = torch.arange(0, cur_len, dtype=position_ids.dtype)

        new_input_embeds = torch.stack(new_input_embeds_padded, dim=0)
        new_labels = None if _labels is None else new_labels_padded

        if FIXED:
            if attention_mask.all():  # Not padded
                if _attention_mask is None:
                    attention_mask = None
                else:
                    attention_mask = attention_mask.to(dtype=_attention_mask.dtype)
        else:
            if _attention_mask is None:
                attention_mask = None
            else:
                attention_mask = attention_mask.to(dtype=_attention_mask.dtype)

        if _position_ids is None:
            position_ids = None

        return None, position_ids, attention_mask, past_key_values, new_input_embeds, new_labels

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, images=None):
        (input_ids, position_ids, attention_mask, past_key_values, inputs_embeds, labels) = \
            self.prepare_inputs_labels_for_multimodal(input_ids, position_ids, attention_mask, None, None, images)
        bsz, seq_len, _ = inputs_embeds.shape
        causal_mask = None
        if attention_mask is not None:
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
            causal_mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask)
        return self.lm_head(hidden_states)


if __name__ == "__main__":
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                             mm_hidden_size=24, tokenizer_padding_side="left")
    model = LlavaLlamaForCausalLM(config).eval()
    # "<s> USER: <image>\n question ASSISTANT:" -- both prompts 7 tokens, so no text padding and no mask
    input_ids = torch.tensor([[1, 5, 6, IMAGE_TOKEN_INDEX, 9, 10, 11],
                              [1, 5, 6, IMAGE_TOKEN_INDEX, 12, 13, 11]])
    images = [torch.randn(6, 24), torch.randn(3, 24)]  # anyres: different numbers of patches
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=None, images=images)
    print("next token", logits[:, -1].argmax(-1).tolist(), "logit %.4f" % logits[1, -1].max().item())
